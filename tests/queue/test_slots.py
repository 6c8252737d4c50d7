"""Connection slots held while a connection is open, idle kept ones included (issue 5).

Pure: ``DomainSlots`` driven by hand, as the queue service drives it from leases and reports.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zoneq.queue.slots import DomainSlots, SlotState

HOST = "mx.shared.test"
MX_LIMITS = {HOST: 3, ".google.com": 2}


def state_of(slots: DomainSlots, slot_id: int) -> SlotState | None:
    found = [s.state for s in slots.held() if s.id == slot_id]
    return found[0] if found else None


# --- one step at a time -----------------------------------------------------------------------


def test_an_idle_kept_connection_holds_its_slot_and_only_its_worker_takes_it_up() -> None:
    slots = DomainSlots(1)
    first = slots.acquire("a.test", "w1")
    assert slots.keep(first, "w1")
    assert state_of(slots, first) is SlotState.IDLE
    assert slots.in_flight("a.test") == 1  # idle, still open at the remote end
    assert not slots.available("a.test")
    assert not slots.startable("a.test", "w2")  # another worker would open a second one
    assert slots.startable("a.test", "w1") and slots.could_start("a.test")
    assert slots.acquire("a.test", "w1") == first  # taken up: the same slot, busy again
    assert state_of(slots, first) is SlotState.BUSY
    assert not slots.could_start("a.test")


def test_a_connection_to_a_shared_mx_host_is_taken_up_by_another_domain_on_it() -> None:
    slots = DomainSlots(5, mx_limits=MX_LIMITS)
    for domain in ("a.test", "b.test"):
        slots.learn(domain, HOST)
    held = [slots.acquire("a.test", "w1") for _ in range(3)]
    assert not slots.available("b.test")  # the host's three are all open
    slots.keep(held[0], "w1")
    assert slots.acquire("b.test", "w1") == held[0]  # the count moves with the connection
    assert (slots.in_flight("a.test"), slots.in_flight("b.test")) == (2, 1)
    assert slots.mx_in_flight(HOST) == 3


@pytest.mark.parametrize(
    ("steps", "expected"),
    [
        # (operation, argument) in order; expected: the slot's state at the end (None: ended)
        ([("keep", "w1")], SlotState.IDLE),
        ([("keep", "w2")], None),  # not that worker's slot: not kept, freed
        ([("release", None)], None),
        ([("keep", "w1"), ("closed", "w1")], None),  # the idle connection was closed
        ([("keep", "w1"), ("closed", "w2")], SlotState.IDLE),  # only its holder can say so
        ([("closed", "w1")], SlotState.BUSY),  # a busy slot outlives news of an old close
        ([("keep", "w1"), ("disconnect", "w1")], None),
        ([("keep", "w1"), ("disconnect", "w2")], SlotState.IDLE),
        ([("disconnect", "w1")], SlotState.BUSY),  # busy ones end with their jobs
        # A job granted on a slot did not go out after all: an idle one taken up is idle
        # again (its connection is still open), a new one ends (none was opened).
        ([("keep", "w1"), ("take_up", "w1"), ("put_back", None)], SlotState.IDLE),
        ([("put_back", None)], None),
        ([("keep", "w1"), ("keep", "w1")], SlotState.IDLE),  # a second keep changes nothing
    ],
)
def test_a_slot_through_its_lifecycle(
    steps: list[tuple[str, str | None]], expected: SlotState | None
) -> None:
    slots = DomainSlots(2)
    slot = slots.acquire("a.test", "w1")
    for operation, owner in steps:
        match operation:
            case "keep":
                assert owner is not None
                slots.keep(slot, owner)
            case "release":
                slots.release(slot)
            case "closed":
                assert owner is not None
                slots.closed(slot, owner)
            case "disconnect":
                assert owner is not None
                slots.disconnect(owner)
            case "put_back":
                slots.put_back(slot)
            case "take_up":
                assert owner is not None
                assert slots.acquire("a.test", owner) == slot
    assert state_of(slots, slot) is expected
    assert slots.in_flight("a.test") == (0 if expected is None else 1)


def test_a_keep_above_a_lowered_limit_is_refused_and_the_worker_told_to_close() -> None:
    slots = DomainSlots(5, mx_limits=MX_LIMITS)
    held = [slots.acquire("a.test", "w1") for _ in range(4)]  # before its MX is known
    slots.learn("a.test", HOST)
    assert not slots.keep(held[0], "w1")  # four open on a host allowed three
    assert state_of(slots, held[0]) is SlotState.CLOSING
    assert slots.mx_in_flight(HOST) == 4  # counted until the worker says it is closed
    assert slots.has_closing("w1") and slots.closing("w1") == (held[0],)
    assert slots.closing("w1") == ()  # told once
    assert slots.closed(held[0], "w1")
    assert slots.keep(held[1], "w1")  # three now: within the limit
    assert not slots.available("a.test")
    assert slots.startable("a.test", "w1")


def test_learning_a_host_closes_idle_connections_above_its_limit_and_not_busy_ones() -> None:
    slots = DomainSlots(5, mx_limits=MX_LIMITS)
    a = [slots.acquire("a.test", "w1") for _ in range(3)]
    b = [slots.acquire("b.test", "w2") for _ in range(2)]
    for slot in a[:2]:
        slots.keep(slot, "w1")
    slots.keep(b[0], "w2")
    slots.learn("a.test", HOST)
    slots.learn("b.test", HOST)  # five open, three allowed: two of the three idle close
    assert slots.mx_in_flight(HOST) == 5
    told = slots.closing("w1") + slots.closing("w2")
    assert len(told) == 2 and set(told) <= {a[0], a[1], b[0]}
    # No new connection; w1's idle ones close, w2's may be taken up (three stay open).
    assert not slots.available("a.test") and not slots.available("b.test")
    assert not slots.startable("a.test", "w1") and slots.startable("b.test", "w2")


def test_a_slow_down_closes_idle_connections_above_the_halved_limit() -> None:
    from tests.queue.test_feedback import GMAIL_RATE, feedback
    from tests.queue.test_service import Clock

    slots = DomainSlots(4, feedback=feedback(Clock()))
    held = [slots.acquire("gmail.com", "w1") for _ in range(4)]
    for slot in held:
        slots.keep(slot, "w1")
    assert slots.feedback is not None
    slots.feedback.observe("gmail.com", 421, "4.7.28", GMAIL_RATE)
    assert slots.trim_domain("gmail.com") == 2  # the limit is 2 now
    assert len(slots.closing("w1")) == 2
    assert slots.trim_domain("gmail.com") == 0  # already told


# --- any order: held slots never exceed a limit ----------------------------------------------

# Three domains on a host allowed more than one domain's limit, so that an idle connection
# taken up by another domain of its host, and a host learnt while more than its limit are
# open, are both within reach; leases weighted up so that limits are reached often.
DOMAINS = ("a.test", "b.test", "e.test", "c.test", "d.test")
HOSTS = {
    "a.test": HOST,
    "b.test": HOST,
    "e.test": HOST,
    "c.test": "mx1.google.com",
    "d.test": "mx.free.test",
}
OWNERS = ("w1", "w2")
DOMAIN_LIMIT = 2
MX_LIMITS_OF = {HOST: 3, "mx1.google.com": 2}


@dataclass
class Workers:
    """The workers' side, as ``transport/cache.py`` behaves: which connections are open, by
    slot, and which of them have a job on them or are kept idle; each operation is one
    thing a worker (or the core learning a host) can do, applied to ``slots`` too."""

    slots: DomainSlots
    open: dict[int, tuple[str, str]] = field(default_factory=dict)  # slot -> (owner, domain)
    idle: set[int] = field(default_factory=set)
    busy: set[int] = field(default_factory=set)

    def mine(self, owner: str, among: set[int]) -> list[int]:
        return sorted(s for s in among if self.open[s][0] == owner)

    def lease(self, owner: str, domain: str, pick: int, keep: bool) -> None:
        if not self.slots.startable(domain, owner):
            return
        before = self.slots.mx_in_flight(HOSTS[domain])
        slot = self.slots.acquire(domain, owner)
        assert slot not in self.busy
        self.idle.discard(slot)
        self.busy.add(slot)
        self.open[slot] = (owner, domain)
        after = self.slots.mx_in_flight(HOSTS[domain])  # a new one only below the limit
        assert after == before or after <= MX_LIMITS_OF.get(HOSTS[domain], after)

    def report(self, owner: str, domain: str, pick: int, keep: bool) -> None:
        busy = self.mine(owner, self.busy)
        if not busy:
            return
        slot = busy[pick % len(busy)]
        self.busy.discard(slot)
        if keep:
            self.slots.keep(slot, owner)
            self.idle.add(slot)  # kept until told otherwise, or closed
        else:
            self.slots.release(slot)
            del self.open[slot]

    def close(self, owner: str, domain: str, pick: int, keep: bool) -> None:
        idle = self.mine(owner, self.idle)  # an idle timeout
        if idle:
            slot = idle[pick % len(idle)]
            self.idle.discard(slot)
            del self.open[slot]
            self.slots.closed(slot, owner)

    def obey(self, owner: str, domain: str, pick: int, keep: bool) -> None:
        for slot in self.slots.closing(owner):
            self.idle.discard(slot)
            self.open.pop(slot, None)
            self.slots.closed(slot, owner)

    def disconnect(self, owner: str, domain: str, pick: int, keep: bool) -> None:
        for slot in self.mine(owner, set(self.open)):
            if slot in self.busy:  # its jobs come back through the service: released
                self.slots.release(slot)
                self.busy.discard(slot)
            self.idle.discard(slot)
            del self.open[slot]
        self.slots.disconnect(owner)

    def learn(self, owner: str, domain: str, pick: int, keep: bool) -> None:
        self.slots.learn(domain, HOSTS[domain])


OPERATIONS = st.lists(
    st.tuples(
        st.sampled_from(["lease"] * 4 + ["report"] * 3 + ["close", "obey", "disconnect", "learn"]),
        st.sampled_from(OWNERS),
        st.sampled_from(DOMAINS[:3]) | st.sampled_from(DOMAINS),
        st.integers(0, 50),
        st.booleans(),
    ),
    min_size=20,
    max_size=80,
)


def run_operations(
    workers: Workers, operations: list[tuple[str, str, str, int, bool]], *, strict: bool
) -> None:
    for operation, owner, domain, pick, keep in operations:
        getattr(workers, operation)(owner, domain, pick, keep)
        check(workers.slots, workers, strict=strict)


def all_gone(workers: Workers) -> None:
    """Every worker disconnects: nothing is held, nothing is left to close."""
    for owner in OWNERS:
        workers.disconnect(owner, DOMAINS[0], 0, False)
    assert workers.slots.held() == [] and not workers.open
    assert not any(workers.slots.has_closing(owner) for owner in OWNERS)


def check(slots: DomainSlots, workers: Workers, *, strict: bool) -> None:
    held = {s.id: s for s in slots.held()}
    # Every open connection is counted, and nothing else is (no leak, no undercount).
    assert set(held) == set(workers.open)
    for domain in DOMAINS:
        open_here = sum(1 for _, d in workers.open.values() if d == domain)
        assert open_here == slots.in_flight(domain) <= DOMAIN_LIMIT
    for host, limit in MX_LIMITS_OF.items():
        on_host = [s for s in held.values() if HOSTS[s.domain] == host]
        if strict:  # every MX known from the start: the limit holds at every instant
            assert len(on_host) <= limit
        # Above the limit only in the learning window, and then no idle one stays open.
        counted = [s for s in on_host if s.host == host]
        if len([s for s in counted if s.state is not SlotState.CLOSING]) > limit:
            assert not [s for s in counted if s.state is SlotState.IDLE]


@settings(max_examples=300)
@given(OPERATIONS)
def test_held_slots_never_exceed_a_limit_whatever_the_order(
    operations: list[tuple[str, str, str, int, bool]],
) -> None:
    slots = DomainSlots(DOMAIN_LIMIT, mx_limits=MX_LIMITS)
    for domain, host in HOSTS.items():  # every MX known from the start
        slots.learn(domain, host)
    workers = Workers(slots)
    run_operations(workers, operations, strict=True)
    all_gone(workers)


@settings(max_examples=300)
@given(OPERATIONS)
def test_slots_stay_true_while_hosts_are_learnt_along_the_way(
    operations: list[tuple[str, str, str, int, bool]],
) -> None:
    slots = DomainSlots(DOMAIN_LIMIT, mx_limits=MX_LIMITS)
    workers = Workers(slots)
    run_operations(workers, operations, strict=False)
    all_gone(workers)
