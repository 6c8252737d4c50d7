"""The zone-wide rate (issue 5): taken from ``[zones.<name>] rate`` and enforced by the core.

The unit tests drive the queue service on a real store with a fake clock.  The integration
test runs a real ``zoneq serve`` with two worker processes of four connections each,
delivering 670 messages to Postfix's smtp-sink through dnsmasq at 20/s, and reads the time
of each delivery off the sink's dump files: over more than the issue's 30 s, the zone as a
whole holds the rate, spread evenly, although eight delivery loops in two processes compete
for it.  ``RateVerdict`` is that check; it is tested on its own against schedules that miss
the rate in each way (the controls), and the same serve with no rate line must fail it."""

from __future__ import annotations

import asyncio
import bisect
import itertools
import statistics
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.delivery.test_serve_process import data_dir, queue_small, serve_bed
from tests.queue.test_service import Clock
from tests.storage.conftest import SECOND, async_test, queue_message
from tests.support.serve import running_serve
from zoneq.config import Config, validate_config
from zoneq.queue.scheduler import ZONE_BURST, RateLimiter
from zoneq.queue.service import QueueService
from zoneq.storage.store import QueueStore

Z = "default"


def config_with_rate(rate: str | None) -> Config:
    zone: dict[str, Any] = {} if rate is None else {"rate": rate}
    return validate_config({"zones": {Z: zone, "bounces": {}}})


async def lease_all(service: QueueService, owner: str) -> int:
    return len(await service.lease(Z, owner, max_jobs=100))


# --- the service takes the zone's rate from the config --------------------------------------


@pytest.mark.parametrize(
    ("rate", "interval_ms"), [("10/s", 100), ("600/min", 100), ("36000/h", 100), ("4/s", 250)]
)
@async_test
async def test_jobs_start_one_interval_apart_at_the_configured_rate(
    store: QueueStore, rate: str, interval_ms: int
) -> None:
    clock = Clock()
    service = QueueService(store, config_with_rate(rate), hostname="mx.test", clock=clock)
    for n in range(20):
        await queue_message(store, [(f"r{n}@d{n}.test", Z)])  # 20 domains: no slot limit
    # After idle, the tolerance lets ZONE_BURST start at once; then one per interval.
    assert await lease_all(service, "w1") == ZONE_BURST
    assert await lease_all(service, "w2") == 0  # another worker gets nothing either
    started = ZONE_BURST
    for _ in range(5):
        clock.now += interval_ms - 1
        assert await lease_all(service, "w2") == 0
        clock.now += 1
        assert await lease_all(service, "w1") == 1
        started += 1
    assert started == ZONE_BURST + 5


@async_test
async def test_a_zone_without_rate_is_not_limited(store: QueueStore) -> None:
    service = QueueService(store, config_with_rate(None), hostname="mx.test", clock=Clock())
    for n in range(30):
        await queue_message(store, [(f"r{n}@d{n}.test", Z)])
    assert await lease_all(service, "w1") == 30


@async_test
async def test_a_waiting_worker_is_woken_when_the_rate_allows(store: QueueStore) -> None:
    """A worker asking while the rate is spent waits the interval out, not its whole wait."""
    service = QueueService(store, config_with_rate("20/s"), hostname="mx.test")
    for n in range(ZONE_BURST + 1):
        await queue_message(store, [(f"r{n}@d{n}.test", Z)])
    assert await lease_all(service, "w1") == ZONE_BURST
    loop = asyncio.get_running_loop()
    begun = loop.time()
    jobs = await service.lease(Z, "w1", wait_ms=5_000)
    waited = loop.time() - begun
    assert len(jobs) == 1
    assert waited < 1.0  # one 50 ms interval, with room for a busy machine; not 5 s


