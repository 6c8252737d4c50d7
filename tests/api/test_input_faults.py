"""Bad input to the HTTP API is a 400 that names the field, never a 500 or a 201 with a
damaged message: encoded-word header injection, the email package's exceptions, a limit
that ``str.isdigit`` accepts; internationalized addresses stored as RFC 2047 and RFC 6532
allow; HEAD on the GET routes that answer it.  A real QueueStore on disk behind the API."""

from __future__ import annotations

from email import message_from_string, policy
from typing import Any

import pytest

from tests.api.conftest import TOKEN, api_running, async_test
from tests.api.test_submit import BASE, nothing_stored, source_of
from tests.storage.conftest import StoreFactory
from zoneq.protocol.ids import parse_id
from zoneq.storage.records import MessageMeta
from zoneq.storage.store import QueueStore

pytestmark = pytest.mark.integration

A = "YQ=="  # base64 of "a"


@pytest.mark.parametrize(
    ("extra", "field"),
    [
        ({"subject": "=?utf-8?q?hi=0D=0AFrom:_ceo@bank.test=0D=0A=0D=0Afake_body?="}, "subject"),
        ({"subject": "=?utf-8?q?x=0AX-Inj:_1?="}, "subject"),  # a bare LF
        (
            {"headers": {"X-A": "=?utf-8?b?eA0KUmV0dXJuLVBhdGg6IDxldmlsQHgudGVzdD4=?="}},
            "headers.X-A",
        ),
        (
            {"attachments": [{"filename": "=?utf-8?q?a=0D=0AX-Inj:_1?=", "content": A}]},
            "attachments[0].filename",
        ),
        ({"to": ["=?utf-8?q?Team:_A?= <bob@ok.test>"]}, "to[0]"),
        # HeaderParseError (not a ValueError) escaped build: a 500.  Now refused before,
        # as an address with an empty label (UTS 46 maps U+3002 to a dot).
        ({"to": ["bob@bücher.test\u3002"]}, "to[0]"),
        ({"from": "Alice <alice@bücher.test\u3002>"}, "from"),
        (
            {"attachments": [{"filename": "a", "content_type": "multipart/mixed", "content": A}]},
            "attachments[0].content_type",
        ),
        (
            {"attachments": [{"filename": "a", "content_type": "message/rfc822", "content": A}]},
            "attachments[0].content_type",
        ),
    ],
)
@async_test
async def test_bad_json_submissions_are_400_naming_the_field_and_store_nothing(
    stores: StoreFactory, extra: dict[str, Any], field: str
) -> None:
    store = stores.open()
    async with api_running(store) as api:
        status, body = await api.call("POST", "/api/v1/messages", json={**BASE, **extra})
        assert status == 400, body
        # "field: problem", or an address check's "field 'address': problem"
        assert body["error"]["message"].startswith((f"{field}: ", f"{field} '")), body
        await store.drain()
        assert nothing_stored(store)


async def queued(store: QueueStore, to: str) -> tuple[MessageMeta, bytes]:
    """Submit BASE to ``to`` (it must be a 201); the stored metadata and message."""
    async with api_running(store) as api:
        status, body = await api.call("POST", "/api/v1/messages", json={**BASE, "to": [to]})
        assert status == 201, body
        await store.drain()
    return store.message(parse_id(body["id"])), source_of(store, body["id"])


@async_test
async def test_an_idna_domain_is_stored_as_an_a_label(store: QueueStore) -> None:
    meta, stored = await queued(store, "Bob <bob@bücher.test>")
    assert b"\r\nTo: Bob <bob@xn--bcher-kva.test>\r\n" in stored
    assert stored.isascii()
    # The envelope too (RFC 6531: an ASCII local part needs no SMTPUTF8, RFC 5890 A-label).
    assert [q.recipient.address for q in store.recipients(meta.msg_id)] == [
        "bob@xn--bcher-kva.test"
    ]
    assert not meta.smtputf8


@async_test
async def test_a_utf8_local_part_is_stored_as_utf8_and_flagged_smtputf8(store: QueueStore) -> None:
    meta, stored = await queued(store, "José <josé@bücher.test>")
    assert meta.smtputf8  # only servers offering SMTPUTF8 get it (RFC 6531 3.4)
    assert "\r\nTo: José <josé@xn--bcher-kva.test>\r\n".encode() in stored
    parsed = message_from_string(stored.decode(), policy=policy.default)  # RFC 6532
    assert parsed["To"].addresses[0].username == "josé"


@pytest.mark.parametrize("limit", ["%C2%B2", "%D9%A3", "1" * 5000, "+5", " 5", "0", "1001"])
@async_test
async def test_a_limit_not_in_ascii_digits_or_range_is_400(store: QueueStore, limit: str) -> None:
    async with api_running(store) as api:
        status, body = await api.call("GET", f"/api/v1/zones/default/recipients?limit={limit}")
        assert status == 400, body
        assert body["error"]["message"].startswith("limit: "), body


@pytest.mark.parametrize(
    ("path", "token", "status"),
    [
        ("/health", False, 200),  # no token needed, as for GET
        ("/openapi.json", True, 200),
        ("/api/v1/queue", True, 200),
        ("/api/v1/queue", False, 401),
        ("/api/v1/zones/default/recipients", True, 200),
        ("/api/v1/messages/0000000000000000", True, 404),
        ("/api/v1/messages/0000000000000000/source", True, 405),  # streamed: GET only
    ],
)
@async_test
async def test_head_answers_as_get_without_a_body(
    store: QueueStore, path: str, token: bool, status: int
) -> None:
    async with api_running(store) as api:
        headers = {"Authorization": f"Bearer {TOKEN}"} if token else {}
        async with api.session.head(api.url(path), headers=headers) as answer:
            assert answer.status == status
            assert await answer.read() == b""
            if status == 200:
                assert answer.content_type == "application/json"
