"""``/metrics`` in the Prometheus text format, and ``/health``.

``prometheus_client`` writes the exposition format (names, label escaping, histogram
buckets with ``+Inf``, ``_sum`` and ``_count``) exactly as Prometheus parses it.  Nothing is
counted on the hot paths for it: a custom collector reads, at scrape time,

* queue sizes from the store's O(1) counters (per zone and state, messages, paused zones);
  the states partition the queue: ``ready`` there leaves out the ``leased`` recipients, which
  the store counts as ready too (``QueueAdmin.counts``), so ``sum by (zone)`` is the queue;
* MX addresses the zone workers' dead-host caches rest now, per zone (``zoneq_dead_hosts``):
  the latest count each connected worker reported (``zoneq.ipc.figures``), summed;
* delivery outcomes held in memory while the queue database cannot write
  (``zoneq_outcomes_held``, ``zoneq.storage.held``): lost, and sent again, if the core
  stops before it heals;
* corrupt records the store has quarantined since start (its in-memory list: the records
  stay on disk, and the count starts again when a restart meets them again);
* totals (accepted, delivered, deferred, bounced, expired, dropped) and the delivery
  latency histogram from the event log, which every transition writes in its own batch: an
  ``EventTally`` remembers where it stopped and reads only the events written since (at
  most ``MAX_EVENTS_PER_SCRAPE`` per scrape; a backlog is caught up over the next ones).
  Decoding an event costs about 25 us, so the tally reads ``EVENTS_PER_TURN`` of them at a
  time and gives the event loop back in between: a scrape after a busy minute would
  otherwise stall the receiver and the workers' reports for most of a second.  Not in a
  thread: plyvel frees an iterator when its database closes (a reopen after a failed write
  does), even while another thread is stepping it.

Totals count from the start of this process, as Prometheus counters do (``rate()`` handles
the reset at a restart).  Every zone has every counter and the latency histogram from the
first scrape, at 0: a series that first appears at 1 has no earlier sample for
``increase()`` or ``rate()`` to count its first increment from.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Iterator
from typing import Final

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)
from prometheus_client.registry import Collector

from zoneq.api.context import context
from zoneq.api.models import Health
from zoneq.ipc.figures import WorkerFigures
from zoneq.protocol.events import EventKind
from zoneq.queue.admin import QueueAdmin
from zoneq.storage import keys
from zoneq.storage.records import State
from zoneq.storage.store import QueueStore

MAX_EVENTS_PER_SCRAPE: Final = 50_000
# About 12 ms of decoding between two turns of the event loop.
EVENTS_PER_TURN: Final = 500
# Seconds from queued to delivered: a first attempt is seconds; retries are minutes to days.
LATENCY_BUCKETS: Final = (
    0.5,
    1.0,
    5.0,
    15.0,
    60.0,
    300.0,
    900.0,
    3600.0,
    14400.0,
    86400.0,
    259200.0,
)
_TOTALS: Final = {
    EventKind.DELIVERED: ("zoneq_delivered", "Recipients delivered (2xx after the final dot)"),
    EventKind.DEFERRED: ("zoneq_deferred", "Delivery attempts that failed temporarily"),
    EventKind.BOUNCED: ("zoneq_bounced", "Recipients bounced after a permanent failure"),
    EventKind.EXPIRED: ("zoneq_expired", "Recipients bounced when their retries ran out"),
    EventKind.DROPPED: ("zoneq_dropped", "Recipients dropped by an admin or a plugin, no DSN"),
}


class _Latency:
    __slots__ = ("buckets", "count", "total")

    def __init__(self) -> None:
        self.buckets = [0] * len(LATENCY_BUCKETS)
        self.count = 0
        self.total = 0.0

    def observe(self, seconds: float) -> None:
        for index, bound in enumerate(LATENCY_BUCKETS):
            if seconds <= bound:
                self.buckets[index] += 1
        self.count += 1
        self.total += seconds


class EventTally:
    """Totals per (kind, zone) and latencies per zone, from the events written since start.

    Two scrapes may catch up at once: each turn reads from the one cursor and moves it on
    with no await in between, so they share the backlog and count no event twice.
    """

    def __init__(self, store: QueueStore) -> None:
        self._store = store
        self._after: bytes | None = next(store.database.keys(prefix=keys.EVENT, reverse=True), None)
        self.totals: dict[tuple[EventKind, str], int] = {}
        self.accepted_recipients: dict[str, int] = {}
        self.latency: dict[str, _Latency] = {}

    async def catch_up(self, limit: int = MAX_EVENTS_PER_SCRAPE) -> int:
        """Read the events written since the last call (up to ``limit``); how many."""
        seen = 0
        while seen < limit:
            wanted = min(EVENTS_PER_TURN, limit - seen)
            read = self._read(wanted)
            seen += read
            if read < wanted:
                break
            await asyncio.sleep(0)  # the loop's other tasks run between two turns
        return seen

    def _read(self, limit: int) -> int:
        # A new iterator each turn, none kept across an await: a reopen of the database
        # (``QueueStore.reopen``, after a failed write) closes the iterators it has.
        seen = 0
        events = self._store.events(after=self._after, on_corrupt=self._past)
        for key, event in itertools.islice(events, limit):
            self._after = key
            seen += 1
            counted = (event.kind, event.zone)
            self.totals[counted] = self.totals.get(counted, 0) + 1
            if event.kind is EventKind.ACCEPTED:
                zone_total = self.accepted_recipients.get(event.zone, 0)
                self.accepted_recipients[event.zone] = zone_total + event.recipients
            elif event.kind is EventKind.DELIVERED:
                latency = self.latency.setdefault(event.zone, _Latency())
                latency.observe(max(0, event.time_ms - event.queued_at_ms) / 1000)
        return seen

    def _past(self, key: bytes, reason: str) -> None:
        """Step over a record that does not decode (logged once by ``events``): left as the
        newest, it would be read and logged again at every scrape."""
        self._after = key


class QueueCollector(Collector):
    """Everything ``/metrics`` shows, computed at scrape time (the tally is caught up by
    ``MetricsRegistry.exposition`` before, as ``collect`` cannot wait)."""

    def __init__(
        self, store: QueueStore, admin: QueueAdmin, workers: WorkerFigures | None = None
    ) -> None:
        self._store = store
        self._admin = admin
        self._workers = workers
        self.tally = EventTally(store)

    def collect(self) -> Iterator[Metric]:
        sizes = GaugeMetricFamily(
            "zoneq_queue_recipients",
            "Queued recipients per zone and state; the states do not overlap (ready leaves "
            "out the leased ones, handed to a worker now), so their sum is the queue",
            labels=["zone", "state"],
        )
        paused = GaugeMetricFamily("zoneq_zone_paused", "1 if the zone is paused", labels=["zone"])
        for zone, counts in self._admin.counts().items():
            for state, value in _partition(counts).items():
                sizes.add_metric([zone, state.value], value)
            paused.add_metric([zone], 1 if counts["paused"] else 0)
        yield sizes
        yield paused
        yield GaugeMetricFamily(
            "zoneq_queue_messages",
            "Messages with recipients queued",
            value=self._store.message_count(),
        )
        yield GaugeMetricFamily(
            "zoneq_storage_up",
            "1 while the queue database accepts writes",
            value=0 if self._store.failure is not None else 1,
        )
        yield GaugeMetricFamily(
            "zoneq_outcomes_held",
            "Delivery outcomes held in memory until the failed queue database heals",
            value=self._store.held,
        )
        yield GaugeMetricFamily(
            "zoneq_quarantined_records",
            "Corrupt queue records set aside (kept on disk for an operator) since start",
            value=len(self._store.quarantined),
        )
        if self._workers is not None:  # an API without workers behind it has no figure
            dead = GaugeMetricFamily(
                "zoneq_dead_hosts",
                "MX addresses the zone's workers skip for now after failed connections",
                labels=["zone"],
            )
            for zone, count in sorted(self._workers.dead_hosts().items()):
                dead.add_metric([zone], count)
            yield dead
        yield from self._totals()

    def _totals(self) -> Iterator[Metric]:
        tally = self.tally
        # Every zone from the start, with or without events yet (see the module's note).
        zones = sorted(set(self._admin.zones()) | {zone for _, zone in tally.totals})
        accepted = CounterMetricFamily(
            "zoneq_accepted_messages", "Messages queued, per zone they went to", labels=["zone"]
        )
        accepted_rcpts = CounterMetricFamily(
            "zoneq_accepted_recipients", "Recipients queued", labels=["zone"]
        )
        for zone in zones:
            accepted.add_metric([zone], tally.totals.get((EventKind.ACCEPTED, zone), 0))
            accepted_rcpts.add_metric([zone], tally.accepted_recipients.get(zone, 0))
        yield accepted
        yield accepted_rcpts
        for kind, (name, text) in _TOTALS.items():
            family = CounterMetricFamily(name, text, labels=["zone"])
            for zone in zones:
                family.add_metric([zone], tally.totals.get((kind, zone), 0))
            yield family
        latency = HistogramMetricFamily(
            "zoneq_delivery_latency_seconds",
            "From queued to delivered, per recipient",
            labels=["zone"],
        )
        for zone in zones:
            observed = tally.latency.get(zone, _Latency())
            buckets = [
                (repr(bound), n) for bound, n in zip(LATENCY_BUCKETS, observed.buckets, strict=True)
            ]
            buckets.append(("+Inf", observed.count))
            latency.add_metric([zone], buckets, observed.total)
        yield latency


def _partition(counts: dict[str, int | bool]) -> dict[State, int]:
    """The store's counts per state with the leased recipients out of ready: the store
    counts a leased recipient as ready (its record stays in the ready family until its
    outcome), and a sum over the states would count it twice.  Never below 0: a gauge of
    recipients cannot be negative, whatever a moment between the two reads says (a lease
    kept for an outcome whose batch reached LevelDB's log before its sync failed)."""
    by_state = {state: int(counts[state.value]) for state in State}
    by_state[State.READY] = max(0, by_state[State.READY] - by_state[State.LEASED])
    return by_state


class MetricsRegistry(CollectorRegistry):
    """The registry ``/metrics`` reads, with the collector whose tally it catches up."""

    def __init__(self, collector: QueueCollector) -> None:
        super().__init__(auto_describe=False)
        self.register(collector)
        self._collector = collector

    async def exposition(self) -> bytes:
        """The text format, after the events written since the last scrape are counted."""
        await self._collector.tally.catch_up()
        return generate_latest(self)


def new_registry(
    store: QueueStore, admin: QueueAdmin, workers: WorkerFigures | None = None
) -> MetricsRegistry:
    return MetricsRegistry(QueueCollector(store, admin, workers))


async def metrics(request: web.Request) -> web.Response:
    body = await context(request).registry.exposition()
    response = web.Response(body=body)
    response.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return response


async def health(request: web.Request) -> web.Response:
    """Unauthenticated: 200 while the queue accepts writes, 503 while it does not.

    Quarantined records are reported but leave the status at 200: the rest of the queue is
    being delivered, and a load balancer or supervisor acting on a 503 would only stop that.
    """
    store = context(request).store
    quarantined = len(store.quarantined)
    if store.failure is not None:
        body = Health(status="unavailable", reason=str(store.failure), quarantined=quarantined)
        return web.json_response(body.model_dump(exclude_none=True), status=503)
    body = Health(status="ok", quarantined=quarantined)
    return web.json_response(body.model_dump(exclude_none=True))
