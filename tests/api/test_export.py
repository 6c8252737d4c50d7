"""The NDJSON export endpoints: events after a watermark, and the queue, from a snapshot."""

from __future__ import annotations

import json

import pytest

from tests.api.conftest import TOKEN, Api, api_running, async_test
from tests.storage.conftest import queue_message
from zoneq.storage.store import QueueStore

pytestmark = pytest.mark.integration


async def ndjson(api: Api, path: str) -> list[dict]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with api.session.get(api.url(path), headers=headers) as response:
        assert response.status == 200, await response.text()
        assert response.content_type == "application/x-ndjson"
        return [json.loads(line) for line in (await response.text()).splitlines()]


@async_test
async def test_events_after_a_watermark_and_the_queue(store: QueueStore) -> None:
    await queue_message(store, [("a@ok.test", "default")])
    async with api_running(store) as api:
        first = await ndjson(api, "/api/v1/export/events")
        assert [e["kind"] for e in first] == ["accepted"]
        await queue_message(store, [("b@ok.test", "bulk"), ("c@ok.test", "bulk")])
        await store.drain()
        later = await ndjson(api, f"/api/v1/export/events?after={first[-1]['id']}")
        assert [(e["kind"], e["zone"], e["recipients"]) for e in later] == [("accepted", "bulk", 2)]
        queue = await ndjson(api, "/api/v1/export/queue")
        assert sorted((r["zone"], r["state"]) for r in queue) == [
            ("bulk", "ready"),
            ("bulk", "ready"),
            ("default", "ready"),
        ]
        status, _ = await api.call("GET", "/api/v1/export/events?after=xyz")
        assert status == 400
