"""``routing.bounce_max_age`` is the lifetime of the notices zoneq generates, and of nothing
else in the bounce zone: mail a rule routes there, or all mail in the one-zone set-up
(default_zone = bounce_zone), keeps the zone's own ``max_age`` (config/zones.toml).

Real store on disk, the real service; its clock is the test's.
"""

from __future__ import annotations

import pytest

from tests.queue.test_service import Clock, outcome
from tests.storage.conftest import MINUTE, SECOND, T0, async_test, queue_message
from zoneq.config import loads_config
from zoneq.queue.service import QueueService, Result
from zoneq.storage.records import State
from zoneq.storage.store import QueueStore

ZONE = "main"
# The reviewer's one-zone set-up: every message, and every notice, in one zone.
ONE_ZONE = f"""
[zones.{ZONE}]
retry = "5s"
max_age = "10m"
[routing]
default_zone = "{ZONE}"
bounce_zone = "{ZONE}"
bounce_max_age = "20s"
"""
MAIL = {"sender": "sender@example.org"}
NOTICE = {"sender": "", "is_bounce": True}  # as ``bounces.compose`` queues one


def one_zone_service(store: QueueStore, clock: Clock) -> QueueService:
    config = loads_config(ONE_ZONE)
    return QueueService(store, config, hostname="mx.zoneq.test", clock=clock)


@pytest.mark.parametrize(
    ("meta", "age_ms", "expired", "last_attempt"),
    [
        (MAIL, 30 * SECOND, False, False),  # past bounce_max_age: still the zone's 10 m
        (MAIL, 11 * MINUTE, True, True),  # past the zone's max_age
        (NOTICE, 10 * SECOND, False, False),
        (NOTICE, 30 * SECOND, True, True),  # past bounce_max_age: a notice of ours
    ],
    ids=["mail-30s", "mail-11m", "notice-10s", "notice-30s"],
)
@async_test
async def test_only_our_notices_get_bounce_max_age(
    store: QueueStore, meta: dict[str, object], age_ms: int, expired: bool, last_attempt: bool
) -> None:
    clock = Clock()
    service = one_zone_service(store, clock)
    msg_id = await queue_message(store, [("a@slow.test", ZONE)], now_ms=T0, **meta)
    clock.now = T0 + age_ms
    (job,) = await service.lease(ZONE, "w1")
    assert job.last_attempt is last_attempt
    await service.report("w1", outcome(job, Result.DEFERRED, reply="451 4.4.1 no answer"))
    expiries = [e for _, e in store.events() if e.kind.value == "expired"]
    assert [e.message_id for e in expiries] == ([f"{msg_id:016x}"] if expired else [])
    assert store.count(ZONE, State.DEFERRED) == (0 if expired else 1)
