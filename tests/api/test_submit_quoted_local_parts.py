"""API submissions (JSON and raw) queue a quoted local part in its least quoted form, so
``"bob"@ok.test`` and ``bob@ok.test`` are one recipient (RFC 5322 section 3.4.1, RFC 5321
section 4.1.2), and the envelope sender is stored in that form too."""

from __future__ import annotations

from typing import Any
from urllib.parse import urlencode

import pytest

from tests.api.conftest import api_running, async_test
from tests.api.test_submit import BASE, raw
from tests.api.test_submit_addresses import queued
from zoneq.storage.store import QueueStore

pytestmark = pytest.mark.integration

# (JSON fields over BASE, the sender stored, the recipients stored)
JSON_CASES: dict[str, tuple[dict[str, Any], str, list[str]]] = {
    "quoted and unquoted across to, cc and bcc": (
        {"to": ['"bob"@ok.test', "bob@ok.test"], "cc": ['"b\\ob"@ok.test'], "bcc": ["bob@ok.test"]},
        "alice@src.test",
        ["bob@ok.test"],
    ),
    "a quoted From is the envelope sender unquoted": (
        {"from": 'Alice <"alice"@src.test>'},
        "alice@src.test",
        ["bob@ok.test"],
    ),
    "a quoted envelope_from": (
        {"envelope_from": '"bounce+1"@src.test'},
        "bounce+1@src.test",
        ["bob@ok.test"],
    ),
    "quotes needed stay; a leading dot is another mailbox": (
        {"to": ['".bob"@ok.test', '"a\\@b"@ok.test', '"a@b"@ok.test']},
        "alice@src.test",
        ['".bob"@ok.test', '"a@b"@ok.test'],
    ),
}


@pytest.mark.parametrize("case", list(JSON_CASES))
@async_test
async def test_json_one_mailbox_once(store: QueueStore, case: str) -> None:
    extra, sender, recipients = JSON_CASES[case]
    async with api_running(store) as api:
        status, body = await api.call("POST", "/api/v1/messages", json={**BASE, **extra})
        stored_sender, stored, _ = await queued(api, status, body)
        assert (stored_sender, stored) == (sender, recipients)


# (query, the header section, the sender stored, the recipients stored)
RAW_CASES: dict[str, tuple[list[tuple[str, str]], bytes, str, list[str]]] = {
    "?from= and ?to= quoted": (
        [("from", '"a"@src.test'), ("to", '"bob"@ok.test'), ("to", "bob@ok.test")],
        b"Subject: x\r\n",
        "a@src.test",
        ["bob@ok.test"],
    ),
    "To and Cc fields, one mailbox quoted and not": (
        [],
        b'From: "a"@src.test\r\nTo: "bob"@ok.test, carol@ok.test\r\nCc: bob@ok.test\r\n',
        "a@src.test",
        ["bob@ok.test", "carol@ok.test"],
    ),
    # The JSON path's header check takes a non-ASCII local part only as a dot-atom.
    "non-ASCII local parts the same rule (RFC 6531 3.3)": (
        [("from", "a@src.test"), ("to", '"ünï"@ok.test'), ("to", "ünï@ok.test")],
        b"Subject: x\r\n",
        "a@src.test",
        ["ünï@ok.test"],
    ),
}


@pytest.mark.parametrize("case", list(RAW_CASES))
@async_test
async def test_raw_one_mailbox_once(store: QueueStore, case: str) -> None:
    query, section, sender, recipients = RAW_CASES[case]
    async with api_running(store) as api:
        text = section + b"\r\nbody\r\n"
        status, body = await raw(api, text, "?" + urlencode(query) if query else "")
        stored_sender, stored, _ = await queued(api, status, body)
        assert (stored_sender, stored) == (sender, recipients)
