"""Raw uploads over the real API app and a real store: where the header section ends (so
that Bcc never leaks and every recipient is taken), line ends stored as CRLF, the envelope
sender from the headers, the addresses the SMTP receiver would refuse, and a client that
goes away mid-upload."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any
from urllib.parse import urlencode

import pytest

from tests.api.conftest import TOKEN, api_running, async_test
from tests.api.test_submit import BASE, lines_of, nothing_stored, raw, source_of
from tests.storage.conftest import StoreFactory
from zoneq.protocol.ids import parse_id
from zoneq.queue.rawtext import HEADER_LIMIT
from zoneq.storage import keys

pytestmark = pytest.mark.integration

PAD = b"".join(b"X-Pad-%d: %s\r\n" % (i, b"p" * 70) for i in range(80))  # > one 4 KiB chunk

# (upload, recipients queued, the stored text after the Date and Message-ID we add).
# Every case has a Bcc the stored text must not show, and recipients the parser sees.
SECTIONS: dict[str, tuple[bytes, list[str], bytes]] = {
    "crlf": (
        b"From: a@src.test\r\nTo: bob@ok.test\r\nBcc: s@hidden.test\r\n\r\nbody\r\n",
        ["bob@ok.test", "s@hidden.test"],
        b"From: a@src.test\r\nTo: bob@ok.test\r\n\r\nbody\r\n",
    ),
    "no empty line (headers only, sendmail -t)": (
        b"From: a@src.test\r\nTo: bob@ok.test\r\nBcc: s@hidden.test\r\nSubject: x\r\n",
        ["bob@ok.test", "s@hidden.test"],
        b"From: a@src.test\r\nTo: bob@ok.test\r\nSubject: x\r\n",
    ),
    "no empty line, no last line end": (
        b"From: a@src.test\r\nTo: bob@ok.test\r\nBcc: s@hidden.test",
        ["bob@ok.test", "s@hidden.test"],
        b"From: a@src.test\r\nTo: bob@ok.test\r\n",
    ),
    "bare CR": (
        b"From: a@src.test\rTo: bob@ok.test\rBcc: s@hidden.test\r\rbody\r",
        ["bob@ok.test", "s@hidden.test"],
        b"From: a@src.test\r\nTo: bob@ok.test\r\n\r\nbody\r\n",
    ),
    "bare LF, folded Bcc": (
        b"From: a@src.test\nBcc: s@hidden.test,\n  t@hidden.test\nTo: bob@ok.test\n\nbody\n",
        ["bob@ok.test", "s@hidden.test", "t@hidden.test"],
        b"From: a@src.test\r\nTo: bob@ok.test\r\n\r\nbody\r\n",
    ),
    "mixed ends": (
        b"From: a@src.test\r\nTo: bob@ok.test\nBcc: s@hidden.test\r\r\nbody\rend",
        ["bob@ok.test", "s@hidden.test"],
        b"From: a@src.test\r\nTo: bob@ok.test\r\n\r\nbody\r\nend\r\n",
    ),
    # The parser's rule: the body begins at a line that is no field, so what looks like a
    # Bcc after it is body text (no recipient, and so no recipient disclosed).
    "section ends at a line that is no field": (
        b"From: a@src.test\r\nTo: bob@ok.test\r\nBcc: s@hidden.test\r\nno colon here\r\n"
        b"Bcc: t@body.test\r\n",
        ["bob@ok.test", "s@hidden.test"],
        b"From: a@src.test\r\nTo: bob@ok.test\r\nno colon here\r\nBcc: t@body.test\r\n",
    ),
    "section longer than a chunk": (
        b"From: a@src.test\r\nTo: bob@ok.test\r\n"
        + PAD
        + b"To: late@ok.test\r\nBcc: s@hidden.test\r\n\r\nbody\r\n",
        ["bob@ok.test", "late@ok.test", "s@hidden.test"],
        b"From: a@src.test\r\nTo: bob@ok.test\r\n" + PAD + b"To: late@ok.test\r\n\r\nbody\r\n",
    ),
}
# How the client sends the upload: whole, an octet per write, 4,000-octet writes (the
# server reads what has arrived by then, so where the intake's pieces are cut is up to the
# network: every cut is covered by the unit tests in tests/queue/test_rawtext.py).
CUTS = {"whole": 0, "octets": 1, "pieces": 4000}


async def pieces(data: bytes, size: int) -> AsyncIterator[bytes]:
    for start in range(0, len(data), size):
        yield data[start : start + size]


def added_fields(stored: bytes) -> tuple[bytes, bytes]:
    """The Date and Message-ID lines the intake puts on top, and the rest."""
    date, message_id, rest = stored.split(b"\r\n", 2)
    assert date.startswith(b"Date: ") and message_id.startswith(b"Message-ID: ")
    return date + b"\r\n" + message_id + b"\r\n", rest


@pytest.mark.parametrize("cut", sorted(CUTS))
@pytest.mark.parametrize("case", sorted(SECTIONS))
@async_test
async def test_bcc_removed_and_every_recipient_taken_wherever_the_section_ends(
    stores: StoreFactory, case: str, cut: str
) -> None:
    upload, recipients, expected = SECTIONS[case]
    store = stores.open(chunk_size=4096)
    body: Any = pieces(upload, CUTS[cut]) if CUTS[cut] else upload
    async with api_running(store) as api:
        status, answer = await raw(api, body)
        assert status == 201, answer
        assert answer["recipients"] == recipients
        await store.drain()
        stored = source_of(store, answer["id"])
        assert b"hidden.test" not in stored  # RFC 5322 3.6.3: no recipient sees a Bcc
        _, rest = added_fields(stored)
        assert rest == expected
        assert stored.count(b"Date:") == 1  # not added twice, nor missed past a chunk
        meta = store.message(parse_id(answer["id"]))
        assert meta.size == len(stored) == answer["size"]
        assert meta.sender == "a@src.test"


# (upload, stored): line ends made CRLF, whatever the upload had; the envelope is given.
LINE_ENDS = {
    "clean": (b"Subject: x\r\n\r\na\r\nb\r\n", b"Subject: x\r\n\r\na\r\nb\r\n"),
    "LF": (b"Subject: x\n\na\nb\n", b"Subject: x\r\n\r\na\r\nb\r\n"),
    "CR": (b"Subject: x\r\ra\rb\r", b"Subject: x\r\n\r\na\r\nb\r\n"),
    "no last line end": (b"Subject: x\r\n\r\na\r\nb", b"Subject: x\r\n\r\na\r\nb\r\n"),
    "CR CRLF": (b"Subject: x\r\n\r\na\r\r\nb\r\n", b"Subject: x\r\n\r\na\r\n\r\nb\r\n"),
    "LF CR": (b"Subject: x\r\n\r\na\n\rb\r\n", b"Subject: x\r\n\r\na\r\n\r\nb\r\n"),
    "bare dot lines": (
        b"Subject: x\n\na\n.\nb\r.\rc",
        b"Subject: x\r\n\r\na\r\n.\r\nb\r\n.\r\nc\r\n",
    ),
    "ends in CR": (b"Subject: x\r\n\r\na\r", b"Subject: x\r\n\r\na\r\n"),
}


@pytest.mark.parametrize("cut", sorted(CUTS))
@pytest.mark.parametrize("case", sorted(LINE_ENDS))
@async_test
async def test_line_ends_are_stored_as_crlf_and_the_size_is_exact(
    stores: StoreFactory, case: str, cut: str
) -> None:
    upload, expected = LINE_ENDS[case]
    store = stores.open(chunk_size=4096)
    upload += b"filler\n" * 1000  # over one chunk, so a CR can fall on a chunk's edge
    expected += b"filler\r\n" * 1000
    if not LINE_ENDS[case][0].endswith((b"\r", b"\n")):  # the filler continues that line
        expected = expected.replace(b"\r\nfiller", b"filler", 1)
    body: Any = pieces(upload, CUTS[cut]) if CUTS[cut] else upload
    async with api_running(store) as api:
        status, answer = await raw(api, body, "?from=a@src.test&to=b@ok.test")
        assert status == 201, answer
        await store.drain()
        stored = source_of(store, answer["id"])
        _, rest = added_fields(stored)
        assert rest == expected
        assert b"\r" not in stored.replace(b"\r\n", b"")
        assert b"\n" not in stored.replace(b"\r\n", b"")
        assert store.message(parse_id(answer["id"])).size == len(stored) == answer["size"]


@async_test
async def test_header_section_past_the_limit_is_400_and_nothing_stored(
    stores: StoreFactory,
) -> None:
    store = stores.open(chunk_size=4096)
    fields = b"X-Pad: " + b"p" * 90 + b"\r\n"
    endless = b"From: a@src.test\r\nTo: b@ok.test\r\n" + fields * (HEADER_LIMIT // len(fields) + 2)
    async with api_running(store) as api:
        status, answer = await raw(api, pieces(endless + b"\r\nbody\r\n", 65536))  # type: ignore[arg-type]
        assert status == 400, answer
        assert "header section longer than" in answer["error"]["message"]
        await store.drain()
        assert nothing_stored(store)
        # Just under the limit is taken, and its recipients with it.
        shorter = endless[: HEADER_LIMIT - 1000].rpartition(b"\r\n")[0] + b"\r\nCc: c@ok.test\r\n"
        status, answer = await raw(api, pieces(shorter + b"\r\nbody\r\n", 65536))  # type: ignore[arg-type]
        assert status == 201, answer
        assert answer["recipients"] == ["b@ok.test", "c@ok.test"]


@pytest.mark.parametrize(
    ("headers", "query", "sender", "recipients"),
    [
        # to= without from=: the sender from Sender, else From (never <> by omission).
        (b"From: Al <al@src.test>\r\n", "?to=b@ok.test", "al@src.test", ["b@ok.test"]),
        (b"From: al@src.test\r\nSender: s@src.test\r\n", "?to=b@ok.test", "s@src.test",
         ["b@ok.test"]),
        # from= empty: the null reverse-path, asked for.
        (b"From: al@src.test\r\n", "?from=&to=b@ok.test", "", ["b@ok.test"]),
        (b"From: al@src.test\r\nTo: b@ok.test\r\n", "?from=", "", ["b@ok.test"]),
        (b"From: al@src.test\r\n", "?from=e@src.test&to=b@ok.test", "e@src.test", ["b@ok.test"]),
        # A recipient given twice is queued, and told, once (as the JSON path does).
        (b"From: al@src.test\r\n", "?to=b@ok.test&to=b@ok.test&to=c@ok.test", "al@src.test",
         ["b@ok.test", "c@ok.test"]),
    ],
)  # fmt: skip
@async_test
async def test_envelope_from_the_query_and_the_headers(
    stores: StoreFactory, headers: bytes, query: str, sender: str, recipients: list[str]
) -> None:
    store = stores.open()
    async with api_running(store) as api:
        status, answer = await raw(api, headers + b"Subject: x\r\n\r\nx\r\n", query)
        assert status == 201, answer
        assert answer["recipients"] == recipients
        await store.drain()
        meta = store.message(parse_id(answer["id"]))
        assert meta.sender == sender
        assert sorted(q.recipient.address for q in store.recipients(meta.msg_id)) == recipients


LONG_LABEL = "a" * 64
REFUSED_ADDRESSES = [
    ("victim%evil.test@ok.test", "percent-hack"),
    ("bob@[1.2.3.4", "closing ]"),
    ("a@b@c.test", "dot-string"),
    ("bob@ok.test.", "empty domain label"),
    (f"bob@{LONG_LABEL}.test", "longer than 63"),
    ("bob@[300.1.1.1]", "not an IP address"),
    ("b" * 65 + "@ok.test", "too long"),
    ("é" * 33 + "@ok.test", "too long"),  # 33 characters, 66 octets
    ("b@" + ".".join(["é" * 20] * 7) + ".test", "longer than 254 octets"),
]


@pytest.mark.parametrize(("address", "needle"), REFUSED_ADDRESSES)
@async_test
async def test_addresses_smtp_would_refuse_are_400_on_both_paths(
    stores: StoreFactory, address: str, needle: str
) -> None:
    store = stores.open()
    async with api_running(store) as api:
        status, answer = await raw(
            api, b"From: a@src.test\r\n\r\nx\r\n", "?" + urlencode([("to", address)])
        )
        assert status == 400, answer
        assert needle in answer["error"]["message"]
        if address.count("[") == address.count("]"):
            # In a To field (recipients from the headers) and on the JSON path the same.
            # (An unclosed literal never gets this far there: both read addresses with
            # ``getaddresses``, which closes it; the next test shows what is queued then.)
            status, answer = await raw(
                api, f"To: {address}\r\n\r\nx\r\n".encode(), "?from=a@src.test"
            )
            assert status == 400, answer
            status, answer = await api.call(
                "POST", "/api/v1/messages", json={**BASE, "to": [address]}
            )
            assert status == 400, answer  # mime.build's words or check_address's
        await store.drain()
        assert nothing_stored(store)


@async_test
async def test_unclosed_literal_in_a_field_is_queued_closed_never_a_500(
    stores: StoreFactory,
) -> None:
    store = stores.open()
    async with api_running(store) as api:
        upload = b"From: bob@[1.2.3.4\r\nTo: bob@[1.2.3.4\r\nSubject: s\r\n\r\nx\r\n"
        status, answer = await raw(api, upload)
        assert status == 201, answer
        assert answer["recipients"] == ["bob@[1.2.3.4]"]
        await store.drain()
        meta = store.message(parse_id(answer["id"]))
        assert meta.sender == "bob@[1.2.3.4]"
        assert meta.headers["From"] == "bob@[1.2.3.4"  # as sent: the parser could not read it


@async_test
async def test_client_gone_mid_upload_is_logged_at_info_and_nothing_stored(
    stores: StoreFactory, caplog: pytest.LogCaptureFixture
) -> None:
    store = stores.open(chunk_size=4096)
    caplog.set_level(logging.INFO, logger="zoneq")
    async with api_running(store) as api:
        port = int(api.base.rsplit(":", 1)[1])
        for seen, framing in enumerate(("Content-Length: 1000000", "Transfer-Encoding: chunked")):
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            head = b"From: a@src.test\r\nTo: b@ok.test\r\n\r\n" + lines_of(20_000)
            if framing.startswith("Transfer"):
                head = b"%x\r\n" % len(head) + head + b"\r\n"  # no last chunk: cut off
            writer.write(
                f"POST /api/v1/messages/raw HTTP/1.1\r\nHost: t\r\n"
                f"Authorization: Bearer {TOKEN}\r\n{framing}\r\n\r\n".encode()
                + head
            )
            await writer.drain()
            for _ in range(300):  # bounded: until the server has a chunk of it on disk
                if next(iter(store.database.keys(prefix=keys.MESSAGE)), None) is not None:
                    break
                await asyncio.sleep(0.01)
            writer.close()
            for _ in range(300):  # bounded: until the handler has seen the cut
                if sum("cut off" in r.getMessage() for r in caplog.records) > seen:
                    break
                await asyncio.sleep(0.01)
        await store.drain()
        assert nothing_stored(store)
    cut = [r for r in caplog.records if "cut off" in r.getMessage()]
    assert len(cut) == 2 and all(r.levelno == logging.INFO for r in cut), caplog.records
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.records
