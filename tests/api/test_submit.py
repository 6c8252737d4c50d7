"""Submission: JSON fields built into a message, raw uploads streamed in; header injection
refused in every field; nothing stored unless the answer is 201."""

from __future__ import annotations

import asyncio
import base64
from email import message_from_bytes, policy
from email.parser import BytesHeaderParser
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.api.conftest import Api, api_running, async_test, make_config
from tests.storage.conftest import StoreFactory
from zoneq.api.mime import build
from zoneq.api.models import Submission
from zoneq.protocol.ids import parse_id
from zoneq.queue.intake import Unacceptable
from zoneq.storage import keys
from zoneq.storage.store import QueueStore

pytestmark = pytest.mark.integration

BASE: dict[str, Any] = {
    "from": "Alice <alice@src.test>",
    "to": ["bob@ok.test"],
    "subject": "hello",
    "text": "body text\n",
}


def nothing_stored(store: QueueStore) -> bool:
    """No message, no chunk, no half-received marker, no recipient record."""
    families = (keys.MESSAGE, keys.RECEIVING, keys.READY, keys.DEFERRED, keys.HELD)
    return store.message_count() == 0 and not any(
        list(store.database.keys(prefix=family)) for family in families
    )


def lines_of(size: int, fill: bytes = b"y") -> bytes:
    """``size`` octets of body text in lines of 100 (a line may hold 998, RFC 5322 2.1.1)."""
    return ((fill * 98 + b"\r\n") * (size // 100 + 1))[:size]


def source_of(store: QueueStore, msg_id: str) -> bytes:
    return b"".join(store.body(parse_id(msg_id)))


@async_test
async def test_json_submission_is_queued_with_bcc_in_the_envelope_only(store: QueueStore) -> None:
    async with api_running(store) as api:
        attachment = base64.b64encode(b"\x00\x01binary\xff").decode()
        status, body = await api.call(
            "POST",
            "/api/v1/messages",
            json={
                **BASE,
                "cc": ["Carol <carol@ok.test>"],
                "bcc": ["dave@hidden.test"],
                "html": "<p>hi</p>",
                "headers": {"X-Campaign": "spring"},
                "attachments": [{"filename": "a.bin", "content": attachment}],
            },
        )
        assert status == 201, body
        assert body["recipients"] == ["bob@ok.test", "carol@ok.test", "dave@hidden.test"]
        await store.drain()
        meta = store.message(parse_id(body["id"]))
        assert meta.sender == "alice@src.test"
        assert meta.source["protocol"] == "http"
        assert {q.recipient.address for q in store.recipients(meta.msg_id)} == {
            "bob@ok.test",
            "carol@ok.test",
            "dave@hidden.test",
        }
        text = source_of(store, body["id"])
        assert b"\r\n" in text and b"\n" not in text.replace(b"\r\n", b"")
        assert b"hidden.test" not in text  # RFC 5322 3.6.3: Bcc is not shown
        parsed = message_from_bytes(text, policy=policy.default)
        assert parsed["X-Campaign"] == "spring"
        assert parsed["Message-ID"] and parsed["Date"]
        parts = {p.get_content_type(): p for p in parsed.walk()}
        assert parts["application/octet-stream"].get_content() == b"\x00\x01binary\xff"
        assert "<p>hi</p>" in parts["text/html"].get_content()


INJECTIONS = ["x\r\nBcc: victim@evil.test", "x\nBcc: v@evil.test", "x\rBcc: v", "x\x00y"]
# Every JSON field that ends up in a header or the envelope, with how to put a value there.
FIELDS = {
    "from": lambda v: {"from": f"A <a@src.test>{v}"},
    "from-name": lambda v: {"from": f"{v} <a@src.test>"},
    "to": lambda v: {"to": [f"b@ok.test{v}"]},
    "to-name": lambda v: {"to": [f"{v} <b@ok.test>"]},
    "cc": lambda v: {"cc": [f"c@ok.test{v}"]},
    "bcc": lambda v: {"bcc": [f"d@ok.test{v}"]},
    "reply_to": lambda v: {"reply_to": [f"r@ok.test{v}"]},
    "subject": lambda v: {"subject": v},
    "header-value": lambda v: {"headers": {"X-Tag": v}},
    "header-name": lambda v: {"headers": {f"X-Tag{v}": "1"}},
    "filename": lambda v: {
        "attachments": [{"filename": f"a{v}.txt", "content": base64.b64encode(b"a").decode()}]
    },
    "content_type": lambda v: {
        "attachments": [{"filename": "a", "content_type": f"text/plain{v}", "content": "YQ=="}]
    },
    "envelope_from": lambda v: {"envelope_from": f"e@src.test{v}"},
}


@pytest.mark.parametrize("field", sorted(FIELDS))
@pytest.mark.parametrize("value", INJECTIONS, ids=["crlf", "lf", "cr", "nul"])
@async_test
async def test_header_injection_is_refused_and_nothing_stored(
    stores: StoreFactory, field: str, value: str
) -> None:
    store = stores.open()
    async with api_running(store) as api:
        status, body = await api.call(
            "POST", "/api/v1/messages", json={**BASE, **FIELDS[field](value)}
        )
        assert status == 400, (field, body)
        assert body["error"]["message"]
        await store.drain()
        assert nothing_stored(store)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"headers": {"Bcc": "x@evil.test"}}, "set by zoneq"),
        ({"headers": {"Content-Type": "text/html"}}, "set by zoneq"),
        ({"headers": {"Bad Name": "1"}}, "not a header field name"),
        ({"to": [], "cc": [], "bcc": []}, "no recipients"),
        ({"to": ["not-an-address"]}, "local-part@domain"),
        ({"to": ["a@b.test, c@d.test"]}, "one address"),
        ({"attachments": [{"filename": "a", "content": "!!!"}]}, "base64"),
        ({"bcc ": ["typo@ok.test"]}, "Extra inputs"),
    ],
)
def test_bad_submissions_are_named(extra: dict[str, Any], needle: str) -> None:
    with pytest.raises((Unacceptable, ValueError)) as caught:
        submission = Submission.model_validate({**BASE, **extra})
        build(submission, hostname="mx.test", now_ms=0)
    assert needle in str(caught.value)


