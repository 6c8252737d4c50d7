"""/metrics parses as Prometheus text and shows what the store and the event log say."""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.api.conftest import TOKEN, Api, api_running, async_test
from tests.storage.conftest import T0, queue_message
from zoneq.api.metrics import EVENTS_PER_TURN, LATENCY_BUCKETS, EventTally
from zoneq.protocol.events import Event, EventKind
from zoneq.protocol.ids import format_id
from zoneq.storage import keys
from zoneq.storage.base import Outcome
from zoneq.storage.records import State
from zoneq.storage.store import QueueStore

pytestmark = pytest.mark.integration

Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]

ZONES = ("bounces", "bulk", "default")  # tests.api.conftest's config
COUNTERS = (
    "zoneq_accepted_messages_total",
    "zoneq_accepted_recipients_total",
    "zoneq_delivered_total",
    "zoneq_deferred_total",
    "zoneq_bounced_total",
    "zoneq_expired_total",
    "zoneq_dropped_total",
)
LATENCY = "zoneq_delivery_latency_seconds"


async def scrape_text(api: Api) -> str:
    headers = {"Authorization": f"Bearer {TOKEN}"}
    async with api.session.get(api.url("/metrics"), headers=headers) as response:
        assert response.status == 200
        assert response.headers["Content-Type"].startswith("text/plain")
        return await response.text()


async def scrape(api: Api) -> Samples:
    """One scrape, its samples by (name, sorted labels), its histograms checked."""
    text = await scrape_text(api)
    assert_histograms_sound(text)
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return samples


def assert_histograms_sound(text: str) -> None:
    """Every histogram's buckets are cumulative and its ``+Inf`` bucket is its ``_count``,
    as Prometheus' ``histogram_quantile`` assumes."""
    for family in text_string_to_metric_families(text):
        if family.type != "histogram":
            continue
        buckets: defaultdict[tuple[tuple[str, str], ...], list[tuple[float, float]]]
        buckets = defaultdict(list)
        counts = {}
        for sample in family.samples:
            labels = tuple(sorted((k, v) for k, v in sample.labels.items() if k != "le"))
            if sample.name.endswith("_bucket"):
                buckets[labels].append((float(sample.labels["le"]), sample.value))
            elif sample.name.endswith("_count"):
                counts[labels] = sample.value
        assert buckets.keys() == counts.keys()
        for labels, series in buckets.items():
            values = [value for _, value in sorted(series)]
            assert values == sorted(values), (family.name, labels, series)
            assert max(series) == (float("inf"), counts[labels]), (family.name, labels)


def zone(name: str) -> tuple[tuple[str, str]]:
    return (("zone", name),)


def delivered(time_ms: int) -> Event:
    return Event(EventKind.DELIVERED, time_ms, "bulk", format_id(1), "a@b.test", "b.test", T0)


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
        await queue_message(store, [("d@ok.test", "default"), ("e@ok.test", "default")])
        dropped = await queue_message(store, [("f@ok.test", "bulk")])
        bounced, expired = store.lease("default", 10, "w")
        await store.bounce(bounced, T0 + 2_000, Outcome(reply="550 no such user"))
        await store.bounce(expired, T0 + 2_000, Outcome(reply="451 later"), expired=True)
        assert await store.drop(dropped, T0 + 2_000) == 1
        await store.drain()
        after = await scrape(api)
    assert after[("zoneq_queue_messages", ())] == 2
    assert after[("zoneq_queue_recipients", (("state", "deferred"), ("zone", "default")))] == 1
    assert after[("zoneq_queue_recipients", (("state", "ready"), ("zone", "bulk")))] == 1
    assert after[("zoneq_accepted_messages_total", zone("default"))] == 2
    assert after[("zoneq_accepted_recipients_total", zone("default"))] == 4
    assert after[("zoneq_accepted_messages_total", zone("bulk"))] == 2
    assert after[("zoneq_delivered_total", zone("default"))] == 1
    assert after[("zoneq_deferred_total", zone("default"))] == 1
    assert after[("zoneq_bounced_total", zone("default"))] == 1
    assert after[("zoneq_expired_total", zone("default"))] == 1
    assert after[("zoneq_dropped_total", zone("bulk"))] == 1
    assert after[("zoneq_dropped_total", zone("default"))] == 0
    buckets = {
        le: after[(f"{LATENCY}_bucket", (("le", repr(le)), ("zone", "default")))]
        for le in LATENCY_BUCKETS
    }
    assert buckets == {le: 0 if le < 3 else 1 for le in LATENCY_BUCKETS}  # cumulative
    assert after[(f"{LATENCY}_count", zone("default"))] == 1
    assert after[(f"{LATENCY}_sum", zone("default"))] == 3.0
    assert after[("zoneq_storage_up", ())] == 1
    assert after[("zoneq_quarantined_records", ())] == 0


@pytest.mark.parametrize(
    ("bucket", "value", "sound"),
    [
        ([("1.0", 1), ("5.0", 2), ("+Inf", 2)], 2, True),
        ([("1.0", 1), ("5.0", 0), ("+Inf", 1)], 1, False),  # per bucket, not cumulative
        ([("1.0", 0), ("5.0", 1), ("+Inf", 1)], 2, False),  # +Inf is not the count
    ],
)
def test_the_histogram_check_can_fail(
    bucket: list[tuple[str, float]], value: float, sound: bool
) -> None:
    lines = ["# TYPE h histogram"]
    lines += [f'h_bucket{{le="{le}"}} {n}' for le, n in bucket]
    lines += [f"h_count {value}", "h_sum 1.0", ""]
    if sound:
        assert_histograms_sound("\n".join(lines))
    else:
        with pytest.raises(AssertionError):
            assert_histograms_sound("\n".join(lines))


