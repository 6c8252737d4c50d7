"""Connection limits per recipient domain and per MX host (learnt from reports)."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

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
    for _ in range(10):
        slots.release("a.test")
    for domain in ("a.test", "b.test", "c.test"):
        slots.learn(domain, "MX.Shared.Test.")
    slots.learn("free.test", "mx.unlimited.test")  # no limit for its host: not tracked
    taken = {d: starts(slots, d) for d in ("a.test", "b.test", "c.test", "free.test")}
    assert taken == {"a.test": 3, "b.test": 0, "c.test": 0, "free.test": 10}
    assert slots.mx_in_flight("mx.shared.test") == 3
    slots.release("a.test")
    assert slots.available("b.test")
    assert starts(slots, "c.test") == 1  # the freed slot of the host goes to any of them
    # A parent with a leading dot gives every host below it that limit, each its own.
    slots.learn("gmail.com", "gmail-smtp-in.l.google.com")
    slots.learn("googlemail.com", "gmail-smtp-in.l.google.com")
    slots.learn("google.test", "alt1.gmail-smtp-in.l.google.com")
    assert starts(slots, "gmail.com") + starts(slots, "googlemail.com") == 4
    assert starts(slots, "google.test") == 4


def test_jobs_started_before_learning_are_not_uncounted_from_the_host() -> None:
    slots = DomainSlots(5, mx_limits=MX_LIMITS)
    slots.acquire("a.test")
    slots.acquire("a.test")  # two jobs before anything is known
    slots.learn("a.test", "mx.shared.test")
    slots.acquire("a.test")  # one counted against the host
    assert slots.mx_in_flight("mx.shared.test") == 1
    slots.release("a.test")
    slots.release("a.test")
    assert slots.mx_in_flight("mx.shared.test") == 1  # still one of the three in flight
    slots.release("a.test")
    assert slots.mx_in_flight("mx.shared.test") == 0 and slots.in_flight("a.test") == 0


OPS = st.lists(
    st.tuples(
        st.sampled_from(["acquire", "release", "learn"]),
        st.sampled_from(["a.test", "b.test", "c.test"]),
        st.sampled_from(["mx.shared.test", "mx.other.test", "mx1.google.com"]),
    ),
    max_size=60,
)


@given(OPS)
def test_mx_counts_stay_true_whatever_the_order(ops: list[tuple[str, str, str]]) -> None:
    """Counted jobs never go below zero nor above the jobs in flight; once a domain's MX is
    known, no acquire takes its host past the host's limit."""
    slots = DomainSlots(4, mx_limits=MX_LIMITS)
    for op, domain, mx in ops:
        if op == "learn":
            slots.learn(domain, mx)
        elif op == "acquire" and slots.available(domain):
            slots.acquire(domain)
            known = slots._mx_of.get(domain)
            if known is not None:
                assert slots.mx_in_flight(known[0]) <= known[1]
        elif op == "release" and slots.in_flight(domain):
            slots.release(domain)
        total = sum(slots.in_flight(d) for d in ("a.test", "b.test", "c.test"))
        counted = sum(slots._mx_busy.values())
        assert 0 <= counted <= total
        assert all(count > 0 for count in slots._mx_busy.values())
    for domain in ("a.test", "b.test", "c.test"):
        while slots.in_flight(domain):
            slots.release(domain)
    assert slots._mx_busy == {} and slots._charged == {}


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
