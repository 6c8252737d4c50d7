"""A read that fails while the service hands jobs out strands nothing.

The fault is injected under the real store, in the plyvel handle itself (``ReadFails``): the
reads of one message's keys raise as LevelDB does for a damaged block, the rest of the
database on disk is read as usual.  A job must then either reach the worker (its one-chunk
body left for the worker to fetch, whose damaged-body path quarantines the message) or go
back untouched: never stay registered to a worker that never heard of it, holding its
recipients and its domain's connection slot until that worker goes away.
"""

from __future__ import annotations

import logging
from typing import Any

import plyvel
import pytest

from tests.queue.test_service import Clock, Z, outcome, service_for
from tests.storage.conftest import async_test, queue_message
from zoneq.queue.service import Job, Result
from zoneq.storage import keys
from zoneq.storage.records import State
from zoneq.storage.store import QueueStore

ONE_CHUNK = (b"From: a@example.org\r\nSubject: t\r\n\r\nhello\r\n",)


class ReadFails:
    """The store's plyvel handle, but a ``get`` of a key starting with ``prefix`` raises."""

    def __init__(self, real: Any, prefix: bytes, error: BaseException) -> None:
        self._real, self._prefix, self._error = real, prefix, error
        self.on = True

    def get(self, key: bytes, **options: Any) -> Any:
        if self.on and key.startswith(self._prefix):
            raise self._error
        return self._real.get(key, **options)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._real, name)


def inject(store: QueueStore, prefix: bytes, error: BaseException) -> ReadFails:
    proxy = ReadFails(store.database._db, prefix, error)
    store.database._db = proxy
    return proxy


def by_domain(jobs: list[Job]) -> dict[str, Job]:
    return {job.domain: job for job in jobs}


@pytest.mark.parametrize(
    ("error", "text"),
    [
        (plyvel.CorruptionError, b"Corruption: block checksum mismatch"),
        (plyvel.IOError, b"IO error: read: Input/output error"),
    ],
    ids=["corruption", "io-error"],
)
@async_test
async def test_a_body_the_core_cannot_read_goes_out_for_the_worker_to_fetch(
    store: QueueStore, error: type[plyvel.Error], text: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    # One connection per domain: a stranded job would block its domain for good.
    service = service_for(store, Clock(), domain_connections=1)
    good = await queue_message(store, [("a@good.test", Z)], body=ONE_CHUNK)
    bad = await queue_message(store, [("b@bad.test", Z)], body=ONE_CHUNK)
    await store.drain()
    proxy = inject(store, keys.chunk_prefix(bad), error(text))
    jobs = by_domain(await service.lease(Z, "w1", max_jobs=10))
    assert {job.msg_id for job in jobs.values()} == {good, bad}
    assert jobs["good.test"].body == ONE_CHUNK[0]
    assert jobs["bad.test"].body is None  # the worker fetches it, and finds it damaged
    assert "body not read for its job" in caplog.text
    assert service.in_flight() == 2
    proxy.on = False
    # Each job is the worker's, and reported like any other: its slot frees.
    for job in jobs.values():
        accepted, refused = await service.report("w1", outcome(job, Result.DELIVERED))
        assert (len(accepted), refused) == (1, [])
    assert service.in_flight() == 0
    zone = service._zone(Z)
    assert zone.slots.in_flight("good.test") == zone.slots.in_flight("bad.test") == 0
    # Nothing was left registered to the worker: its going away gives nothing back.
    caplog.clear()
    assert service.disconnected("w1") == 0
    assert "possible duplicate" not in caplog.text


@pytest.mark.parametrize("bad_first", [False, True], ids=["after-a-job", "first"])
@async_test
async def test_a_job_that_fails_before_it_is_returned_is_given_back_whole(
    store: QueueStore, bad_first: bool, caplog: pytest.LogCaptureFixture
) -> None:
    # Any exception between taking a job from the queue and returning it (here: one the
    # storage layer does not map, raised by the read of the message's metadata).
    caplog.set_level(logging.ERROR, logger="zoneq.queue")
    service = service_for(store, Clock(), domain_connections=1)
    order = [("b@bad.test", Z), ("a@good.test", Z)]
    if not bad_first:
        order.reverse()
    ids = [await queue_message(store, [rcpt], body=ONE_CHUNK) for rcpt in order]
    bad = ids[order.index(("b@bad.test", Z))]
    await store.drain()
    proxy = inject(store, keys.message_meta(bad), RuntimeError("an unexpected read fault"))
    if bad_first:
        with pytest.raises(RuntimeError):
            await service.lease(Z, "w1", max_jobs=10)
        first: list[Job] = []
    else:
        first = await service.lease(Z, "w1", max_jobs=10)
        assert [job.domain for job in first] == ["good.test"]  # the job built before it
        assert "not handed out" in caplog.text
    zone = service._zone(Z)
    assert zone.slots.in_flight("bad.test") == 0
    assert service.in_flight() == len(first)
    # Its recipient is ready again: only the good one is leased (handed out or queued).
    assert (store.count(Z, State.READY), store.leased(Z)) == (2, 1)
    proxy.on = False
    again = await service.lease(Z, "w1", max_jobs=10)
    assert sorted(job.domain for job in [*first, *again]) == ["bad.test", "good.test"]
    for job in [*first, *again]:
        await service.report("w1", outcome(job, Result.DELIVERED))
    await store.drain()
    assert store.message_count() == 0
    assert service.disconnected("w1") == 0
