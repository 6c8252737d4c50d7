"""The clock jumps forward five days: expired messages bounce once each, with no storm.

slow.test's MX (a fault server of the test's own, ``tests/support/faultserver.py``) answers
every MAIL with 451, so messages to it wait in ``deferred`` on the default schedule (next
try in 15 minutes).  Then the wall clock moves five days ahead, past the zone's 72 h
``max_age``, in one of two ways (libfaketime, ``tests/support/faketime.py``; monotonic
clocks left alone, as an NTP step or a resumed host leaves them):

* ``live``: ``zoneq serve`` runs under a clock file from the start, and the file is set to
  ``+5d`` while it runs, its recipients deferred: no restart;
* ``restart``: ``zoneq serve`` is stopped, and started again with ``FAKETIME=+5d``.

Every deferred recipient is then due at once.  Each must be tried exactly once more (RFC
5321 section 4.5.4.1: give up only after the retry period) and then expire: one EXPIRED
event per recipient, one DSN per message to the sender, never more; the remote must never
see more sessions at once than the zone's connection limit, and once all is done serve must
be idle, not spinning on a clock it thinks is behind: no delivery storm.

The clock itself is checked first: a child under the same environment must see its wall
clock move when the file changes, and the core's EXPIRED events must carry the faked time,
so that no check below can pass because nothing moved.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.reliability.bed import (
    WORKERS,
    QueueState,
    data_dir_of,
    inspect_queue,
    mail_bed,
)
from tests.support.faketime import DAY_S, ClockFile, faked_clock, libfaketime
from tests.support.faultserver import Faults, FaultServer
from tests.support.ledger import (
    Audit,
    Dumps,
    Ledger,
    Load,
    audit,
    send_until_cut,
    wait_settled,
)
from tests.support.serve import Serve, api_port, smtp_port, start_serve
from zoneq.api.client import ApiClient
from zoneq.protocol.events import Event, EventKind
from zoneq.storage.counters import zone_key
from zoneq.storage.records import State
from zoneq.storage.store import QueueStore

pytestmark = pytest.mark.integration

MESSAGES = 24
CONNECTIONS = 4
JUMP = "+5d"
JUMP_MS = int(5 * DAY_S * 1000)
SLACK_MS = 120_000  # real time between the jump and the events it causes, at most
RECIPIENTS = ("s1@slow.test", "s2@slow.test")
DEFERRED = State.DEFERRED.value
IDLE_S = 2.0  # serve watched this long once all expired
MAX_IDLE_CPU_S = 0.5  # CPU serve may use in that time: a spinning loop takes all of it
SETTLE_S = 60.0


class CountingServer(FaultServer):
    """A fault server that also counts its sessions open at once."""

    def __init__(self, faults: Faults) -> None:
        super().__init__(faults)
        self.open = 0
        self.most = 0

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        self.most = max(self.most, self.open)
        try:
            await super()._handle(reader, writer)
        finally:
            self.open -= 1

    def mails(self) -> int:
        return self.verbs().count(b"MAIL")


async def wait_for(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        await asyncio.sleep(0.1)
    return False


@dataclass
class Run:
    variant: str
    ledger: Ledger
    clock_moved_s: float | None = None  # a child's wall clock across the jump (live only)
    tried: bool = False  # every message tried before the jump
    deferred_before: int = 0  # recipients deferred in the queue right before the jump
    jump_ms: int = 0  # real time of the jump
    attempts_before: int = 0  # transactions the remote saw before the jump
    settled: bool = False
    emptied: bool = False  # serve's queue empty again, DSNs included, seen through its API
    attempts_after: int = 0  # transactions the remote saw after the jump
    most_at_once: int = 0  # sessions open at once after the jump
    idle_cpu_s: dict[int, float] = field(default_factory=dict)  # per process, once done
    preloaded: dict[int, bool] = field(default_factory=dict)  # libfaketime mapped, per pid
    dsns: int = 0
    events: list[Event] = field(default_factory=list)  # outcomes of the slow.test recipients
    audit: Audit | None = None
    state: QueueState | None = None

    def after_jump(self) -> list[Event]:
        return [e for e in self.events if e.time_ms >= self.jump_ms + JUMP_MS - SLACK_MS]

    def before_jump(self) -> list[Event]:
        return [e for e in self.events if e.time_ms < self.jump_ms]


def api_client(config: Path) -> ApiClient:
    token = (data_dir_of(config) / "api.token").read_text().strip()  # written at the start
    return ApiClient("127.0.0.1", api_port(config), token, timeout=10.0)


async def queue_counts(api: ApiClient) -> tuple[int, int]:
    """(messages queued, recipients deferred in the default zone), through the API."""
    counts = await asyncio.to_thread(api.call, "GET", "/api/v1/queue")
    return counts["messages"], counts["zones"].get("default", {}).get(DEFERRED, 0)


async def until_counts(api: ApiClient, wanted: Callable[[int, int], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if wanted(*await queue_counts(api)):
            return True
        await asyncio.sleep(0.2)
    return False


def cpu_s(pid: int) -> float:
    """User and system CPU time of ``pid`` so far (``/proc/<pid>/stat`` utime + stime)."""
    text = Path(f"/proc/{pid}/stat").read_text()
    fields = text[text.rindex(")") + 2 :].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def preloaded(pid: int) -> bool:
    """Whether libfaketime is mapped into ``pid``: the preload reached it."""
    return str(libfaketime()) in Path(f"/proc/{pid}/maps").read_text()


async def watch_idle(serve: Serve, run: Run) -> None:
    """CPU time of the core and each worker over ``IDLE_S`` with nothing left to do."""
    pids = [serve.pid, *serve.workers()]
    run.preloaded = {pid: preloaded(pid) for pid in pids}
    before = {pid: cpu_s(pid) for pid in pids}
    await asyncio.sleep(IDLE_S)
    run.idle_cpu_s = {pid: cpu_s(pid) - before[pid] for pid in pids}


async def send_and_defer(
    config: Path, remote: CountingServer, run: Run, api: ApiClient | None = None
) -> None:
    """Queue the messages and wait (bounded) until each was tried and deferred: through the
    API when serve runs on (``api``), else once it has stopped."""
    load = Load(RECIPIENTS)
    await send_until_cut(smtp_port(config), run.ledger, "old", load, limit=MESSAGES)
    run.tried = await wait_for(lambda: remote.mails() >= MESSAGES, 30.0)
    expected = len(run.ledger.expected())
    if api is not None:
        await until_counts(api, lambda _, deferred: deferred >= expected, 10.0)
        run.deferred_before = (await queue_counts(api))[1]


def jumped(run: Run, remote: CountingServer) -> None:
    """Note the real time and the remote's count right before the jump."""
    run.jump_ms = time.time_ns() // 1_000_000
    run.attempts_before = remote.mails()
    remote.most = remote.open  # sessions kept idle for reuse count too