@settings(max_examples=200, suppress_health_check=[HealthCheck.too_slow])
@given(
    subject=st.text(alphabet=st.characters(codec="utf-8"), max_size=300),
    name=st.text(max_size=40),
    value=st.text(max_size=200),
)
def test_no_text_adds_a_header_field(subject: str, name: str, value: str) -> None:
    """Property: whatever the subject and a header's value, the built message has exactly
    the fields zoneq writes plus that one; or the input is refused."""
    submission = Submission.model_validate(
        {**BASE, "subject": subject, "headers": {"X-Free": value}, "to": [f"{name} <b@ok.test>"]}
    )
    try:
        data, envelope = build(submission, hostname="mx.test", now_ms=0)
    except Unacceptable:
        return
    parsed = message_from_bytes(data, policy=policy.default)
    assert sorted(k.lower() for k in parsed) == sorted(
        ["from", "to", "subject", "date", "message-id", "x-free", "content-type",
         "content-transfer-encoding", "mime-version"]
    )  # fmt: skip
    assert envelope.recipients == ("b@ok.test",)
    # The value comes back as given (modulo folding whitespace): not cut, not split.
    assert " ".join(str(parsed["X-Free"]).split()) == " ".join(value.split())


RAW = b"From: Alice <alice@src.test>\r\nTo: bob@ok.test\r\nSubject: raw\r\n\r\nraw body\r\n"


async def raw(api: Api, data: bytes, query: str = "") -> tuple[int, Any]:
    return await api.call("POST", f"/api/v1/messages/raw{query}", data=data)


@async_test
async def test_raw_upload_with_envelope_in_the_query(store: QueueStore) -> None:
    async with api_running(store) as api:
        status, body = await raw(api, RAW, "?from=bounce@src.test&to=x@ok.test&to=y@ok.test")
        assert status == 201, body
        assert body["recipients"] == ["x@ok.test", "y@ok.test"]
        stored = source_of(store, body["id"])
        # RFC 5322 3.6 wants a Date and a Message-ID; a submission server adds what is
        # missing (RFC 6409 section 8), on top, and leaves the rest as uploaded.
        added, _, rest = stored.partition(b"From: Alice")
        assert b"From: Alice" + rest == RAW
        fields = BytesHeaderParser(policy=policy.default).parsebytes(stored)
        assert fields["Date"].datetime is not None
        assert str(fields["Message-ID"]).endswith("@mx.zoneq.test>")
        assert added.count(b"\r\n") == 2
        meta = store.message(parse_id(body["id"]))
        assert meta.sender == "bounce@src.test"
        assert meta.headers["Subject"] == "raw"
        assert meta.headers["Message-ID"] == str(fields["Message-ID"])