@async_test
async def test_leased_recipients_are_not_counted_as_ready_too(store: QueueStore) -> None:
    """The states partition the queue, so ``sum by (zone)`` is what is queued."""
    async with api_running(store) as api:
        await queue_message(store, [(f"{n}@ok.test", "default") for n in "abc"])
        assert len(store.lease("default", 2, "w")) == 2
        after = await scrape(api)
    by_state = {
        state.value: after[
            ("zoneq_queue_recipients", (("state", state.value), ("zone", "default")))
        ]
        for state in State
    }
    assert by_state == {"ready": 1, "leased": 2, "deferred": 0, "held": 0}


@async_test
async def test_every_zone_has_its_counters_and_histogram_at_zero_from_the_start(
    store: QueueStore,
) -> None:
    """A series born at 1 loses its first increment to ``increase()`` and ``rate()``."""
    async with api_running(store) as api:
        first = await scrape(api)
    for name in COUNTERS:
        assert {z: first.get((name, zone(z))) for z in ZONES} == dict.fromkeys(ZONES, 0), name
    les = [*map(repr, LATENCY_BUCKETS), "+Inf"]
    for z in ZONES:
        assert [first.get((f"{LATENCY}_bucket", (("le", le), *zone(z)))) for le in les] == [
            0
        ] * len(les)
        assert first.get((f"{LATENCY}_count", zone(z))) == 0
        assert first.get((f"{LATENCY}_sum", zone(z))) == 0


@async_test
async def test_a_backlog_is_read_a_turn_at_a_time_with_the_loop_free_between(
    store: QueueStore,
) -> None:
    """Decoding 50,000 events at once held the event loop (SMTP sessions, the workers'
    reports) for over a second; other tasks now run after every ``EVENTS_PER_TURN``."""
    tally = EventTally(store)
    backlog = 3 * EVENTS_PER_TURN + 1
    ops = [store._event_op(delivered(T0 + i)) for i in range(backlog)]
    await store._writer.submit(ops, sync=False)
    await store.drain()
    looks: list[int] = []

    async def look() -> None:
        while True:
            looks.append(sum(tally.totals.values()))
            await asyncio.sleep(0)

    other = asyncio.create_task(look())
    await asyncio.sleep(0)
    read = await tally.catch_up()
    other.cancel()
    assert read == backlog
    assert tally.totals == {(EventKind.DELIVERED, "bulk"): backlog}
    between = sorted(n for n in set(looks) if 0 < n < backlog)
    assert between == [EVENTS_PER_TURN, 2 * EVENTS_PER_TURN, 3 * EVENTS_PER_TURN]


@async_test
async def test_an_event_that_does_not_decode_is_logged_once(
    store: QueueStore, caplog: pytest.LogCaptureFixture
) -> None:
    tally = EventTally(store)
    await store._writer.submit([store._event_op(delivered(T0))], sync=False)
    await store.drain()
    [newest] = store.database.keys(prefix=keys.EVENT, reverse=True)
    store.database.write([(keys.event(keys.decode_event(newest) + 1), b"\xc1")], sync=True)
    with caplog.at_level("ERROR", logger="zoneq.storage"):
        assert [await tally.catch_up() for _ in range(3)] == [1, 0, 0]
    assert sum("does not decode" in r.getMessage() for r in caplog.records) == 1


@async_test
async def test_other_tasks_run_while_a_scrape_reads_a_backlog(store: QueueStore) -> None:
    """Through ``/metrics``: the loop turns at least once per ``EVENTS_PER_TURN`` events
    read (a scrape that decoded them in one go let it turn about ten times, on I/O)."""
    turns_of_reading = 20
    async with api_running(store) as api:
        backlog = turns_of_reading * EVENTS_PER_TURN
        ops = [store._event_op(delivered(T0 + i)) for i in range(backlog)]
        await store._writer.submit(ops, sync=False)
        await store.drain()
        scraping = asyncio.create_task(scrape(api))
        turns = 0
        while not scraping.done():
            await asyncio.sleep(0)
            turns += 1
        after = await scraping
    assert after[("zoneq_delivered_total", zone("bulk"))] == backlog
    assert turns >= turns_of_reading


@async_test
async def test_concurrent_scrapes_count_each_event_once(store: QueueStore) -> None:
    async with api_running(store) as api:
        backlog = 4 * EVENTS_PER_TURN
        ops = [store._event_op(delivered(T0 + i)) for i in range(backlog)]
        await store._writer.submit(ops, sync=False)
        await store.drain()
        await asyncio.gather(scrape(api), scrape(api))
        after = await scrape(api)
    assert after[("zoneq_delivered_total", zone("bulk"))] == backlog


@async_test
async def test_health_needs_no_token(store: QueueStore) -> None:
    async with api_running(store) as api:
        assert await api.call("GET", "/health", token=None) == (
            200,
            {"status": "ok", "quarantined": 0},
        )