@given(
    count=st.integers(1, 200),
    per_ms=st.sampled_from([SECOND, 60 * SECOND, 3600 * SECOND]),
    steps=st.lists(st.integers(0, 5_000), min_size=1, max_size=200),
    width=st.integers(1, 20),
)
def test_any_window_of_n_intervals_holds_at_most_n_plus_one_jobs(
    count: int, per_ms: int, steps: list[int], width: int
) -> None:
    """ZONE_BURST is a tolerance, not a bucket: whatever the clock does, a window of
    ``width`` intervals never holds more than ``width + ZONE_BURST - 1`` starts."""
    rate = RateLimiter.zone((count, per_ms))
    interval = per_ms / count
    now = 0.0
    taken: list[float] = []
    for step in steps:
        now += step
        while rate.take(now):
            taken.append(now)
    for index, start in enumerate(taken):
        inside = bisect.bisect_left(taken, start + width * interval - 1e-6) - index
        assert inside <= width + ZONE_BURST - 1


# --- what "the zone holds its rate" means, checked on delivery times -----------------------

MEASURE_S = 30.0  # the measuring period


def window_max(times: list[float], width: float) -> int:
    """The most deliveries in any window of ``width`` seconds (windows start at a delivery)."""
    return max(bisect.bisect_left(times, t + width) - i for i, t in enumerate(times))


@dataclass(frozen=True)
class RateVerdict:
    """Delivery times (s, sorted) measured against a rate of ``rate`` per second."""

    rate: int
    span: float  # from the first delivery to the last
    measured: float  # per second: the slope of a least-squares line through (index, time)
    most_in_1s: int
    median_gap: float

    @classmethod
    def of(cls, times: list[float], rate: int) -> RateVerdict:
        # The slope, unlike count / span, does not hang on the first delivery (which also
        # waits for the MX lookup and the first connection) nor on the last.
        per_delivery = statistics.linear_regression(range(len(times)), times).slope
        gaps = [b - a for a, b in itertools.pairwise(times)]
        return cls(
            rate=rate,
            span=times[-1] - times[0],
            measured=1 / per_delivery if per_delivery > 0 else float("inf"),
            most_in_1s=window_max(times, 1.0),
            median_gap=statistics.median(gaps),
        )

    def problems(self, measure_s: float = MEASURE_S) -> list[str]:
        """Each way the times break issue 5's rule; empty when the zone held its rate."""
        found = []
        if self.span < measure_s:
            found.append(f"measured over {self.span:.1f} s, not {measure_s:.0f}")
        if not 0.9 * self.rate <= self.measured <= 1.1 * self.rate:
            found.append(f"{self.measured:.2f}/s is not within 10% of {self.rate}/s")
        # No burst: no second holds more than twice the per-second rate.  The core starts
        # at most rate + 1 in a second; the sink sees more only through delivery jitter.
        if self.most_in_1s > 2 * self.rate:
            found.append(f"{self.most_in_1s} in one second, over twice {self.rate}/s")
        # Evenly spread: the typical gap is one interval.  Bursts and pauses (what a limit
        # per connection, or a bucket refilled each second, gives) have a median near 0.
        if not 0.8 / self.rate <= self.median_gap <= 1.2 / self.rate:
            found.append(f"median gap {self.median_gap * 1000:.1f} ms, not {1000 / self.rate} ms")
        return found

    def __str__(self) -> str:
        return (
            f"measured {self.measured:.2f}/s over {self.span:.2f} s, median gap "
            f"{self.median_gap * 1000:.1f} ms, most in 1 s {self.most_in_1s}"
        )


def even(rate: float, count: int, start: float = 0.0) -> list[float]:
    return [start + n / rate for n in range(count)]


def per_second_bucket(rate: int, seconds: int) -> list[float]:
    """A bucket refilled each second and emptied at once: ``rate`` together, then a pause."""
    return [s + n * 0.001 for s in range(seconds) for n in range(rate)]


