"""Feedback from replies: a slowed domain and a rested source address, on a fake clock."""

from __future__ import annotations

import pytest

from tests.queue.test_service import Clock, outcome
from tests.storage.conftest import MINUTE, SECOND, async_test, queue_message
from zoneq.config import load_config, validate_config
from zoneq.protocol.provider_replies import PROVIDER_RULES
from zoneq.protocol.reply_rules import ReplyAction
from zoneq.queue.feedback import DomainFeedback
from zoneq.queue.scheduler import DomainSlots
from zoneq.queue.service import QueueService, Result
from zoneq.storage.store import QueueStore

GMAIL_RATE = "421 4.7.28 Our system has detected an unusual rate of unsolicited mail"
SPAMHAUS = "554 5.7.1 Service unavailable; Client host [192.0.2.1] blocked using zen.spamhaus.org"


def feedback(clock: Clock) -> DomainFeedback:
    return DomainFeedback.from_config(load_config().reply_rules, clock)


def starts(slots: DomainSlots, domain: str) -> int:
    """Take every slot ``domain`` allows now; how many."""
    taken = 0
    while slots.available(domain):
        slots.acquire(domain)
        taken += 1
    return taken


def test_slow_down_halves_the_limit_spaces_starts_and_restores_after_the_period() -> None:
    clock = Clock()
    slots = DomainSlots(8, feedback=feedback(clock))
    assert slots.feedback is not None
    assert slots.feedback.observe("gmail.com", 421, "4.7.28", GMAIL_RATE) is ReplyAction.SLOW_DOWN
    assert slots.limit("gmail.com") == 4 and slots.limit("other.test") == 8
    # One start per second (slow_down_rate = "1/s"), up to the halved limit.
    assert starts(slots, "gmail.com") == 1
    clock.now += SECOND - 1
    assert starts(slots, "gmail.com") == 0
    for _ in range(5):
        clock.now += SECOND
        starts(slots, "gmail.com")
    assert slots.in_flight("gmail.com") == 4  # the halved limit holds
    assert starts(slots, "other.test") == 8  # other domains are not touched
    # After slow_down_period (10m), back to normal: full limit, no rate of its own.
    clock.now += 10 * MINUTE
    assert slots.limit("gmail.com") == 8
    assert starts(slots, "gmail.com") == 4
    assert slots.feedback.slowed() == frozenset()


def test_each_further_slow_down_halves_again_and_restarts_the_period() -> None:
    clock = Clock()
    state = feedback(clock)
    limits = []
    for _ in range(4):
        state.note("yahoo.com", ReplyAction.SLOW_DOWN)
        limits.append(state.limit("yahoo.com", 10))
        clock.now += 9 * MINUTE  # within the period each time
    assert limits == [5, 2, 1, 1]  # never below one connection
    assert state.slowed() == {"yahoo.com"}  # 36 minutes on, still slowed
    clock.now += MINUTE
    assert state.limit("yahoo.com", 10) == 10


def test_a_blocked_address_rests_for_that_domain_only_then_returns() -> None:
    clock = Clock()
    state = feedback(clock)
    reply = SPAMHAUS
    assert state.observe("outlook.com", 554, "5.7.1", reply, "192.0.2.1") is ReplyAction.BLOCKED
    state.observe("outlook.com", 554, "5.7.1", reply, "192.0.2.2")
    assert state.rested("outlook.com") == {"192.0.2.1", "192.0.2.2"}
    assert state.rested("gmail.com") == frozenset()
    assert state.limit("outlook.com", 10) == 10  # a block is not a slow down
    clock.now += 60 * MINUTE  # blocked_rest = "1h"
    assert state.rested("outlook.com") == frozenset()


DAY = 24 * 60 * MINUTE


def test_a_clock_stepped_back_holds_a_slowed_domain_one_period_at_most() -> None:
    clock = Clock()
    state = feedback(clock)
    state.observe("gmail.com", 421, "4.7.28", GMAIL_RATE)
    clock.now += 5 * MINUTE
    clock.now -= DAY  # NTP or an operator steps the wall clock back a day
    assert state.slowed() == {"gmail.com"}  # still slowed: the step shortens nothing...
    assert state.limit("gmail.com", 8) == 4
    clock.now += 10 * MINUTE  # ...and lengthens it to one slow_down_period (10m), not a day
    assert state.slowed() == frozenset() and state.limit("gmail.com", 8) == 8
    slots = DomainSlots(8, feedback=state)
    assert starts(slots, "gmail.com") == 8


