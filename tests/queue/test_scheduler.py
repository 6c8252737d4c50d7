"""Scheduling decisions: the zone rate (GCRA), domain slots, and jobs from leased recipients."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zoneq.queue.scheduler import DomainSlots, JobQueue, Planned, RateLimiter, plan_jobs

# --- the rate limiter -----------------------------------------------------------------------


def test_unlimited_rate_always_allows() -> None:
    rate = RateLimiter(0, 1000)
    assert rate.unlimited
    assert all(rate.take(0) for _ in range(10_000))
    assert rate.wait_ms(0) == 0


def test_rate_is_spread_evenly_without_burst() -> None:
    rate = RateLimiter(10, 1000)  # 10 per second: one every 100 ms
    assert rate.take(0)
    assert not rate.take(0)
    assert not rate.take(99)
    assert rate.wait_ms(50) == 50
    assert rate.take(100)
    assert not rate.take(150)


def test_burst_allows_that_many_at_once_then_the_rate() -> None:
    rate = RateLimiter(10, 1000, burst=3)
    assert [rate.take(0) for _ in range(4)] == [True, True, True, False]
    assert rate.take(100)


@pytest.mark.parametrize(("count", "per_ms", "burst"), [(-1, 1000, 1), (1, 0, 1), (1, 1000, 0)])
def test_rate_refuses_impossible_settings(count: int, per_ms: int, burst: int) -> None:
    with pytest.raises(ValueError):
        RateLimiter(count, per_ms, burst)


@given(
    count=st.integers(1, 500),
    per_ms=st.sampled_from([1000, 60_000, 3_600_000]),
    steps=st.lists(st.integers(0, 5_000), min_size=1, max_size=300),
)
def test_no_window_ever_holds_more_than_the_rate_allows(
    count: int, per_ms: int, steps: list[int]
) -> None:
    """However the clock advances, any window of length W holds at most W/interval + 1."""
    rate = RateLimiter(count, per_ms)
    interval = per_ms / count
    now = 0
    taken: list[int] = []
    for step in steps:
        now += step
        while rate.take(now):
            taken.append(now)
    for a, b in itertools.pairwise(taken):
        assert b - a >= interval - 1e-6  # evenly spread: never closer than one interval


HOUR = 3_600_000
WALL_MS = 1_795_000_000_000  # wall-clock milliseconds, late 2026


@pytest.mark.parametrize("count", [999, 1000, 1500, 3000, 100_000, 1_000_000])
def test_a_zone_rate_above_one_a_millisecond_is_kept_on_a_millisecond_clock(count: int) -> None:
    """The service reads whole milliseconds; however often workers ask within one, a second
    starts the zone's rate, not 1000 or 2000.  (Float steps at wall-clock magnitude space
    the fastest rates by a fraction of a percent.)"""
    rate = RateLimiter.zone((count, 1000))
    asks = count // 1000 + 3  # more than the rate allows per millisecond
    started = 0
    for now in range(WALL_MS, WALL_MS + 1000):
        started += sum(rate.take(now) for _ in range(asks))
    assert count * 0.99 <= started <= count * 1.01 + 2, started


@pytest.mark.parametrize("burst", [1, 3])
def test_a_clock_stepped_back_delays_the_rate_by_one_interval_not_the_step(burst: int) -> None:
    rate = RateLimiter(10, 1000, burst)  # one every 100 ms
    now = 10 * HOUR
    while rate.take(now):
        pass
    now -= HOUR  # the wall clock steps back an hour
    assert 0 < rate.wait_ms(now) <= 100
    assert not rate.take(now)
    assert rate.take(now + 100)


@given(
    count=st.integers(1, 500),
    per_ms=st.sampled_from([1000, 60_000, 3_600_000]),
    burst=st.integers(1, 4),
    steps=st.lists(st.integers(-10 * HOUR, 10 * HOUR), min_size=1, max_size=100),
)
def test_however_the_clock_moves_the_next_start_is_at_most_an_interval_away(
    count: int, per_ms: int, burst: int, steps: list[int]
) -> None:
    rate = RateLimiter(count, per_ms, burst)
    interval = per_ms / count
    now = 20 * HOUR
    for step in steps:
        now += step
        while rate.take(now):
            pass
        wait = rate.wait_ms(now)
        assert 0 < wait <= interval + 1e-6
        assert rate.take(now + wait + 0.001)  # a thousandth of a millisecond: float rounding


# --- domain slots ---------------------------------------------------------------------------


def test_domain_slots_limit_each_domain_separately() -> None:
    slots = DomainSlots(2, {"big.example": 3})
    held = [slots.acquire("a.example") for _ in range(2)]
    assert not slots.available("a.example")
    assert slots.available("b.example")
    for _ in range(3):
        slots.acquire("big.example")
    assert not slots.available("big.example")
    with pytest.raises(RuntimeError):
        slots.acquire("a.example")
    assert slots.release(held[0])
    assert slots.available("a.example")
    assert slots.in_flight("a.example") == 1
    assert slots.release(held[1])
    assert not slots.release(held[1])  # released once only


# --- planning jobs --------------------------------------------------------------------------

Item = tuple[int, str, str]  # (msg_id, domain, address)


def group(item: Item) -> tuple[int, str]:
    return item[0], item[1]


def test_jobs_group_by_message_and_domain_in_first_seen_order() -> None:
    items = [(1, "a", "x1"), (1, "b", "y1"), (1, "a", "x2"), (2, "a", "z1")]
    jobs = plan_jobs(items, group=group)
    assert [(j.msg_id, j.domain, [i[2] for i in j.items]) for j in jobs] == [
        (1, "a", ["x1", "x2"]),
        (1, "b", ["y1"]),
        (2, "a", ["z1"]),
    ]


def test_jobs_hold_at_most_max_recipients() -> None:
    items = [(1, "a", f"r{i}") for i in range(120)]
    jobs = plan_jobs(items, group=group, max_recipients=50)
    assert [len(j.items) for j in jobs] == [50, 50, 20]


@given(
    st.lists(st.tuples(st.integers(1, 5), st.sampled_from("abc"), st.text(max_size=3))),
    st.integers(1, 7),
)
def test_every_item_is_in_exactly_one_homogeneous_job(items: list[Item], size: int) -> None:
    jobs = plan_jobs(items, group=group, max_recipients=size)
    assert sorted(i for j in jobs for i in j.items) == sorted(items)
    for job in jobs:
        assert 1 <= len(job.items) <= size
        assert all(group(i) == (job.msg_id, job.domain) for i in job.items)


# --- the job queue --------------------------------------------------------------------------


def test_queue_skips_a_busy_domain_and_keeps_its_job() -> None:
    queue: JobQueue[Item] = JobQueue()
    queue.extend(plan_jobs([(1, "a", "x"), (2, "a", "y"), (3, "b", "z")], group=group))
    slots = DomainSlots(1)
    rate = RateLimiter(0, 1000)
    first = queue.take(slots, rate, 0)
    assert first is not None and first[0].msg_id == 1
    second = queue.take(slots, rate, 0)  # domain a is busy: b goes ahead
    assert second is not None and second[0].msg_id == 3
    assert queue.take(slots, rate, 0) is None
    assert queue.blocked_domains(slots) == {"a"}
    slots.release(first[1])
    third = queue.take(slots, rate, 0)
    assert third is not None and third[0].msg_id == 2
    assert len(queue) == 0


def test_queue_waits_for_the_rate_and_keeps_order() -> None:
    queue: JobQueue[Item] = JobQueue()
    queue.extend(plan_jobs([(1, "a", "x"), (2, "b", "y")], group=group))
    slots = DomainSlots(5)
    rate = RateLimiter(1, 1000)
    assert queue.take(slots, rate, 0) is not None
    assert queue.take(slots, rate, 500) is None
    job = queue.take(slots, rate, 1000)
    assert job is not None and job[0].msg_id == 2
    assert slots.in_flight("a") == 1 and slots.in_flight("b") == 1


def test_queue_removes_one_messages_jobs_and_keeps_the_order_of_the_rest() -> None:
    queue: JobQueue[Item] = JobQueue()
    queue.extend(
        plan_jobs([(1, "a", "x"), (2, "a", "y"), (1, "b", "z"), (3, "c", "w")], group=group)
    )
    gone = queue.remove(1)
    assert [(j.msg_id, j.domain) for j in gone] == [(1, "a"), (1, "b")]
    assert [j.msg_id for j in queue.drain()] == [2, 3]
    assert queue.remove(9) == []


class LinearQueue:
    """The job queue as it was written first: one list, scanned front to back on every
    take.  The model the per-domain queue must agree with, take for take."""

    def __init__(self) -> None:
        self.jobs: list[Planned[Item]] = []

    def take(self, slots: DomainSlots, rate: RateLimiter, now: float, owner: str) -> object:
        if rate.wait_ms(now) > 0:
            return None
        for index, job in enumerate(self.jobs):
            slot = slots.try_acquire(job.domain, owner)
            if slot is not None:
                if not rate.take(now):
                    slots.put_back(slot)
                    return None
                del self.jobs[index]
                return job, slot
        return None


OPS = st.lists(
    st.one_of(
        st.tuples(
            st.just("extend"),
            st.lists(
                st.tuples(
                    st.integers(1, 6), st.sampled_from("abcd"), st.sampled_from(["x", "y", "z"])
                ),
                min_size=1,
                max_size=6,
            ),
        ),
        st.tuples(st.just("take"), st.sampled_from(["w1", "w2"])),
        st.tuples(st.just("take"), st.sampled_from(["w1", "w2"])),
        st.tuples(st.just("release"), st.integers(0, 10)),
        st.tuples(st.just("remove"), st.integers(1, 6)),
        st.tuples(st.just("tick"), st.integers(0, 400)),
    ),
    min_size=10,
    max_size=60,
)


@settings(max_examples=300)
@given(ops=OPS, limit=st.integers(1, 3), per_second=st.sampled_from([0, 5]))
def test_the_per_domain_queue_takes_what_a_front_to_back_scan_would(
    ops: list[tuple[str, object]], limit: int, per_second: int
) -> None:
    queue: JobQueue[Item] = JobQueue()
    model = LinearQueue()
    slots, model_slots = DomainSlots(limit), DomainSlots(limit)
    rate, model_rate = RateLimiter(per_second, 1000), RateLimiter(per_second, 1000)
    started: list[int] = []
    model_started: list[int] = []
    now = 0
    for op, arg in ops:
        if op == "extend":
            assert isinstance(arg, list)
            planned = plan_jobs(arg, group=group, max_recipients=2)
            queue.extend(planned)
            model.jobs.extend(planned)
        elif op == "take":
            assert isinstance(arg, str)
            got = queue.take(slots, rate, now, arg)
            expected = model.take(model_slots, model_rate, now, arg)
            assert (got[0] if got else None) == (expected[0] if expected else None)  # type: ignore[index]
            if got is not None:
                started.append(got[1])
                model_started.append(expected[1])  # type: ignore[index]
        elif op == "release" and started:
            assert isinstance(arg, int)
            index = arg % len(started)
            slots.release(started.pop(index))
            model_slots.release(model_started.pop(index))
        elif op == "remove":
            assert isinstance(arg, int)
            gone = [job for job in model.jobs if job.msg_id == arg]
            model.jobs = [job for job in model.jobs if job.msg_id != arg]
            assert queue.remove(arg) == gone
        elif op == "tick":
            assert isinstance(arg, int)
            now += arg
        assert len(queue) == len(model.jobs)
        assert queue.recipients() == sum(len(job.items) for job in model.jobs)
        assert queue.blocked_domains(slots) == {
            job.domain for job in model.jobs if not model_slots.could_start(job.domain)
        }
    assert queue.drain() == model.jobs
    assert len(queue) == 0 and queue.recipients() == 0
