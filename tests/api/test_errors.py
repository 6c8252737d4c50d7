"""Whose fault: every error answer is JSON; 400 only for what the client sent, 500 (logged
with its traceback) for a fault of ours, 503 with Retry-After for storage trouble."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from tests.api.conftest import TOKEN, api_running, async_test, queue_message
from zoneq.errors import StorageUnavailable
from zoneq.protocol.ids import format_id
from zoneq.storage.store import QueueStore

pytestmark = pytest.mark.integration

M = "/api/v1/messages"


def _boom(kind: type[Exception]) -> Any:
    def raise_it(*args: object, **kwargs: object) -> Any:
        raise kind("injected: a fault inside the server")

    return raise_it


@pytest.mark.parametrize("kind", [RuntimeError, ValueError, KeyError])
@async_test
async def test_a_fault_of_ours_is_a_json_500_logged_with_its_traceback(
    store: QueueStore,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    kind: type[Exception],
) -> None:
    msg = format_id(await queue_message(store, [("a@ok.test", "default")]))
    async with api_running(store) as api:
        monkeypatch.setattr(store, "message_count", _boom(kind))
        monkeypatch.setattr(store, "recipients", _boom(kind))
        with caplog.at_level(logging.ERROR, logger="zoneq.api"):
            for path in ("/api/v1/queue", f"{M}/{msg}"):
                status, body = await api.call("GET", path)
                assert status == 500, (path, body)
                assert body["error"]["status"] == 500
                assert "injected" not in body["error"]["message"]  # details: the log only
        logged = [r for r in caplog.records if r.exc_info and r.exc_info[0] is kind]
        assert len(logged) == 2, caplog.text
        monkeypatch.undo()
        assert (await api.call("GET", f"{M}/{msg}"))[0] == 200  # it was the fault alone


@async_test
async def test_storage_trouble_is_503_with_retry_after(
    store: QueueStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    async with api_running(store) as api:
        monkeypatch.setattr(store, "message_count", _boom(StorageUnavailable))
        async with api.session.get(
            api.url("/api/v1/queue"), headers={"Authorization": f"Bearer {TOKEN}"}
        ) as answer:
            assert answer.status == 503
            assert answer.headers["Retry-After"].isdigit()
            assert (await answer.json())["error"]["status"] == 503


CLIENT_FAULTS: list[tuple[str, str, dict[str, Any], str]] = [
    ("GET", f"{M}/not-an-id", {}, "id: not a message id"),
    ("GET", "/api/v1/zones/default/recipients?state=lost", {}, "state:"),
    ("GET", "/api/v1/zones/default/recipients?limit=0", {}, "limit:"),
    ("GET", "/api/v1/zones/default/recipients?cursor=AAAA", {}, "cursor"),
    ("GET", "/api/v1/export/events?after=xyz", {}, "after:"),
    ("POST", "/api/v1/queue/purge", {"data": b"{not json"}, "Invalid JSON"),
    ("POST", "/api/v1/queue/purge", {"json": {"older_than": "3x"}}, "older_than:"),
    ("POST", "/api/v1/queue/purge", {"json": {}}, "no filter given"),
    ("POST", "/api/v1/queue/purge", {"json": {"zone": 1}}, "zone:"),
    ("POST", M, {"json": {"from": "a@src.test", "to": ["nobody"]}}, "local-part@domain"),
    ("POST", "/api/v1/zones/default/hold", {"json": {"reason": "x\r\ny"}}, "control character"),
    ("POST", "/api/v1/zones/default/hold", {"json": {"reason": "\x1b[2J"}}, "control character"),
]


@pytest.mark.parametrize(("method", "path", "kwargs", "needle"), CLIENT_FAULTS)
@async_test
async def test_the_clients_faults_are_400_and_named(
    store: QueueStore, method: str, path: str, kwargs: dict[str, Any], needle: str
) -> None:
    await queue_message(store, [("a@ok.test", "default")])
    async with api_running(store) as api:
        status, body = await api.call(method, path, **kwargs)
        assert status == 400, body
        assert needle in body["error"]["message"], body
        assert (await api.call("GET", "/api/v1/queue"))[1]["zones"]["default"]["ready"] == 1


@pytest.mark.parametrize("reason", ["x\r\ny", "line\nbreak", "nul\x00", "tab\there", "del\x7f"])
@async_test
async def test_a_hold_reason_with_control_characters_holds_nothing(
    store: QueueStore, reason: str
) -> None:
    msg = format_id(await queue_message(store, [("a@ok.test", "default")]))
    async with api_running(store) as api:
        status, body = await api.call("POST", f"{M}/{msg}/hold", json={"reason": reason})
        assert status == 400, body
        assert "reason" in body["error"]["message"]
        _, shown = await api.call("GET", f"{M}/{msg}")
        assert [r["state"] for r in shown["recipients"]] == ["ready"]
        status, body = await api.call("POST", f"{M}/{msg}/hold", json={"reason": "one line"})
        assert (status, body) == (200, {"count": 1, "on_return": 0})