def test_a_clock_stepped_back_rests_an_address_one_period_at_most() -> None:
    clock = Clock()
    state = feedback(clock)
    state.observe("outlook.com", 554, "5.7.1", SPAMHAUS, "192.0.2.1")
    clock.now -= DAY
    assert state.rested("outlook.com") == {"192.0.2.1"}
    clock.now += 60 * MINUTE  # blocked_rest = "1h" from the new time, not a day and an hour
    assert state.rested("outlook.com") == frozenset()


def test_a_clock_stepped_back_spaces_a_slowed_domain_by_its_rate_not_the_step() -> None:
    clock = Clock()
    state = feedback(clock)
    state.observe("gmail.com", 421, "4.7.28", GMAIL_RATE)
    slots = DomainSlots(8, feedback=state)
    assert starts(slots, "gmail.com") == 1
    clock.now -= 5 * MINUTE
    assert starts(slots, "gmail.com") == 0
    clock.now += SECOND  # slow_down_rate "1/s": the next start one second on
    assert starts(slots, "gmail.com") == 1


@pytest.mark.parametrize(
    ("code", "enhanced", "reply"),
    [
        (250, "2.0.0", "250 2.0.0 Ok: queued, not blocked using anything"),  # delivered
        (None, None, "connection refused"),  # no reply at all
        (550, "5.1.1", "550 5.1.1 no such user"),  # no rule: the codes decide
    ],
)
def test_replies_without_a_rule_change_nothing(
    code: int | None, enhanced: str | None, reply: str
) -> None:
    clock = Clock()
    state = feedback(clock)
    assert state.observe("d.test", code, enhanced, reply, "192.0.2.1") is None
    assert state.slowed() == frozenset() and state.rested("d.test") == frozenset()


def test_rules_and_timings_come_from_the_config() -> None:
    config = validate_config(
        {
            "zones": {"default": {}, "bounces": {}},
            "reply_rules": {
                "defaults": False,
                "slow_down_period": "1m",
                "slow_down_rate": "10/s",
                "rules": [{"pattern": "busy", "action": "slow_down", "category": "busy"}],
            },
        }
    )
    clock = Clock()
    state = DomainFeedback.from_config(config.reply_rules, clock)
    assert state.rules != PROVIDER_RULES
    assert state.observe("d.test", 421, None, GMAIL_RATE) is None  # shipped rules left out
    assert state.observe("d.test", 421, None, "421 too busy") is ReplyAction.SLOW_DOWN
    slots = DomainSlots(4, feedback=state)
    assert starts(slots, "d.test") == 1
    clock.now += 100  # "10/s": one every 100 ms
    assert starts(slots, "d.test") == 1
    clock.now += MINUTE
    assert state.slowed() == frozenset()


@async_test
async def test_the_service_holds_a_slowed_domain_back_and_lets_others_go(
    store: QueueStore,
) -> None:
    clock = Clock()
    service = QueueService(store, load_config(), hostname="mx.test", clock=clock)
    for n in range(6):
        await queue_message(store, [(f"r{n}@gmail.com", "default")])
        await queue_message(store, [(f"r{n}@other.test", "default")])
    zone_feedback = service._zone("default").slots.feedback  # what report() will call
    assert zone_feedback is not None
    zone_feedback.observe("gmail.com", 421, "4.7.28", GMAIL_RATE)
    jobs = await service.lease("default", "w1", max_jobs=20)
    assert sorted(j.domain for j in jobs).count("gmail.com") == 1  # one a second
    assert sorted(j.domain for j in jobs).count("other.test") == 6
    clock.now += SECOND
    (job,) = await service.lease("default", "w1", max_jobs=20)
    assert job.domain == "gmail.com"


@pytest.mark.parametrize("local", [False, True], ids=["the-remote-said-it", "a-plugin-said-it"])
@async_test
async def test_only_a_remote_reply_rests_our_address(store: QueueStore, local: bool) -> None:
    """A sender:connect plugin's refusal (``local_reply``) that reads like a blocklist
    reply is the plugin's word, not the provider's: our source address is not rested for
    the domain, and the plugin's 5xx bounces as it said rather than being ruled a deferral."""
    service = QueueService(store, load_config(), hostname="mx.test", clock=Clock())
    await queue_message(store, [("r@outlook.com", "default")])
    (job,) = await service.lease("default", "w1")
    report = outcome(
        job,
        Result.BOUNCED,
        code=554,
        enhanced="5.7.1",
        reply=SPAMHAUS,
        mx="mx.outlook.com",
        source_ip="192.0.2.1",
        local_reply=local,
    )
    await service.report("w1", report)
    zone_feedback = service._zone("default").slots.feedback
    assert zone_feedback is not None
    assert zone_feedback.rested("outlook.com") == ({"192.0.2.1"} if not local else frozenset())
    kinds = [event.kind.value for _, event in store.events() if event.kind.value != "accepted"]
    assert kinds == (["deferred"] if not local else ["bounced"])