async def live(tmp_path: Path, run: Run, remote: CountingServer, config: Path) -> Serve:
    """The jump while serve runs; returns serve still running, after the jump."""
    clock = ClockFile(tmp_path / "faketime.rc")
    run.clock_moved_s = await asyncio.to_thread(clock.jump_seen, JUMP)
    with faked_clock(clock.settings()):
        serve = start_serve(config, tmp_path / "serve.log")
    try:
        await asyncio.to_thread(serve.wait_ready, WORKERS)
        api = api_client(config)
        await send_and_defer(config, remote, run, api)
        jumped(run, remote)
        clock.set(JUMP)
    except BaseException:
        await asyncio.to_thread(serve.cleanup)
        raise
    return serve


async def restart(tmp_path: Path, run: Run, remote: CountingServer, config: Path) -> Serve:
    """Serve stopped over the jump; returns the second serve, started five days later."""
    first = start_serve(config, tmp_path / "serve-1.log")
    try:
        await asyncio.to_thread(first.wait_ready, WORKERS)
        await send_and_defer(config, remote, run)
        await asyncio.sleep(1.0)  # the last deferrals land
        await asyncio.to_thread(first.terminate)
    finally:
        await asyncio.to_thread(first.cleanup)
    before = await asyncio.to_thread(inspect_queue, config)
    run.deferred_before = before.counters.get(zone_key("default", DEFERRED), 0)
    jumped(run, remote)
    with faked_clock({"FAKETIME": JUMP}):
        later = start_serve(config, tmp_path / "serve-2.log")
    try:
        await asyncio.to_thread(later.wait_ready, WORKERS)
    except BaseException:
        await asyncio.to_thread(later.cleanup)
        raise
    return later


SCENARIOS = {"live": live, "restart": restart}


