"""Envelope addresses of API submissions (JSON and raw) as queued in a real store: a U-label
domain with an ASCII local part gets its A-label, so the message needs no SMTPUTF8 (RFC
6531: only a non-ASCII local part does), unless the header section as stored is UTF-8 (RFC
6532, a raw upload's); recipients differing only in the case of the domain (RFC 5321
section 2.4) or in its U-label and A-label are queued once."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

import pytest

from tests.api.conftest import Api, api_running, async_test
from tests.api.test_submit import BASE, nothing_stored, raw
from zoneq.protocol.ids import parse_id
from zoneq.storage.store import QueueStore

pytestmark = pytest.mark.integration

BUECHER = "xn--bcher-kva.test"


async def queued(api: Api, status: int, body: Any) -> tuple[str, list[str], bool]:
    """The stored envelope of a 201: sender, recipients (in the envelope's order, as the
    answer lists them: the store keys them otherwise), SMTPUTF8."""
    assert status == 201, body
    await api.store.drain()
    msg_id = parse_id(body["id"])
    meta = api.store.message(msg_id)
    stored = [q.recipient.address for q in api.store.recipients(msg_id)]
    assert sorted(stored) == sorted(body["recipients"])
    return meta.sender, body["recipients"], meta.smtputf8


# (JSON fields over BASE, the sender stored, the recipients stored, SMTPUTF8)
JSON_CASES: dict[str, tuple[dict[str, Any], str, list[str], bool]] = {
    "U-label domain, ASCII local part": (
        {"to": ["bob@bücher.test", "carol@ok.test"]},
        "alice@src.test",
        [f"bob@{BUECHER}", "carol@ok.test"],
        False,
    ),
    "U-label domain in upper case (UTS 46 maps it)": (
        {"to": ["Bob <bob@BÜCHER.test>"]},
        "alice@src.test",
        [f"bob@{BUECHER}"],
        False,
    ),
    "sender at a U-label domain": (
        {"from": "Alice <alice@bücher.test>"},
        f"alice@{BUECHER}",
        ["bob@ok.test"],
        False,
    ),
    "envelope_from at a U-label domain": (
        {"envelope_from": "bounce@bücher.test"},
        f"bounce@{BUECHER}",
        ["bob@ok.test"],
        False,
    ),
    "a non-ASCII local part keeps its domain and needs SMTPUTF8": (
        {"to": ["josé@bücher.test", "bob@bücher.test"]},
        "alice@src.test",
        ["josé@bücher.test", f"bob@{BUECHER}"],
        True,
    ),
    "domain case only: queued once, first spelling": (
        {"to": ["bob@ok.test", "bob@OK.TEST"], "cc": ["bob@Ok.Test"]},
        "alice@src.test",
        ["bob@ok.test"],
        False,
    ),
    "first spelling kept, across to, cc and bcc": (
        {"to": ["carol@EXAMPLE.test"], "bcc": ["carol@example.test"]},
        "alice@src.test",
        ["carol@EXAMPLE.test"],
        False,
    ),
    "local part case matters (RFC 5321 2.4)": (
        {"to": ["bob@ok.test", "Bob@ok.test"]},
        "alice@src.test",
        ["bob@ok.test", "Bob@ok.test"],
        False,
    ),
    "a U-label and its A-label are one domain": (
        {"to": ["bob@bücher.test", f"bob@{BUECHER.upper()}"]},
        "alice@src.test",
        [f"bob@{BUECHER}"],
        False,
    ),
}


@pytest.mark.parametrize("case", list(JSON_CASES))
@async_test
async def test_json_envelope_as_stored(store: QueueStore, case: str) -> None:
    extra, sender, recipients, smtputf8 = JSON_CASES[case]
    async with api_running(store) as api:
        status, body = await api.call("POST", "/api/v1/messages", json={**BASE, **extra})
        assert await queued(api, status, body) == (sender, recipients, smtputf8)


# (query, the header section, the sender stored, the recipients stored, SMTPUTF8)
RAW_CASES: dict[str, tuple[list[tuple[str, str]], bytes, str, list[str], bool]] = {
    "?to= at a U-label domain": (
        [("from", "a@src.test"), ("to", "carol@ok.test"), ("to", "bob@bücher.test")],
        b"Subject: x\r\n",
        "a@src.test",
        ["carol@ok.test", f"bob@{BUECHER}"],
        False,
    ),
    # The envelope has the A-labels, but the header section goes out as sent, in UTF-8
    # (RFC 6532): only to a server that offers SMTPUTF8 (RFC 6531 section 3.2).
    "To and From fields at a U-label domain (RFC 6532 UTF-8 header)": (
        [],
        "From: a@bücher.test\r\nTo: Bob <bob@bücher.test>\r\n".encode(),
        f"a@{BUECHER}",
        [f"bob@{BUECHER}"],
        True,
    ),
    "?to= at a U-label domain, a UTF-8 Subject": (
        [("from", "a@src.test"), ("to", "bob@bücher.test")],
        "Subject: Grüße\r\n".encode(),
        "a@src.test",
        [f"bob@{BUECHER}"],
        True,
    ),
    "a Latin-1 Subject: 8-bit, but no RFC 6532 text": (
        [("from", "a@src.test"), ("to", "bob@ok.test")],
        b"Subject: Gr\xfc\xdfe\r\n",
        "a@src.test",
        ["bob@ok.test"],
        False,
    ),
    "a UTF-8 Bcc field, removed before it is stored": (
        [],
        "From: a@src.test\r\nTo: bob@ok.test\r\nBcc: carol@bücher.test\r\n".encode(),
        "a@src.test",
        ["bob@ok.test", f"carol@{BUECHER}"],
        False,
    ),
    "a UTF-8 body, an ASCII header section (8BITMIME is enough)": (
        [("from", "a@src.test"), ("to", "bob@bücher.test")],
        b"Subject: x\r\n\r\nGr\xc3\xbc\xc3\x9fe",
        "a@src.test",
        [f"bob@{BUECHER}"],
        False,
    ),
    "?from= at a U-label domain": (
        [("from", "a@bücher.test"), ("to", "bob@ok.test")],
        b"Subject: x\r\n",
        f"a@{BUECHER}",
        ["bob@ok.test"],
        False,
    ),
    "?to= with a non-ASCII local part": (
        [("from", "a@src.test"), ("to", "josé@bücher.test")],
        b"Subject: x\r\n",
        "a@src.test",
        ["josé@bücher.test"],
        True,
    ),
    "?to= repeated with the domain in upper case": (
        [("from", "a@src.test"), ("to", "bob@ok.test"), ("to", "bob@OK.TEST")],
        b"Subject: x\r\n",
        "a@src.test",
        ["bob@ok.test"],
        False,
    ),
    "To and Cc name one mailbox in two cases": (
        [],
        b"From: a@src.test\r\nTo: bob@ok.test, carol@ok.test\r\nCc: BOB@ok.test, bob@OK.test\r\n",
        "a@src.test",
        ["bob@ok.test", "carol@ok.test", "BOB@ok.test"],
        False,
    ),
}


@pytest.mark.parametrize("case", list(RAW_CASES))
@async_test
async def test_raw_envelope_as_stored(store: QueueStore, case: str) -> None:
    query, section, sender, recipients, smtputf8 = RAW_CASES[case]
    async with api_running(store) as api:
        text = section + b"\r\nbody\r\n"
        status, body = await raw(api, text, "?" + urlencode(query) if query else "")
        assert await queued(api, status, body) == (sender, recipients, smtputf8)


@pytest.mark.parametrize(
    ("how", "needle"),
    [
        ("json", "to[0]: {1!r} is not a valid domain name (IDNA)"),
        ("query", "recipient {0!r}: {1!r} is not a valid domain name (IDNA 2008)"),
    ],
)
@async_test
async def test_a_domain_idna_refuses_is_400_and_nothing_stored(
    store: QueueStore, how: str, needle: str
) -> None:
    """A U-label that has no A-label (a joiner IDNA 2008 refuses there) is the client's
    error, told at once, rather than a message queued to bounce later."""
    address = "bob@a\u200db.test"
    async with api_running(store) as api:
        if how == "json":
            status, body = await api.call(
                "POST", "/api/v1/messages", json={**BASE, "to": [address]}
            )
        else:
            query = urlencode([("from", "a@src.test"), ("to", address)])
            status, body = await raw(api, b"Subject: x\r\n\r\nbody\r\n", "?" + query)
        assert status == 400, body
        assert needle.format(address, "a\u200db.test") in body["error"]["message"]
        await store.drain()
        assert nothing_stored(store)