@async_test
async def test_raw_upload_keeps_its_own_date_and_message_id(store: QueueStore) -> None:
    text = b"Date: Sat, 21 Nov 2026 10:00:00 +0000\r\nMessage-ID: <own@src.test>\r\n" + RAW
    async with api_running(store) as api:
        status, body = await raw(api, text, "?from=bounce@src.test&to=x@ok.test")
        assert status == 201, body
        assert source_of(store, body["id"]) == text


@async_test
async def test_raw_upload_takes_the_envelope_from_headers_and_removes_bcc(
    store: QueueStore,
) -> None:
    text = (
        b"From: Alice <alice@src.test>\r\nTo: bob@ok.test\r\nBcc: secret@hidden.test,\r\n"
        b"  other@hidden.test\r\nSubject: t\r\n\r\nbody mentions Bcc: nothing\r\n"
    )
    async with api_running(store) as api:
        status, body = await raw(api, text)
        assert status == 201, body
        assert body["recipients"] == ["bob@ok.test", "secret@hidden.test", "other@hidden.test"]
        stored = source_of(store, body["id"])
        assert b"hidden.test" not in stored
        assert stored.endswith(b"\r\n\r\nbody mentions Bcc: nothing\r\n")
        assert store.message(parse_id(body["id"])).size == len(stored)


@pytest.mark.parametrize(
    ("data", "query", "status"),
    [
        (b"Subject: no addresses\r\n\r\nx\r\n", "", 400),
        # A sender alone takes the recipients from the headers: here there are none.
        (b"From: a@src.test\r\nSubject: x\r\n\r\nx\r\n", "?from=a@src.test", 400),
        (RAW, "?to=bad%0d%0aRCPT", 400),
        (b"", "?from=a@src.test&to=b@ok.test", 400),
    ],
)
@async_test
async def test_raw_upload_refusals_store_nothing(
    stores: StoreFactory, data: bytes, query: str, status: int
) -> None:
    store = stores.open()
    async with api_running(store) as api:
        got, body = await raw(api, data, query)
        assert got == status, body
        await store.drain()
        assert nothing_stored(store)


@async_test
async def test_over_the_size_limit_is_413_and_nothing_stored(stores: StoreFactory) -> None:
    store = stores.open(chunk_size=4096)
    async with api_running(store, make_config(max_size="64KiB")) as api:
        big = RAW + lines_of(70_000, b"x")

        async def trickle():  # no Content-Length: the limit is found while streaming
            for start in range(0, len(big), 5000):
                yield big[start : start + 5000]

        got, body = await raw(api, trickle(), "?from=a@src.test&to=b@ok.test")  # type: ignore[arg-type]
        assert got == 413, body
        got, _ = await raw(api, big, "?from=a@src.test&to=b@ok.test")
        assert got == 413
        await store.drain()
        assert nothing_stored(store)


@async_test
async def test_storage_failure_at_commit_is_503_and_nothing_queued(stores: StoreFactory) -> None:
    """The body's chunks land, then the commit's write fails: 503, and the message is not
    queued; what was written is an orphan that the next start's recovery sweeps."""
    store = stores.open(faulty=True, chunk_size=4096)
    db = stores.faulty(store)
    head = RAW + lines_of(3 * 4096)

    async def body():
        yield head[: 3 * 4096]
        for _ in range(500):  # bounded: until the three chunk writes are on disk
            if db.writes >= 3:
                break
            await asyncio.sleep(0.01)
        assert db.writes >= 3
        db.fail_writes = 1
        yield head[3 * 4096 :]

    async with api_running(store) as api:
        got, answer = await raw(api, body(), "?from=a@src.test&to=b@ok.test")  # type: ignore[arg-type]
        assert got == 503, answer
        assert answer["error"]["message"].startswith("queue storage unavailable")
        assert store.message_count() == 0
    store._writer.close()
    store.database.close()
    again = stores.open()
    assert nothing_stored(again)
