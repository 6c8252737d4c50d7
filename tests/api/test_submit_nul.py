"""NUL in submitted message text is refused on both submission paths, nothing stored.

NUL is not allowed in 7bit or 8bit message text (RFC 2045 sections 2.7-2.8; RFC 5321
section 4.5.2), and ``\\r\\n\\x00.\\r\\n`` is the NUL variant of the 2023 SMTP smuggling
sequences.  Attachments travel in base64, so binary octets are fine there.
"""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.api.conftest import api_running, async_test
from tests.api.test_submit import BASE, RAW, lines_of, nothing_stored, raw, source_of
from tests.storage.conftest import StoreFactory
from zoneq.api.mime import build
from zoneq.api.models import Submission
from zoneq.queue.intake import Unacceptable

pytestmark = pytest.mark.integration

SMUGGLED = b"\r\n\x00.\r\nMAIL FROM:<evil@src.test>\r\n"


@pytest.mark.parametrize(
    "data",
    [
        RAW.replace(b"raw body", b"raw" + SMUGGLED + b"body"),  # the smuggling sequence
        b"\x00" + RAW,  # the very first octet
        RAW.replace(b"Subject: raw", b"Subject: r\x00w"),  # in the header section
        RAW + b"\x00",  # the very last octet
    ],
    ids=["smuggling", "first", "header", "last"],
)
@async_test
async def test_raw_upload_with_nul_is_400_and_nothing_stored(
    stores: StoreFactory, data: bytes
) -> None:
    store = stores.open()
    async with api_running(store) as api:
        status, body = await raw(api, data, "?from=a@src.test&to=b@ok.test")
        assert status == 400, body
        assert "NUL" in body["error"]["message"]
        status, body = await raw(api, data)  # envelope from the headers: the same
        assert status == 400, body
        await store.drain()
        assert nothing_stored(store)


@async_test
async def test_nul_after_chunks_were_written_abandons_them(stores: StoreFactory) -> None:
    """The NUL arrives after three chunks are on disk: 400, and they are removed."""
    store = stores.open(faulty=True, chunk_size=4096)
    db = stores.faulty(store)
    head = RAW + lines_of(3 * 4096)

    async def body() -> AsyncIterator[bytes]:
        yield head
        for _ in range(500):  # bounded: until the three chunk writes are on disk
            if db.writes >= 3:
                break
            await asyncio.sleep(0.01)
        assert db.writes >= 3
        yield b"tail" + SMUGGLED

    async with api_running(store) as api:
        status, answer = await raw(api, body(), "?from=a@src.test&to=b@ok.test")  # type: ignore[arg-type]
        assert status == 400, answer
        await store.drain()
        assert nothing_stored(store)
        # The same upload without the NUL is taken: the refusal was for the NUL alone.
        status, answer = await raw(api, head + b"tail\r\n", "?from=a@src.test&to=b@ok.test")
        assert status == 201, answer


NUL_FIELDS: dict[str, dict[str, Any]] = {
    "text": {"text": "hello\n\x00.\nMAIL FROM:<evil@src.test>\n"},
    "html": {"html": "<p>a\x00b</p>"},
    "subject": {"subject": "a\x00b"},
    "headers": {"headers": {"X-Tag": "a\x00b"}},
    "attachment-name": {"attachments": [{"filename": "a\x00.txt", "content": "YQ=="}]},
}


@pytest.mark.parametrize("field", sorted(NUL_FIELDS))
@async_test
async def test_json_submission_with_nul_is_400_and_nothing_stored(
    stores: StoreFactory, field: str
) -> None:
    store = stores.open()
    async with api_running(store) as api:
        status, body = await api.call(
            "POST", "/api/v1/messages", json={**BASE, **NUL_FIELDS[field]}
        )
        assert status == 400, (field, body)
        assert field.partition("-")[0].rstrip("s") in body["error"]["message"]
        await store.drain()
        assert nothing_stored(store)


@async_test
async def test_binary_attachment_with_nul_is_queued(stores: StoreFactory) -> None:
    store = stores.open()
    content = b"\x00\x00binary\x00"
    attachment = {"filename": "a.bin", "content": base64.b64encode(content).decode()}
    async with api_running(store) as api:
        status, body = await api.call(
            "POST", "/api/v1/messages", json={**BASE, "attachments": [attachment]}
        )
        assert status == 201, body
        assert b"\x00" not in source_of(store, body["id"])  # base64 on the wire


@given(
    before=st.text(max_size=200).filter(lambda t: "\x00" not in t),
    after=st.text(max_size=200).filter(lambda t: "\x00" not in t),
    html=st.booleans(),
)
def test_nul_anywhere_in_a_body_is_refused(before: str, after: str, html: bool) -> None:
    """Property: a body part with a NUL is refused; the same text without it is built."""
    key = "html" if html else "text"
    with pytest.raises(Unacceptable, match="NUL"):
        build(
            Submission.model_validate({**BASE, key: before + "\x00" + after}),
            hostname="mx.test",
            now_ms=0,
        )
    data, _ = build(
        Submission.model_validate({**BASE, key: before + after}), hostname="mx.test", now_ms=0
    )
    assert b"\x00" not in data
