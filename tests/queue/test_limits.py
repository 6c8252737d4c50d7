"""Connection limits per recipient domain and per MX host (learnt from reports)."""

from __future__ import annotations

import pytest

from tests.queue.test_feedback import GMAIL_RATE, feedback, starts
from tests.queue.test_service import Clock, outcome
from tests.storage.conftest import MINUTE, async_test, queue_message
from zoneq.config import load_config
from zoneq.queue.scheduler import DomainSlots
from zoneq.queue.service import QueueService, Result
from zoneq.storage.store import QueueStore

DOMAIN_LIMITS = {"gmail.com": 20, ".example.com": 3, "mail.example.com": 7}
MX_LIMITS = {".google.com": 4, "mx.shared.test": 3}


@pytest.mark.parametrize(
    ("domain", "limit"),
    [
        ("gmail.com", 20),
        ("GMail.com.", 20),  # DNS names ignore case; a final dot is the same name
        ("a.example.com", 3),  # the parent written with a leading dot
        ("deep.a.example.com", 3),
        ("mail.example.com", 7),  # the exact name before its parent
        ("example.com", 2),  # ".example.com" is below it, not it
        ("other.test", 2),  # the default
    ],
)
def test_domain_limits_by_name_or_parent(domain: str, limit: int) -> None:
    slots = DomainSlots(2, DOMAIN_LIMITS)
    assert slots.limit(domain) == limit
    assert starts(slots, domain) == limit


def test_domains_sharing_an_mx_host_share_its_limit_once_it_is_learnt() -> None:
    slots = DomainSlots(10, mx_limits=MX_LIMITS)
    # Learning window: nothing is known about a.test yet, so only its domain limit counts.
    assert starts(slots, "a.test") == 10
    for slot in slots.held():
        slots.release(slot.id)
    for domain in ("a.test", "b.test", "c.test"):
        slots.learn(domain, "MX.Shared.Test.")
    slots.learn("free.test", "mx.unlimited.test")  # no limit for its host: not tracked
    taken = {d: starts(slots, d) for d in ("a.test", "b.test", "c.test", "free.test")}
    assert taken == {"a.test": 3, "b.test": 0, "c.test": 0, "free.test": 10}
    assert slots.mx_in_flight("mx.shared.test") == 3
    slots.release(next(s.id for s in slots.held() if s.domain == "a.test"))
    assert slots.available("b.test")
    assert starts(slots, "c.test") == 1  # the freed slot of the host goes to any of them
    # A parent with a leading dot gives every host below it that limit, each its own.
    slots.learn("gmail.com", "gmail-smtp-in.l.google.com")
    slots.learn("googlemail.com", "gmail-smtp-in.l.google.com")
    slots.learn("google.test", "alt1.gmail-smtp-in.l.google.com")
    assert starts(slots, "gmail.com") + starts(slots, "googlemail.com") == 4
    assert starts(slots, "google.test") == 4


def test_connections_opened_before_learning_count_against_the_host_once_it_is_known() -> None:
    slots = DomainSlots(5, mx_limits=MX_LIMITS)
    early = [slots.acquire("a.test") for _ in range(4)]  # the learning window: domain only
    assert slots.mx_in_flight("mx.shared.test") == 0
    assert slots.keep(early[3], "")  # one of them kept idle
    slots.learn("a.test", "mx.shared.test")
    # All four count now: 4 > 3, so the idle one is to be closed and nothing new starts.
    assert slots.mx_in_flight("mx.shared.test") == 4
    assert slots.closing("") == (early[3],)
    slots.learn("b.test", "mx.shared.test")
    assert not slots.startable("a.test", "") and not slots.startable("b.test", "")
    # Three stay open once the closing one is closed: a keep within that is allowed.
    assert slots.keep(early[0], "")
    assert slots.closing("") == ()
    for slot in early:
        slots.release(slot)
    assert slots.mx_in_flight("mx.shared.test") == 0 and slots.in_flight("a.test") == 0


def test_a_slow_down_halves_the_domain_own_limit_for_the_period() -> None:
    clock = Clock()
    slots = DomainSlots(2, DOMAIN_LIMITS, feedback=feedback(clock))
    assert slots.feedback is not None
    slots.feedback.observe("gmail.com", 421, "4.7.28", GMAIL_RATE)
    assert slots.limit("gmail.com") == 10  # half of its own 20, not of the default
    clock.now += 10 * MINUTE
    assert slots.limit("gmail.com") == 20


def limited_service(store: QueueStore, clock: Clock) -> QueueService:
    config = load_config().model_copy(
        update={
            "delivery": load_config().delivery.model_copy(
                update={"mx_limits": {"mx.shared.test": 2}, "domain_connections": 5}
            )
        }
    )
    return QueueService(store, config, hostname="mx.zoneq.test", clock=clock, domain_connections=5)


@async_test
async def test_the_service_learns_the_mx_from_reports_and_holds_its_limit(
    store: QueueStore,
) -> None:
    clock = Clock()
    service = limited_service(store, clock)
    for n in range(8):
        for domain in ("one.test", "two.test"):
            await queue_message(store, [(f"u{n}@{domain}", "default")])
    # Nothing known yet: each domain's own limit of five (the learning window).
    first = await service.lease("default", "w1", max_jobs=20)
    assert [job.domain for job in first].count("one.test") == 5
    # The reports name the host both domains turn out to share.
    for job in first:
        await service.report("w1", outcome(job, Result.DELIVERED, mx="mx.shared.test"))
    # Both are now known to be on mx.shared.test: two jobs at once between them, not ten.
    jobs = await service.lease("default", "w1", max_jobs=20)
    assert len(jobs) == 2, [job.domain for job in jobs]
    await service.report("w1", outcome(jobs[0], Result.DELIVERED, mx="mx.shared.test"))
    assert len(await service.lease("default", "w1", max_jobs=20)) == 1