@pytest.mark.parametrize(
    ("times", "broken"),
    [
        (even(20, 640), []),
        (even(20, 400), ["measured over"]),  # 20 s is not the 30
        (even(17.5, 560), ["not within 10%"]),  # slow
        (even(22.5, 720), ["not within 10%"]),  # fast
        (even(200, 7_000), ["not within 10%", "over twice", "median gap"]),  # no rate at all
        (per_second_bucket(20, 33), ["median gap"]),  # right on average, in bursts
        # 2.5 times the rate for the first 1.1 s, then on time: the long run holds, not the
        # second.
        (even(50, 55) + even(20, 620, start=1.1), ["over twice"]),
    ],
    ids=["even", "short", "slow", "fast", "unlimited", "bucket", "burst"],
)
def test_the_rate_check_fails_each_way_a_zone_can_miss_its_rate(
    times: list[float], broken: list[str]
) -> None:
    """The control for the serve test below: its checks reject what they are meant to."""
    problems = RateVerdict.of(times, 20).problems()
    assert len(problems) == len(broken), problems
    for problem, expected in zip(problems, broken, strict=True):
        assert expected in problem


@given(
    rate=st.sampled_from([5, 10, 20, 50]),
    jitter=st.lists(st.floats(-0.1, 0.1), min_size=1, max_size=50),
)
def test_an_even_schedule_with_jitter_within_a_tenth_of_an_interval_holds(
    rate: int, jitter: list[float]
) -> None:
    """Delivery jitter alone (each delivery up to a tenth of an interval early or late,
    in any pattern) never fails the check.  (A larger jitter that alternates, early, late,
    early, moves the median gap out of its 20% band: the even-spacing check is that strict.)"""
    count = int(MEASURE_S * rate) + 2
    times = [(n + jitter[n % len(jitter)]) / rate for n in range(count)]
    assert RateVerdict.of(times, rate).problems() == []


# --- a real zoneq serve, two processes, smtp-sink -------------------------------------------

RATE = 20  # per second
MESSAGES = 670  # 33.5 s at the rate, and still 30 s at 10% over it: always the full period
DEADLINE_S = 50.0
CONTROL_MESSAGES = 200


def delivery_times(tmp_path: Path, rate: str | None, messages: int) -> list[float]:
    """Seconds from the first delivery, at the sink, of ``messages`` sent by a real serve of
    two worker processes with four connections each and ``rate`` (None: no rate line)."""
    with serve_bed(tmp_path) as bed:
        config = bed.config(connections=4)
        rate_line = "" if rate is None else f'rate = "{rate}"\n'
        text = config.read_text().replace(
            "[zones.default]\nprocesses = 1\n", f"[zones.default]\nprocesses = 2\n{rate_line}"
        )
        assert "[zones.default]\nprocesses = 2\n" in text
        config.write_text(text)
        asyncio.run(queue_small(data_dir(config), messages))
        with running_serve(config, tmp_path / "serve.log", expected_workers=3) as serve:
            assert len(serve.workers()) == 3  # two for the default zone, one for bounces
            delivered = bed.sink.messages(messages, timeout=DEADLINE_S)
            # When each transaction ended at the sink: its dump file's last write.
            ends = sorted(p.stat().st_mtime_ns / 1e9 for p in bed.sink.dump_dir.glob("msg.*"))
    assert len(delivered) == messages, f"{len(delivered)} of {messages} within {DEADLINE_S} s"
    return [t - ends[0] for t in ends]


@pytest.mark.integration
def test_serve_holds_the_zone_rate_across_two_worker_processes(tmp_path: Path) -> None:
    verdict = RateVerdict.of(delivery_times(tmp_path, f"{RATE}/s", MESSAGES), RATE)
    print(f"zone rate {RATE}/s: {verdict}")
    assert verdict.problems() == []  # issue 5: within 10% over 30 s, no burst, even


@pytest.mark.integration
def test_control_without_the_rate_line_serve_fails_the_rate_check(tmp_path: Path) -> None:
    """The same bed with no ``rate`` delivers far faster: the rate above is zoneq's doing,
    not a limit of smtp-sink, dnsmasq or this machine."""
    verdict = RateVerdict.of(delivery_times(tmp_path, None, CONTROL_MESSAGES), RATE)
    print(f"no zone rate: {verdict}")
    assert verdict.measured > 2 * RATE
