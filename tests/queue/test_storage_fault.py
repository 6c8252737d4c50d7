"""The queue service while the store cannot write (``zoneq/storage/held.py``).

Leases now outlive a storage failure and the reopen that heals it, so the service must
never forget a token the store still holds: such a recipient would stay leased, and never
go out again, until a restart.
"""

from __future__ import annotations

import pytest

from tests.queue.test_service import Clock, outcome, service_for
from tests.storage.conftest import FaultyDatabase, StoreFactory, async_test, queue_message
from zoneq.errors import StorageUnavailable
from zoneq.queue.service import Result
from zoneq.storage.store import QueueStore

Z = "default"


async def fail(store: QueueStore, db: FaultyDatabase) -> None:
    db.unavailable = True
    with pytest.raises(StorageUnavailable):
        await queue_message(store, [("t@trigger.test", Z)])


def heal(store: QueueStore, db: FaultyDatabase) -> None:
    db.unavailable = False
    store._next_reopen = 0.0
    store._check()
    assert store.failure is None


@async_test
async def test_a_bounce_without_a_readable_message_gives_its_recipients_back(
    stores: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The reopen's sync probe passes, but LevelDB's open does not (a nearly full disk):
    # no handle at all, so the DSN cannot be composed.  The bounce is not written without
    # it; the recipients are ready again, and bounce once the store is back.
    store = stores.open(faulty=True)
    db = stores.faulty(store)
    service = service_for(store, Clock())
    await queue_message(store, [("a@one.test", Z), ("b@one.test", Z)])
    (job,) = await service.lease(Z, "w1")
    await fail(store, db)
    monkeypatch.setattr(db, "probe_sync", lambda: None)
    store._next_reopen = 0.0
    with pytest.raises(StorageUnavailable):
        store._check()
    assert not db.is_open
    accepted, refused = await service.report(
        "w1", outcome(job, Result.BOUNCED, reply="550 5.1.1 no", code=550)
    )
    assert accepted == [] and len(refused) == 2
    assert store.leased(Z) == 0
    monkeypatch.undo()
    heal(store, db)
    (again,) = await service.lease(Z, "w2")
    assert sorted(r.address for r in again.recipients) == ["a@one.test", "b@one.test"]


@async_test
async def test_jobs_built_before_the_lease_bound_is_reached_go_out(
    stores: StoreFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = stores.open(faulty=True)
    db = stores.faulty(store)
    service = service_for(store, Clock(), window=1)  # one recipient per refill
    await queue_message(store, [("a@one.test", Z)])
    await queue_message(store, [("b@two.test", Z)])
    await fail(store, db)
    store._next_reopen = 1e18
    monkeypatch.setattr(QueueStore, "MAX_LEASED_WHILE_FAILED", 1)
    (job,) = await service.lease(Z, "w1", max_jobs=2)  # the second refill is refused
    assert [r.address for r in job.recipients] == ["a@one.test"]
    with pytest.raises(StorageUnavailable):
        await service.lease(Z, "w1", max_jobs=2)  # at the bound, and nothing built
    accepted, _ = await service.report("w1", outcome(job, Result.DELIVERED))
    assert len(accepted) == 1  # held until the store heals
    heal(store, db)
    jobs = await service.lease(Z, "w1", max_jobs=5)
    assert [r.address for j in jobs for r in j.recipients] == ["b@two.test"]
