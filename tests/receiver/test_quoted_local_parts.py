"""A quoted local part and its least quoted spelling are one mailbox, through the real
receiver and a real queue.

RFC 5322 section 3.4.1 (and 3.2.4: a quoted-string is "identical to atom, semantically"):
``"bob"@example.net`` is ``bob@example.net``.  Both were queued as recipients of one
message, so the mailbox got it twice; the sender was stored as given, so DSNs and events
showed it in two spellings.  The receiver now stores the canonical form
(``zoneq.protocol.local_parts``) and the repeat is answered 250, as any repeat is, and
queued once.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.receiver.harness import MESSAGE, Raw, queued_id, run
from zoneq.receiver import SmtpReceiver
from zoneq.storage.store import QueueStore

# (MAIL FROM's path, the RCPT paths in order, the sender stored, the recipients stored)
CASES: dict[str, tuple[str, list[str], str, list[str]]] = {
    "quotes not needed, then none": (
        "c@d.test",
        ['"bob"@example.net', "bob@example.net"],
        "c@d.test",
        ["bob@example.net"],
    ),
    "none, then quotes and quoted-pairs not needed": (
        "c@d.test",
        ["bob@example.net", '"b\\ob"@example.net', '"bob"@example.net'],
        "c@d.test",
        ["bob@example.net"],
    ),
    "a quoted sender is stored unquoted": (
        '"first.last"@d.test',
        ["a@b.test"],
        "first.last@d.test",
        ["a@b.test"],
    ),
    # RFC 5321 4.1.2: a space needs the quotes; a quoted-pair of it does not.
    "quotes needed: kept, quoted-pairs not needed removed": (
        "c@d.test",
        ['"a\\ b"@example.net', '"a b"@example.net'],
        "c@d.test",
        ['"a b"@example.net'],
    ),
    "a leading dot needs the quotes: another mailbox than the dot-atom": (
        "c@d.test",
        ['".bob"@example.net', "bob@example.net"],
        "c@d.test",
        ['".bob"@example.net', "bob@example.net"],
    ),
    "the local part's case is the remote host's (RFC 5321 2.4)": (
        "c@d.test",
        ['"Bob"@example.net', "bob@example.net"],
        "c@d.test",
        ["Bob@example.net", "bob@example.net"],
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_mailbox_is_queued_once(tmp_path: Path, case: str) -> None:
    sender, rcpts, stored_sender, stored = CASES[case]

    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.greeted(rx.port)
        assert (await raw.cmd(f"MAIL FROM:<{sender}>")).startswith("250 ")
        for rcpt in rcpts:
            # A repeat is answered 250, as any repeat is; the commit queues it once.
            assert (await raw.cmd(f"RCPT TO:<{rcpt}>")).startswith("250 "), rcpt
        assert (await raw.cmd("DATA")).startswith("354 ")
        msg_id = queued_id(await raw.cmd(MESSAGE.decode() + "."))
        await store.drain()
        assert store.message(msg_id).sender == stored_sender
        queued = sorted(r.recipient.address for r in store.recipients(msg_id))
        assert queued == sorted(stored)
        await raw.quit()

    run(tmp_path, body)


def test_smtputf8_local_parts_the_same_rule(tmp_path: Path) -> None:
    """RFC 6531 section 3.3 adds non-ASCII to atext: ``"ünï"`` needs no quotes either."""

    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.greeted(rx.port)
        assert (await raw.cmd('MAIL FROM:<"jos\\é"@d.test> SMTPUTF8')).startswith("250 ")
        for rcpt in ['"ünï"@example.net', "ünï@example.net"]:
            assert (await raw.cmd(f"RCPT TO:<{rcpt}>")).startswith("250 "), rcpt
        assert (await raw.cmd("DATA")).startswith("354 ")
        msg_id = queued_id(await raw.cmd(MESSAGE.decode() + "."))
        await store.drain()
        assert store.message(msg_id).sender == "josé@d.test"
        assert [r.recipient.address for r in store.recipients(msg_id)] == ["ünï@example.net"]
        await raw.quit()

    run(tmp_path, body)
