"""/metrics parses as Prometheus text and shows what the store and the event log say."""

from __future__ import annotations

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.api.conftest import TOKEN, Api, api_running, async_test
from tests.storage.conftest import T0, queue_message
from zoneq.storage.base import Outcome
from zoneq.storage.store import QueueStore

pytestmark = pytest.mark.integration


async def scrape(api: Api) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with api.session.get(api.url("/metrics"), headers=headers) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        text = await response.text()
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


@async_test
async def test_metrics_show_queue_sizes_totals_and_latency(store: QueueStore) -> None:
    async with api_running(store) as api:
        before = await scrape(api)
        assert before[("zoneq_queue_messages", ())] == 0
        await queue_message(store, [("a@ok.test", "default"), ("b@ok.test", "default")])
        await queue_message(store, [("c@ok.test", "bulk")])
        leases = store.lease("default", 10, "w")
        await store.complete(leases[0], T0 + 3_000, Outcome(reply="250 ok"))  # 3 s latency
        await store.defer(leases[1], T0 + 1_000, T0 + 60_000, Outcome(reply="451 later"))
        await store.drain()
        after = await scrape(api)
    assert after[("zoneq_queue_messages", ())] == 2
    assert after[("zoneq_queue_recipients", (("state", "deferred"), ("zone", "default")))] == 1
    assert after[("zoneq_queue_recipients", (("state", "ready"), ("zone", "bulk")))] == 1
    assert after[("zoneq_accepted_messages_total", (("zone", "default"),))] == 1
    assert after[("zoneq_accepted_recipients_total", (("zone", "default"),))] == 2
    assert after[("zoneq_delivered_total", (("zone", "default"),))] == 1
    assert after[("zoneq_deferred_total", (("zone", "default"),))] == 1
    latency = (("le", "5.0"), ("zone", "default"))
    assert after[("zoneq_delivery_latency_seconds_bucket", latency)] == 1
    assert (
        after[("zoneq_delivery_latency_seconds_bucket", (("le", "1.0"), ("zone", "default")))] == 0
    )
    assert after[("zoneq_delivery_latency_seconds_sum", (("zone", "default"),))] == 3.0
    assert after[("zoneq_storage_up", ())] == 1
    assert after[("zoneq_quarantined_records", ())] == 0


@async_test
async def test_health_needs_no_token(store: QueueStore) -> None:
    async with api_running(store) as api:
        assert await api.call("GET", "/health", token=None) == (
            200,
            {"status": "ok", "quarantined": 0},
        )
