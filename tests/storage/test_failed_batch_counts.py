"""Queue sizes while the database cannot write: a failed batch's counts are undone.

An outcome's batch that fails is held (``held.py``) and its lease put back, so until the
heal its recipient is still queued and still leased: ready (leased ones included) must
still count it, and ``/metrics`` (ready without the leased ones) must not go below zero.
Real LevelDB directories, a real API server on loopback for ``/metrics``.
"""

from __future__ import annotations

import pytest

from tests.api.conftest import api_running
from tests.api.test_metrics import scrape
from tests.storage.conftest import (
    T0,
    StoreFactory,
    assert_consistent,
    async_test,
    queue_message,
)
from tests.storage.test_held import OK, Z, heal
from zoneq.api.metrics import _partition
from zoneq.storage.records import State

pytestmark = pytest.mark.integration


def counts(store_counts: dict[State, int]) -> dict[str, int | bool]:
    return {state.value: n for state, n in store_counts.items()}


@async_test
async def test_a_failed_completion_leaves_its_recipient_counted(stores: StoreFactory) -> None:
    store = stores.open(faulty=True)
    db = stores.faulty(store)
    async with api_running(store) as api:
        await queue_message(store, [("a@one.test", Z)])
        (lease,) = store.lease(Z, 1, "w")
        db.unavailable = True  # the completion's own batch fails, and the disk stays bad
        await store.complete(lease, T0, OK)
        await store.drain()
        assert (store.held, store.failure is not None) == (1, True)
        assert (store.count(Z, State.READY), store.count(Z, State.LEASED)) == (1, 1)
        samples = await scrape(api)
        shown = {
            state: samples[("zoneq_queue_recipients", (("state", state), ("zone", Z)))]
            for state in ("ready", "leased")
        }
        assert shown == {"ready": 0, "leased": 1}
        await heal(store, db)
    assert (store.count(Z, State.READY), store.count(Z, State.LEASED)) == (0, 0)
    await assert_consistent(store)


@pytest.mark.parametrize(
    ("store_counts", "shown"),
    [
        ({State.READY: 3, State.LEASED: 1, State.DEFERRED: 2, State.HELD: 0}, 2),
        ({State.READY: 1, State.LEASED: 1, State.DEFERRED: 0, State.HELD: 0}, 0),
        # A lease kept for an outcome whose batch reached the log before its sync failed:
        # the record is gone, the lease not yet (until the heal).  A gauge is never < 0.
        ({State.READY: 0, State.LEASED: 1, State.DEFERRED: 0, State.HELD: 0}, 0),
    ],
)
def test_metrics_ready_leaves_the_leased_out_and_never_goes_below_zero(
    store_counts: dict[State, int], shown: int
) -> None:
    by_state = _partition(counts(store_counts))
    assert by_state[State.READY] == shown
    assert by_state[State.LEASED] == store_counts[State.LEASED]