async def scenario(tmp_path: Path, variant: str) -> Run:
    run = Run(variant, Ledger())
    dumps = Dumps()
    remote = CountingServer(Faults(mail_reply=b"451 4.3.0 try again later"))
    async with remote:
        with mail_bed(tmp_path, port=remote.port, remotes={"slow.test": "127.0.0.1"}) as bed:
            config = bed.config(connections=CONNECTIONS)
            serve = await SCENARIOS[variant](tmp_path, run, remote, config)
            try:
                run.settled = await asyncio.to_thread(
                    wait_settled,
                    bed.sink,
                    dumps,
                    run.ledger.expected(),
                    timeout=SETTLE_S,
                    quiet=2.0,
                )
                run.emptied = await until_counts(api_client(config), lambda n, _: n == 0, 10.0)
                await watch_idle(serve, run)
                run.attempts_after = remote.mails() - run.attempts_before
                run.most_at_once = remote.most
                await asyncio.to_thread(serve.terminate)
            finally:
                await asyncio.to_thread(serve.cleanup)
            dumps.scan(bed.sink)
    run.state = await asyncio.to_thread(inspect_queue, config)
    run.events = await asyncio.to_thread(outcome_events, config)
    run.audit = audit(run.ledger, dumps, may_bounce=("slow.test",))
    run.dsns = sum(1 for c in dumps.copies.values() if c.bounce_of)
    return run


def outcome_events(config: Path) -> list[Event]:
    """The outcome events of the slow.test recipients (not the DSNs' own), in time order."""

    async def read() -> list[Event]:
        store = QueueStore.open(data_dir_of(config))
        try:
            return [e for _, e in store.events() if e.domain == "slow.test"]
        finally:
            await store.close()

    return asyncio.run(read())


@pytest.fixture(scope="module", params=sorted(SCENARIOS))
def run(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Run]:
    """Each scenario once, for the module's checks."""
    variant: str = request.param
    result = asyncio.run(scenario(tmp_path_factory.mktemp(f"clock-{variant}"), variant))
    ledger = result.ledger
    print(
        f"\nclock {JUMP} ({variant}): {len(ledger.acknowledged)} messages deferred "
        f"({result.deferred_before} recipients); after the jump {result.attempts_after} "
        f"attempt(s), at most {result.most_at_once} session(s) at once, {result.dsns} DSN(s), "
        f"{len(result.after_jump())} outcome event(s); idle CPU "
        f"{ {pid: round(s, 2) for pid, s in result.idle_cpu_s.items()} } s; "
        f"{result.audit.summary() if result.audit else ''}"
    )
    yield result


def test_the_wall_clock_really_jumped(run: Run) -> None:
    if run.variant == "live":
        # A child under the same environment saw its clock move when the file changed.
        assert run.clock_moved_s is not None
        assert abs(run.clock_moved_s - JUMP_MS / 1000) < SLACK_MS / 1000, run.clock_moved_s
    assert run.preloaded and all(run.preloaded.values()), run.preloaded  # workers included
    # The core's own clock: every outcome after the jump is stamped five days later.
    assert run.after_jump(), run.events
    assert len(run.before_jump()) + len(run.after_jump()) == len(run.events), run.events


def test_every_recipient_was_deferred_before_the_jump(run: Run) -> None:
    expected = run.ledger.expected()
    assert run.tried, "the remote never saw every message before the jump"
    assert run.attempts_before == len(run.ledger.acknowledged)  # once each: next in 15 min
    assert run.deferred_before == len(expected)
    before = run.before_jump()
    assert {e.kind for e in before} == {EventKind.DEFERRED}, before
    assert len(before) == len(expected) and {e.attempt for e in before} == {1}


def test_each_recipient_is_tried_once_more_then_expires(run: Run) -> None:
    after = run.after_jump()
    # Only expiries after the jump: no deferral, so no recipient was retried past its age.
    assert {e.kind for e in after} == {EventKind.EXPIRED}, after
    per_recipient = Counter((e.message_id, e.recipient) for e in after)
    assert len(per_recipient) == len(run.ledger.expected())
    assert set(per_recipient.values()) == {1}, per_recipient
    assert {e.attempt for e in after} == {2}  # one try before the jump, one after
    # One transaction per message at the remote (its recipients share one domain).
    assert run.attempts_after == len(run.ledger.acknowledged)


def test_each_expired_recipient_is_bounced_once_in_one_dsn_per_message(run: Run) -> None:
    result = run.audit
    assert result is not None
    assert run.settled, result.problems()
    assert not result.problems()
    assert result.copies == 0
    assert dict(result.bounces) == dict.fromkeys(run.ledger.expected(), 1)
    assert run.dsns == len(run.ledger.acknowledged)


def test_no_more_sessions_at_once_than_the_zone_allows(run: Run) -> None:
    assert 0 < run.most_at_once <= CONNECTIONS


def test_serve_is_idle_once_everything_expired(run: Run) -> None:
    # A loop that waits for a wall-clock time it thinks is still ahead (or behind) spins.
    assert run.emptied
    assert run.idle_cpu_s and max(run.idle_cpu_s.values()) < MAX_IDLE_CPU_S, run.idle_cpu_s


def test_the_queue_is_empty_and_its_counters_agree(run: Run) -> None:
    state = run.state
    assert state is not None
    assert state.messages == 0, state.counters
    assert state.counters == state.recount
