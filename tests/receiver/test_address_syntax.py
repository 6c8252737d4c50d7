"""Envelope address syntax at MAIL and RCPT, through the real receiver and a real queue.

RFC 5321 section 4.1.2: Domain = sub-domain *("." sub-domain), so ``eve@everywhere.test.``
is a syntax error (501 5.1.3, RFC 3463 section 3.2: bad destination mailbox address
syntax).  Accepted, it was queued under a domain of its own, ``everywhere.test.``, with
its own counters, routing and suppression keys, while the HTTP API refused it.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.receiver.harness import MESSAGE, Raw, nothing_left, queued_id, run
from zoneq.receiver import SmtpReceiver
from zoneq.storage.store import QueueStore

EMPTY_LABEL = (
    "501 5.1.3 Bad address syntax: empty domain label (a dot at either end, or two in a row)"
)

BAD = ["eve@everywhere.test.", "eve@.everywhere.test", "eve@everywhere..test", "eve@."]


@pytest.mark.parametrize("address", BAD)
def test_empty_domain_labels_are_refused_at_rcpt_and_mail(tmp_path: Path, address: str) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.greeted(rx.port)
        assert await raw.cmd(f"MAIL FROM:<{address}>") == EMPTY_LABEL
        assert (await raw.cmd("MAIL FROM:<c@d.test>")).startswith("250 ")
        assert await raw.cmd(f"RCPT TO:<{address}>") == EMPTY_LABEL
        # The transaction goes on: a good recipient is taken, and only it is queued.
        assert (await raw.cmd("RCPT TO:<eve@everywhere.test>")).startswith("250 ")
        assert (await raw.cmd("DATA")).startswith("354 ")
        msg_id = queued_id(await raw.cmd(MESSAGE.decode() + "."))
        recipients = [r.recipient.address for r in store.recipients(msg_id)]
        assert recipients == ["eve@everywhere.test"]
        await raw.quit()

    run(tmp_path, body)


def test_a_refused_only_recipient_leaves_nothing_queued(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.greeted(rx.port)
        assert (await raw.cmd("MAIL FROM:<c@d.test>")).startswith("250 ")
        assert await raw.cmd("RCPT TO:<eve@everywhere.test.>") == EMPTY_LABEL
        assert (await raw.cmd("DATA")).startswith("503 ")  # no recipient was taken
        await raw.quit()
        await nothing_left(store)

    run(tmp_path, body)


@pytest.mark.parametrize("address", ["v9@elsewhere.test@ok.test", "w9@@ok.test"])
def test_a_second_unquoted_at_is_refused_at_mail_and_rcpt(tmp_path: Path, address: str) -> None:
    """``user@host@relay``: the old routing through a relay, refused like the percent hack
    (RFC 5321 section 4.1.2: a local part is a Dot-string or a Quoted-string), as the HTTP
    API refuses it.  Quoted, the "@" is only text and the mailbox is taken."""

    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.greeted(rx.port)
        assert await raw.cmd(f"MAIL FROM:<{address}>") == "501 5.1.3 Bad address syntax"
        assert (await raw.cmd("MAIL FROM:<c@d.test>")).startswith("250 ")
        assert await raw.cmd(f"RCPT TO:<{address}>") == "501 5.1.3 Bad address syntax"
        assert (await raw.cmd('RCPT TO:<"v9@elsewhere.test"@ok.test>')).startswith("250 ")
        assert (await raw.cmd("DATA")).startswith("354 ")
        msg_id = queued_id(await raw.cmd(MESSAGE.decode() + "."))
        recipients = [r.recipient.address for r in store.recipients(msg_id)]
        assert recipients == ['"v9@elsewhere.test"@ok.test']
        await raw.quit()

    run(tmp_path, body)
