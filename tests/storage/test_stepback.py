"""Deferred recipients after the wall clock steps back, on a real LevelDB store.

A recipient deferred for 15 minutes must not wait a day and 15 minutes because the clock
stepped back a day: a due time further ahead than the zone's longest retry interval cannot
come from a clock that only moves forward, so ``promote_due`` promotes it at once.  One
that lies less far ahead is left to come due as before.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.storage.conftest import (
    MINUTE,
    T0,
    StoreFactory,
    assert_consistent,
    async_test,
    family_keys,
    queue_message,
)
from zoneq.protocol.retry import RetrySchedule
from zoneq.storage import keys
from zoneq.storage.records import State
from zoneq.storage.stepback import step_back_bound
from zoneq.storage.store import Outcome, QueueStore

Z = "default"
HOUR = 60 * MINUTE
DAY = 24 * HOUR
LONGEST = 4 * HOUR  # the default schedule's longest interval ("15m | 30m | 2h | 4h")
LATER = Outcome(reply="451 4.7.1 try later", code=451, enhanced="4.7.1")


def addresses(n: int) -> list[tuple[str, str]]:
    return [(f"user{i:03d}@slow.test", Z) for i in range(n)]


async def defer_all(store: QueueStore, at_ms: int, wait_ms: int) -> None:
    """Lease every ready recipient of the zone and defer it at ``at_ms`` for ``wait_ms``."""
    for lease in store.lease(Z, 100, "w"):
        await store.defer(lease, at_ms, at_ms + wait_ms, LATER)


# --- the bound ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("now_ms", "longest_ms", "bound"),
    [
        (T0, LONGEST, T0 + LONGEST + 1),  # a deferral now with the longest interval is not past
        (T0, 1, T0 + 2),
        (0, 15 * MINUTE, 15 * MINUTE + 1),
        (T0 - DAY, LONGEST, T0 - DAY + LONGEST + 1),
    ],
)
def test_the_bound_lies_just_past_the_longest_interval(
    now_ms: int, longest_ms: int, bound: int
) -> None:
    assert step_back_bound(now_ms, longest_ms) == bound


@pytest.mark.parametrize("longest_ms", [0, -1, -LONGEST])
def test_a_bound_needs_a_positive_interval(longest_ms: int) -> None:
    with pytest.raises(ValueError, match="must be positive"):
        step_back_bound(T0, longest_ms)


@given(
    intervals=st.lists(st.integers(1, 7 * DAY), min_size=1, max_size=6),
    extra_age=st.integers(0, 10 * DAY),
    attempts=st.integers(1, 50),
    queued_after=st.integers(-DAY, DAY),
    deferred_after=st.integers(0, 20 * DAY),
    elapsed=st.integers(0, 20 * DAY),
)
def test_no_due_time_a_forward_clock_sets_is_past_the_bound(
    *,
    intervals: list[int],
    extra_age: int,
    attempts: int,
    queued_after: int,
    deferred_after: int,
    elapsed: int,
) -> None:
    """Whatever the schedule, a deferral made at or before now (the clock moving forward)
    is never due at or past the bound: the rule never promotes a recipient early."""
    schedule = RetrySchedule(tuple(intervals), max_age_ms=intervals[0] + extra_age)
    queued = T0 + queued_after
    deferred_at = queued + deferred_after
    due = schedule.next_attempt(attempts, queued, deferred_at)
    if due is not None:
        assert due < step_back_bound(deferred_at + elapsed, max(intervals))


# --- on a real store ---------------------------------------------------------------------


@async_test
async def test_a_step_back_of_a_day_does_not_lengthen_a_15_minute_wait(store: QueueStore) -> None:
    msg_id = await queue_message(store, addresses(1))
    await defer_all(store, T0, 15 * MINUTE)
    back = T0 - DAY  # an NTP step or an operator sets the clock back a day
    assert await store.promote_due(Z, back + 16 * MINUTE, longest_ms=LONGEST) == 1
    assert store.count(Z, State.DEFERRED) == 0
    (lease,) = store.lease(Z, 10, "w")
    assert (lease.recipient.msg_id, lease.recipient.attempts) == (msg_id, 1)
    assert lease.recipient.last_reply == LATER.reply
    await assert_consistent(store)
    assert family_keys(store, keys.DUE) == []
    assert family_keys(store, keys.DEFERRED) == []


@async_test
async def test_without_the_longest_interval_the_store_waits_as_before(store: QueueStore) -> None:
    await queue_message(store, addresses(1))
    await defer_all(store, T0, 15 * MINUTE)
    assert await store.promote_due(Z, T0 - DAY + 16 * MINUTE) == 0
    assert store.count(Z, State.DEFERRED) == 1


@async_test
async def test_a_due_time_within_the_bound_is_not_promoted_early(store: QueueStore) -> None:
    await queue_message(store, addresses(2))
    first, second = store.lease(Z, 2, "w")
    await store.defer(first, T0, T0 + 15 * MINUTE, LATER)
    await store.defer(second, T0, T0 + 2 * HOUR, LATER)
    assert await store.promote_due(Z, T0, longest_ms=LONGEST) == 0
    # A small step back (5 minutes) leaves both inside the bound: they wait as scheduled,
    # 20 minutes and 2 h 5 min from the step, less than the longest interval.
    assert await store.promote_due(Z, T0 - 5 * MINUTE, longest_ms=LONGEST) == 0
    assert await store.promote_due(Z, T0 + 15 * MINUTE - 1, longest_ms=LONGEST) == 0
    assert await store.promote_due(Z, T0 + 15 * MINUTE, longest_ms=LONGEST) == 1
    assert await store.promote_due(Z, T0 + 2 * HOUR - 1, longest_ms=LONGEST) == 0
    assert await store.promote_due(Z, T0 + 2 * HOUR, longest_ms=LONGEST) == 1
    await assert_consistent(store)


@async_test
async def test_a_deferral_for_the_longest_interval_is_at_the_bound(store: QueueStore) -> None:
    """Deferred now for the longest interval: not past the bound.  A step back of even one
    millisecond puts it past, and it is tried at once (the price of telling a stepped-back
    due time from a valid one by the schedule alone: a retry early, never one late)."""
    await queue_message(store, addresses(1))
    await defer_all(store, T0, LONGEST)
    assert await store.promote_due(Z, T0, longest_ms=LONGEST) == 0
    assert await store.promote_due(Z, T0 - 1, longest_ms=LONGEST) == 1
    await assert_consistent(store)


@async_test
async def test_only_what_lies_past_the_bound_is_promoted(store: QueueStore) -> None:
    await queue_message(store, addresses(2))
    soon, late = store.lease(Z, 2, "w")
    await store.defer(soon, T0, T0 + 15 * MINUTE, LATER)
    await store.defer(late, T0, T0 + LONGEST, LATER)
    # One hour back: the 4 h one is due 5 h ahead, past the bound; the other is 1 h 15 min
    # ahead and waits for its time.
    back = T0 - HOUR
    assert await store.promote_due(Z, back, longest_ms=LONGEST) == 1
    (lease,) = store.lease(Z, 10, "w")
    assert lease.recipient.address == late.recipient.address
    assert store.next_due(Z) == T0 + 15 * MINUTE
    assert await store.promote_due(Z, T0 + 15 * MINUTE, longest_ms=LONGEST) == 1
    await assert_consistent(store)


@async_test
async def test_a_deferral_after_the_first_look_is_still_seen(store: QueueStore) -> None:
    """The ceiling found by the first call is raised by each deferral that lands after it:
    without that, this deferral (made before a step back) would wait out the whole step."""
    await queue_message(store, addresses(1))
    assert await store.promote_due(Z, T0, longest_ms=LONGEST) == 0  # an empty zone
    await defer_all(store, T0, 15 * MINUTE)
    assert await store.promote_due(Z, T0 - DAY, longest_ms=LONGEST) == 1
    # Once promoted, the next calls neither find nor scan anything more.
    assert await store.promote_due(Z, T0 - DAY, longest_ms=LONGEST) == 0
    await defer_all(store, T0 - DAY, 15 * MINUTE)  # its next failure, on the new clock
    assert await store.promote_due(Z, T0 - DAY + 14 * MINUTE, longest_ms=LONGEST) == 0
    assert await store.promote_due(Z, T0 - DAY + 15 * MINUTE, longest_ms=LONGEST) == 1
    await assert_consistent(store)


@async_test
async def test_a_restart_with_the_clock_stepped_back(stores: StoreFactory) -> None:
    first = stores.open()
    await queue_message(first, addresses(3))
    await defer_all(first, T0, 30 * MINUTE)
    await first.close()
    second = stores.open()  # the ceiling comes from one reverse seek of what is on disk
    assert await second.promote_due(Z, T0 - DAY, longest_ms=LONGEST) == 3
    assert second.count(Z, State.READY) == 3
    await assert_consistent(second)


@pytest.mark.parametrize(
    ("now_ms", "limit", "moves"),
    [
        (T0 - DAY, 2, [2, 2, 1, 0]),  # stepped back: the limit holds for them too
        (T0 + 5 * DAY, 10_000, [5, 0]),  # a forward jump promotes as before
        (T0 + 5 * DAY, 2, [2, 2, 1, 0]),
    ],
)
@async_test
async def test_promotions_in_batches_of_the_limit(
    store: QueueStore, now_ms: int, limit: int, moves: list[int]
) -> None:
    await queue_message(store, addresses(5))
    await defer_all(store, T0, 15 * MINUTE)
    promote = [await store.promote_due(Z, now_ms, limit=limit, longest_ms=LONGEST) for _ in moves]
    assert promote == moves
    assert store.count(Z, State.READY) == 5
    await assert_consistent(store)


@async_test
async def test_once_promoted_the_far_range_is_not_read_again(
    store: QueueStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Their tombstones stay until compaction (0.4 us each to step over): the calls after
    a promotion read only the range that is due, as before the clock stepped back."""
    await queue_message(store, addresses(3))
    await defer_all(store, T0, 15 * MINUTE)
    assert await store.promote_due(Z, T0 - DAY, longest_ms=LONGEST) == 3
    await store.drain()
    reads: list[tuple[bytes | None, bytes | None, bool]] = []
    keys_of = store.database.keys

    def counted(**kwargs: object) -> object:
        reads.append((kwargs.get("start"), kwargs.get("stop"), bool(kwargs.get("reverse"))))
        return keys_of(**kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(store.database, "keys", counted)
    assert await store.promote_due(Z, T0 - DAY + MINUTE, longest_ms=LONGEST) == 0
    prefix = keys.zone_prefix(keys.DUE, Z)
    assert [(stop, reverse) for _, stop, reverse in reads] == [
        (prefix + keys.u64(T0 - DAY + MINUTE + 1), False)
    ]
