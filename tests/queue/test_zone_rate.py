"""The zone-wide rate (issue 5): taken from ``[zones.<name>] rate`` and enforced by the core.

The unit tests drive the queue service on a real store with a fake clock.  The integration
test runs a real ``zoneq serve`` with two worker processes of four connections each,
delivering to Postfix's smtp-sink through dnsmasq, and reads the time of each delivery off
the sink's dump files: the zone as a whole holds the rate, spread evenly, although eight
delivery loops in two processes compete for it.
"""

from __future__ import annotations

import asyncio
import bisect
import itertools
import statistics
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


# --- a real zoneq serve, two processes, smtp-sink -------------------------------------------

RATE = 20  # per second
MESSAGES = 100  # about 5 s at the rate
DEADLINE_S = 15.0


def window_max(times: list[float], width: float) -> int:
    """The most deliveries in any window of ``width`` seconds (windows start at a delivery)."""
    return max(bisect.bisect_left(times, t + width) - i for i, t in enumerate(times))


@pytest.mark.integration
def test_serve_holds_the_zone_rate_across_two_worker_processes(tmp_path: Path) -> None:
    with serve_bed(tmp_path) as bed:
        config = bed.config(connections=4)
        text = config.read_text().replace(
            "[zones.default]\nprocesses = 1\n",
            f'[zones.default]\nprocesses = 2\nrate = "{RATE}/s"\n',
        )
        assert f'rate = "{RATE}/s"' in text
        config.write_text(text)
        asyncio.run(queue_small(data_dir(config), MESSAGES))
        with running_serve(config, tmp_path / "serve.log", expected_workers=3) as serve:
            assert len(serve.workers()) == 3  # two for the default zone, one for bounces
            delivered = bed.sink.messages(MESSAGES, timeout=DEADLINE_S)
            # When each transaction ended at the sink: its dump file's last write.
            ends = sorted(p.stat().st_mtime_ns / 1e9 for p in bed.sink.dump_dir.glob("msg.*"))
    assert len(delivered) == MESSAGES, f"{len(delivered)} of {MESSAGES} within {DEADLINE_S} s"
    times = [t - ends[0] for t in ends]
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # The rate is the slope of a least-squares line through (index, time): unlike
    # count / span, it does not hang on the first delivery, which also waits for the MX
    # lookup and the first connection, nor on the last.
    per_delivery = statistics.linear_regression(range(len(times)), times).slope
    measured = 1 / per_delivery
    print(
        f"zone rate {RATE}/s: measured {measured:.2f}/s over {times[-1]:.2f} s, "
        f"median gap {statistics.median(gaps) * 1000:.1f} ms, "
        f"most in 1 s {window_max(times, 1.0)}"
    )
    assert 0.9 * RATE <= measured <= 1.1 * RATE  # within 10% of the setting (issue 5)
    # No burst: no second holds more than twice the per-second rate (issue 5).  The core
    # starts at most RATE + 1 in a second; the sink sees more only through delivery jitter.
    assert window_max(times, 1.0) <= 2 * RATE
    # Evenly spread: the typical gap is one interval (50 ms).  Bursts and pauses (what a
    # limit per connection, or a bucket refilled each second, gives) have a median near 0.
    assert 0.8 / RATE <= statistics.median(gaps) <= 1.2 / RATE
