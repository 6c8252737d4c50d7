"""The queue service: the core's async owner of the store, serving the zone workers.

Theory of operation
-------------------
Workers ask for *jobs* (one SMTP transaction each: recipients of one message for one
domain) and later report one outcome per recipient.  For each zone the service keeps a
window of leased recipients planned into jobs (``scheduler.py``) and hands out the oldest
job whose domain has a free connection slot, when the zone's rate allows.  A worker that
finds nothing waits (``wait_ms``) and is woken when recipients become ready (the store's
``on_ready`` hook), when a slot frees, or when the rate allows the next job.

Every recipient handed out has a lease token; a report must carry it, and one that does not
match (the worker was too slow, the message was dropped, the core restarted) is refused.
The service remembers which worker connection holds which token, so a worker that goes
away has all its recipients returned at once, ready again.

Connection slots (``slots.py``): every job holds a slot of its domain (and MX host), named
in ``Job.slot``.  A worker that keeps the job's connection for the next message says so in
its report (``kept``), and the slot stays held, idle, by that worker until it says the
connection is closed (``closed``) or a job it is granted takes the slot up again; a slot
the core wants closed (above a lowered or newly learnt limit) is named to the worker in
its next reply (``closing``).  So the limits hold for connections open at the remote end,
idle ones included, while connections are still reused (issue 3).

Outcomes: DELIVERED completes the recipient; RETURNED gives it back untried; DEFERRED waits
for the zone's retry schedule, or expires into a bounce once the schedule gives up;
BOUNCED removes it with the record that it is owed a DSN, in the same batch; the DSN
(``bounces.py``), one per message whatever the jobs it failed in, is queued in the bounce
zone once the message's other recipients in this round are done (``_settle_owed``).
A delivery the worker marks ``relayed`` (NOTIFY=SUCCESS, and the server did not offer DSN)
completes with a "relayed" notice queued the same way (RFC 3461 section 5.2.2).

Each failure's reply goes to the zone's feedback (``feedback.py``) before it is applied: the
reply rule that fits it may turn a bounce into a deferral (a block of our source address
says nothing about the recipient) or the reverse, a "slow down" lowers the domain's
concurrency for a while, and a "blocked" rests the source address for that domain, which
the next job for it carries (``Job.rested``) so the worker binds another.  Each outcome's
MX host teaches the per-MX limits which domains share a host (``scheduler.py``).  Once
outcomes are committed, the outcome hooks (``delivered``, ``deferred``, ``bounced``) hear
of them in a task of their own, never holding the report up.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import itertools
import logging
import time
from collections import Counter
from collections.abc import (
    Awaitable,
    Callable,
    Collection,
    Container,
    Iterable,
    Iterator,
    Sequence,
)
from dataclasses import dataclass, field, replace
from typing import Final, NamedTuple

from zoneq.config import Config
from zoneq.errors import (
    LeaseError,
    NotFound,
    ProtocolError,
    StorageCorruption,
    StorageUnavailable,
)
from zoneq.logs import REPEATS
from zoneq.plugin.hooks import Hook, OutcomeArgs
from zoneq.plugin.host import PluginHost
from zoneq.protocol.dsn import Action
from zoneq.protocol.ids import format_id, id_time_ms
from zoneq.protocol.replies import DAMAGED_BODY, EnhancedStatus, Reply, reply_from_text
from zoneq.protocol.reply_rules import ReplyAction, rule_report
from zoneq.protocol.retry import RetrySchedule
from zoneq.queue.bounces import (
    FULL_RETURN_LIMIT,
    HEADER_LIMIT,
    OWED_WAIT_S,
    Failure,
    NoticeSettings,
    OwedNotices,
    any_wanted,
    compose,
    owed_failure,
    wants_notice,
)
from zoneq.queue.feedback import DomainFeedback
from zoneq.queue.scheduler import DomainSlots, Filling, JobQueue, Planned, RateLimiter
from zoneq.storage.owed import Owed, OwedOriginal
from zoneq.storage.records import MessageMeta, Notice, Recipient
from zoneq.storage.store import Lease, Outcome, QueueStore

log = logging.getLogger("zoneq.queue")

CORE_OWNER: Final = "core"  # the store-level owner of every lease the service holds
DEFAULT_WINDOW: Final = 2000  # recipients leased ahead per zone
# Recipients of one message that may wait in jobs still being filled (``Filling``), past
# the window: with 50 a job, enough for a message to 100 domains (4,900) to go out in full
# jobs.  Postfix's queue manager keeps up to 20,000 recipients in memory.
DEFAULT_FILLING: Final = 5000
# How long what a refill scan turned down stays turned down at most (``_refill``).
RESCAN_S: Final = 1.0
# How long jobs still being filled wait for the rest of their message while the zone's
# limits keep it from being read (``_unfilled``): long enough for the jobs holding a
# limit to end at a slow MX host; past that a small transaction is better than recipients
# held for a read that may not come soon (a domain rested for minutes).
FILL_WAIT_S: Final = 5.0
DEFAULT_DOMAIN_CONNECTIONS: Final = 10
EXPIRED_STATUS: Final = "4.4.7"  # RFC 3463: delivery time expired
# What a worker reports, with no remote reply, when the stored message is damaged.
DAMAGED_BODY_STATUS: Final = str(DAMAGED_BODY)


class Result(enum.Enum):
    DELIVERED = "delivered"
    DEFERRED = "deferred"
    BOUNCED = "bounced"
    RETURNED = "returned"


@dataclass(frozen=True, slots=True)
class JobRecipient:
    token: int
    address: str
    notify: tuple[str, ...]
    orcpt: str | None
    attempts: int


@dataclass(frozen=True, slots=True)
class Job:
    """What a worker needs to run one SMTP transaction."""

    msg_id: int
    sender: str
    size: int
    chunks: int
    domain: str
    envid: str | None
    ret: str | None
    smtputf8: bool
    body_8bit: bool
    recipients: tuple[JobRecipient, ...]
    body: bytes | None = None  # the whole body when it is one chunk: saves the worker a fetch
    rested: frozenset[str] = frozenset()  # source addresses to avoid for this domain now
    slot: int = 0  # the connection slot it holds (``slots.py``); the worker keeps it idle
    last_attempt: bool = False  # its recipients expire after it: resting MX hosts are tried
    zone_header: str | None = None  # the routing header field to remove (``MessageMeta``)


@dataclass(frozen=True, slots=True)
class RecipientOutcome:
    token: int
    result: Result
    reply: str = ""
    code: int | None = None
    enhanced: str | None = None
    mx: str | None = None
    source_ip: str | None = None
    possible_duplicate: bool = False
    category: str | None = None  # a failure's, decided by the core (``_judged``)
    # Delivered to a server without DSN for a recipient with NOTIFY=SUCCESS: a "relayed"
    # notice is owed (RFC 3461 section 5.2.2; ``_relay``).  The worker decides it, so the
    # delivery of every other recipient costs one attribute test here.
    relayed: bool = False
    # The reply is zoneq's own (a ``sender:connect`` plugin's), made without a connection:
    # ``mx`` is the host it was about, not one that replied (``remote_mta``).
    local_reply: bool = False

    @property
    def remote_mta(self) -> str | None:
        """The host whose reply this is, for a notice's Remote-MTA: none for our own reply
        (RFC 3464 section 2.3.5: the MTA that reported the status; also why the
        Diagnostic-Code is then not of type smtp, section 2.3.6)."""
        return None if self.local_reply else self.mx


@dataclass(frozen=True, slots=True)
class HoldCount:
    """What a message's hold did: recipients held now, and recipients on the wire that are
    held when their attempt ends undelivered (``QueueService.hold``)."""

    now: int
    on_return: int


@dataclass(slots=True)
class _SharedNotice:
    """One notice for a report's recipients of one message: a delay notice for its
    deferrals (``_defer_listed``) or a "relayed" notice for its deliveries (``_relay``).

    It rides with the first write whose lease the store still holds when that write is
    made.  One revoked meanwhile (an administrator deleted that recipient) is refused, and
    the notice must not go down with it: the others' writes would go through without it,
    and the sender would never be told."""

    notice: Notice
    carried: bool = False

    def claim(self, store: QueueStore, lease: Lease) -> Notice | None:
        """The notice, if nobody carries it yet and ``store`` holds ``lease``; then it is
        this write's.  The caller makes the write with no ``await`` in between, so the
        lease cannot be revoked between this look and the store's own check."""
        if self.carried or not store.holds(lease):
            return None
        self.carried = True
        return self.notice


@dataclass(slots=True)
class _Running:
    """A job handed to a worker: its tokens still to be reported, and the slot it holds."""

    zone: str
    domain: str
    owner: str
    tokens: set[int]
    size: int = 0  # the message's size, for the outcome events (issue 6)
    sender: str = ""  # for the outcome hooks
    slot: int = 0  # its connection slot: released, or kept idle, when the job is reported
    # Its message is a notice of ours (``MessageMeta.is_bounce``), read with the job's
    # metadata: its outcomes follow the notices' schedule (``_Zone.schedule_of``).
    notice: bool = False


class _Verdicts(NamedTuple):
    """What a refill scan read (``_refill``)."""

    blocked: frozenset[str]  # the domains blocked then
    last_key: bytes | None  # the last key it read
    expires: float  # the monotonic time after which to read it all again anyway
    # The message being filled, if these scans turned some of its records down: more of
    # it is ready, only held back by a limit.
    held_back: int | None = None


class _Refill(enum.Enum):
    """What a refill did (``_refill``)."""

    PLANNED = "planned"  # it leased recipients into jobs
    HELD = "held"  # nothing, but more of the message being filled may be ready
    DONE = "done"  # nothing, and nothing more of that message is ready


class _TurnedDown:
    """Whether a refill scan turned down records of the message being filled, before the
    scan (``watched``) or after it (the last one it leased).  A scan reads each message's
    records together (their keys are zone, message, address), so one message at a time
    is enough to follow."""

    __slots__ = ("last", "leased", "leased_seen", "watched", "watched_seen")

    def __init__(self, watched: int | None) -> None:
        self.watched = watched
        self.watched_seen = False
        self.leased: int | None = None  # the message of the last record leased
        self.leased_seen = False
        self.last: int | None = None  # the message of the last record turned down

    def accepted(self, msg_id: int) -> None:
        if msg_id != self.leased:
            self.leased = msg_id
            self.leased_seen = msg_id == self.last  # turned down before its first lease

    def refused(self, msg_id: int) -> None:
        self.last = msg_id
        self.watched_seen = self.watched_seen or msg_id == self.watched
        self.leased_seen = self.leased_seen or msg_id == self.leased

    def of(self, msg_id: int | None) -> bool:
        """Were records of ``msg_id`` turned down (if it is one of the two followed)?"""
        if msg_id is None:
            return False
        return (msg_id == self.watched and self.watched_seen) or (
            msg_id == self.leased and self.leased_seen
        )


@dataclass(slots=True)
class _Zone:
    name: str
    schedule: RetrySchedule
    slots: DomainSlots
    # The bounce zone's schedule for the notices zoneq generates: its retry intervals,
    # ``routing.bounce_max_age``.  None elsewhere.  Only for the notices: other mail the
    # rules (or the one-zone set-up, default_zone = bounce_zone) route here keeps the
    # zone's own max_age, as config/zones.toml documents bounce_max_age.
    notice_schedule: RetrySchedule | None
    rate: RateLimiter
    filling: Filling[Lease]  # jobs of a message the last window cut short (``_refill``)
    filling_msg: int | None = None  # that message, while ``filling`` holds any of it
    # Since when (monotonic) jobs being filled have waited for a read a limit holds back.
    filling_held: float | None = None
    queue: JobQueue[Lease] = field(default_factory=JobQueue)
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    verdicts: _Verdicts | None = None
    # The last refill read to the end of the zone and planned nothing, and nothing has
    # happened since that could change that (``poke``): another refill would read the same.
    exhausted: bool = False

    def schedule_of(self, notice: bool) -> RetrySchedule:
        """The retry schedule of a message here; ``notice``: it is one of ours."""
        if notice and self.notice_schedule is not None:
            return self.notice_schedule
        return self.schedule

    def poke(self) -> None:
        """Something a lease may find changed (records ready, a slot free, a resume): wake
        the leases waiting for this zone, and let the next refill read again."""
        self.exhausted = False
        self.wake.set()


def wall_clock_ms() -> int:
    return time.time_ns() // 1_000_000


class QueueService:
    def __init__(
        self,
        store: QueueStore,
        config: Config,
        *,
        hostname: str,
        clock: Callable[[], int] = wall_clock_ms,
        window: int = DEFAULT_WINDOW,
        domain_connections: int = DEFAULT_DOMAIN_CONNECTIONS,
        max_recipients: int = 50,
        filling: int = DEFAULT_FILLING,
        filling_wait_s: float = FILL_WAIT_S,
        owed_wait_s: float = OWED_WAIT_S,
        plugins: PluginHost | None = None,
    ) -> None:
        self._store = store
        self._config = config
        self._hostname = hostname
        self._clock = clock
        self._window = window
        self._domain_connections = domain_connections
        self._max_recipients = max_recipients
        self._filling = filling
        self._filling_wait = filling_wait_s
        self._zones: dict[str, _Zone] = {}
        self._leases: dict[int, tuple[Lease, int]] = {}  # token -> (lease, job id)
        self._running: dict[int, _Running] = {}  # job id -> state
        self._job_ids = itertools.count(1)
        # Outcome hooks (issue 5); None or a host without them: nothing is built per report.
        self._plugins = plugins
        self._notifying: set[asyncio.Future[None]] = set()
        store.on_ready = self._readied
        self._paused: set[str] = store.paused_zones()  # persisted by pause(); see the end
        # Zones an administrator's hold is walking (``holding``), by how many holds walk it:
        # lease() hands out nothing of these, nor of the paused ones.
        self._holding: Counter[str] = Counter()
        settings = NoticeSettings(hostname, config.routing.bounce_zone, config.server.bounce_from)
        self._owed = OwedNotices(store, settings, wait_s=owed_wait_s)

    @classmethod
    def from_config(
        cls,
        store: QueueStore,
        config: Config,
        *,
        clock: Callable[[], int] = wall_clock_ms,
        plugins: PluginHost | None = None,
    ) -> QueueService:
        """The service as ``zoneq serve`` runs it: host name and limits from the config;
        ``plugins``: the host whose outcome hooks hear of each committed outcome."""
        return cls(
            store,
            config,
            hostname=config.server.resolved_hostname(),
            clock=clock,
            domain_connections=config.delivery.domain_connections,
            max_recipients=config.delivery.max_recipients,
            plugins=plugins,
        )

    # --- zones ----------------------------------------------------------------------------

    def _zone(self, name: str) -> _Zone:
        zone = self._zones.get(name)
        if zone is None:
            settings = self._config.zones.get(name)
            schedule = settings.schedule if settings is not None else RetrySchedule.parse()
            bounces = name == self._config.routing.bounce_zone
            zone = _Zone(
                name=name,
                schedule=schedule,
                notice_schedule=self._config.bounce_schedule if bounces else None,
                slots=DomainSlots(
                    self._domain_connections,
                    self._config.delivery.domain_limits,
                    feedback=DomainFeedback.from_config(self._config.reply_rules, self._clock),
                    mx_limits=self._config.delivery.mx_limits,
                ),
                rate=RateLimiter.zone(settings.rate_limit if settings is not None else None),
                filling=Filling(
                    group=_job_group, max_recipients=self._max_recipients, limit=self._filling
                ),
            )
            self._zones[name] = zone
        return zone

    def _wake(self, zone: str) -> None:
        state = self._zones.get(zone)
        if state is not None:
            state.poke()

    def _readied(self, zone: str, key: bytes) -> None:
        state = self._zones.get(zone)
        if state is not None:
            last = state.verdicts
            if last is not None and (last.last_key is None or key <= last.last_key):
                state.verdicts = None  # ready again among what was turned down: all again
            state.poke()

    # --- leasing --------------------------------------------------------------------------

    async def lease(self, zone: str, owner: str, max_jobs: int = 1, wait_ms: int = 0) -> list[Job]:
        """Up to ``max_jobs`` jobs for ``owner``, waiting up to ``wait_ms`` for the first."""
        state = self._zone(zone)
        loop = asyncio.get_running_loop()
        deadline = loop.time() + wait_ms / 1000
        while True:
            state.wake.clear()
            stopped = zone in self._paused or zone in self._holding
            jobs = [] if stopped else self._take(state, owner, max_jobs)
            remaining = deadline - loop.time()
            # A worker told to close idle connections hears of it now, not after the wait.
            if jobs or remaining <= 0 or state.slots.has_closing(owner):
                return jobs
            pause = remaining
            rate_wait = state.rate.wait_ms(self._clock())
            if rate_wait > 0:
                pause = min(pause, rate_wait / 1000)
            if state.verdicts is not None:
                # What the last refill turned down may be startable by now with no event to
                # say so (a slowed domain's rate or rest ran out): look again when its
                # verdicts expire, not at the end of a wait of several seconds.
                pause = min(pause, max(0.0, state.verdicts.expires - time.monotonic()))
            if state.filling_held is not None and state.filling and not stopped:
                # Jobs held open go out when their wait is up, event or none (``_unfilled``).
                held_until = state.filling_held + self._filling_wait
                pause = min(pause, max(0.0, held_until - time.monotonic()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(state.wake.wait(), pause)

    def _take(self, state: _Zone, owner: str, max_jobs: int) -> list[Job]:
        jobs: list[Job] = []
        now = self._clock()
        while len(jobs) < max_jobs:
            taken = state.queue.take(state.slots, state.rate, now, owner)
            if taken is None:
                try:
                    refill = self._refill(state)
                except StorageUnavailable:
                    if not jobs and not state.filling:
                        raise
                    refill = _Refill.DONE  # the jobs built so far go out (their leases are out)
                if refill is not _Refill.PLANNED:
                    opened = self._unfilled(state, refill)
                    if not opened:
                        break
                    state.queue.extend(opened)
                continue
            try:
                job = self._hand_out(state, owner, *taken)
            except Exception:
                # Nothing of this job is registered yet (``_hand_out`` does that last), so
                # its recipients and slot are given back here, or they would stay out of
                # circulation; the jobs built before it go out (their leases are out).
                self._give_back(state, *taken)
                if not jobs:
                    raise
                log.exception("job of message %s not handed out", format_id(taken[0].msg_id))
                break
            if job is not None:
                jobs.append(job)
        return jobs

    def _unfilled(self, state: _Zone, refill: _Refill) -> list[Planned[Lease]]:
        """The jobs still being filled that go out now a refill read nothing: all of them
        once nothing more of their message is ready, or they have waited ``filling_wait_s``.

        While a domain or MX limit (or a window full of jobs) holds the rest of their
        message back, they wait for it: sent as they are, a message to 100 domains went
        out in jobs of 10 and 40 instead of 50.  What they wait for comes as the jobs
        holding the limit end, so the wait is short; the bound is for a limit that does
        not end soon.
        """
        if not state.filling:
            state.filling_held = None
            return []
        now = time.monotonic()
        if refill is _Refill.HELD:
            if state.filling_held is None:
                state.filling_held = now
            if now < state.filling_held + self._filling_wait:
                return []
        state.filling_held = None
        return state.filling.flush()

    def _refill(self, state: _Zone) -> _Refill:
        """Lease more of the zone into jobs (PLANNED); else say whether more of the message
        being filled may be ready (HELD: a limit kept it from being read) or not (DONE)."""
        room = self._window - state.queue.recipients()
        if room <= 0:
            return _Refill.HELD  # not read: the window is full of jobs waiting for slots
        blocked = frozenset(state.queue.blocked_domains(state.slots))
        # A scan reads the ready records past the cursor and turns down those of busy
        # domains.  Done from the cursor on every lease call while a domain is at its
        # limit, that cost more CPU per delivered message than the delivery itself (one
        # domain, 5,000 queued: 2 ms a message).  So what a scan read stays read: the next
        # ones read only what became ready after the last key it looked at, as long as the
        # same domains are blocked; the whole range again once an older record is ready
        # (``_readied``), a slot of a domain with no job waiting here frees (``_finish``),
        # or ``RESCAN_S`` passed (the slots' and the feedback's other verdicts).
        now = time.monotonic()
        last = state.verdicts
        after = None
        if last is not None and last.blocked == blocked and now < last.expires:
            # Every lease waiting for the zone wakes at each poke (a message committed, a
            # job reported), and the first one's refill reads what is new: the others
            # would open a database iterator each to find nothing (in tools/bench/
            # compare.py, workload 1, about 7% of the core's CPU per delivered message).
            if state.exhausted:
                return self._held(state, last)
            after = last.last_key
        else:
            last = None
        turned_down = _TurnedDown(state.filling_msg if state.filling else None)

        def accept(record: Recipient) -> bool:
            if record.domain not in blocked and state.slots.could_start(record.domain):
                turned_down.accepted(record.msg_id)
                return True
            turned_down.refused(record.msg_id)
            return False

        leases = self._store.lease(state.name, room, CORE_OWNER, accept=accept, after=after)
        if leases:
            # A scan that stopped at the window may have stopped inside a message (one to
            # many domains comes in address order): its partial jobs wait to be topped up
            # by the next refill (``Filling``; ``_unfilled`` says when they go as they are).
            # So may one that turned some of its last message down (a domain at its limit):
            # the rest of it is ready, to be read when the limit allows.
            cut = len(leases) >= room or turned_down.of(leases[-1].recipient.msg_id)
            state.queue.extend(state.filling.plan(leases, cut=cut))
            state.filling_msg = leases[-1].recipient.msg_id if state.filling else None
            state.filling_held = None
        filling = state.filling_msg if state.filling else None
        # A scan from ``after`` skips what the earlier ones since these verdicts turned down.
        earlier = last is not None and filling is not None and last.held_back == filling
        state.verdicts = _Verdicts(
            blocked,
            leases.last_key or after,
            last.expires if last is not None else now + RESCAN_S,
            filling if earlier or turned_down.of(filling) else None,
        )
        state.exhausted = not leases
        return _Refill.PLANNED if leases else self._held(state, state.verdicts)

    @staticmethod
    def _held(state: _Zone, verdicts: _Verdicts) -> _Refill:
        """After a refill that read nothing: is the message being filled held back?"""
        if state.filling and verdicts.held_back == state.filling_msg:
            return _Refill.HELD
        return _Refill.DONE

    def _give_back(self, state: _Zone, planned: Planned[Lease], slot: int) -> None:
        """A job taken from the queue that will not go out: its slot, and its recipients
        (ready again in the store, unless revoked meanwhile)."""
        state.slots.put_back(slot)
        for lease in planned.items:
            with contextlib.suppress(LeaseError):
                self._store.release(lease)

    def _hand_out(self, state: _Zone, owner: str, planned: Planned[Lease], slot: int) -> Job | None:
        # Recipients wait here leased to the core; one an administrator dropped meanwhile has
        # had its lease revoked, and must not go out.
        current = [lease for lease in planned.items if self._store.holds(lease)]
        for lease in planned.items:
            # Given back all the same (refused): should the delete's batch fail, its record
            # is then ready again, not leased to the core for good (``QueueStore._ended``).
            if not self._store.holds(lease):
                with contextlib.suppress(LeaseError):
                    self._store.release(lease)
        meta = None
        if current:
            try:
                meta = self._store.message(planned.msg_id)
            except NotFound:
                # Its message is gone: orphans, which kept leased would stay out of
                # circulation for good (and again after every restart).  The store removes
                # them with a DROPPED event each, and logs it.
                self._store.drop_orphans(planned.msg_id, current, self._clock())
                meta = None
            except StorageCorruption:
                # Its metadata cannot be read (the store quarantined and reported it): the
                # recipients stay leased to the core, out of circulation until a restart or
                # an administrator's delete, so the rest of the queue goes on (issue 7).
                meta = None
            except StorageUnavailable:
                # The database is closed (a reopen failed): ready again for when it is back
                # (a lease revoked meanwhile is refused before anything changes).
                self._give_back(state, planned, slot)
                return None
        if meta is None:
            state.slots.put_back(slot)
            return None
        planned = Planned(planned.msg_id, planned.domain, tuple(current))
        feedback = state.slots.feedback
        job = Job(
            slot=slot,
            last_attempt=self._expiring(state.schedule_of(meta.is_bounce), meta.msg_id),
            rested=feedback.rested(planned.domain) if feedback is not None else frozenset(),
            body=self._inline_body(meta),
            msg_id=meta.msg_id,
            sender=meta.sender,
            size=meta.size,
            chunks=meta.chunks,
            domain=planned.domain,
            envid=meta.envid,
            ret=meta.ret,
            smtputf8=meta.smtputf8,
            body_8bit=meta.body_8bit,
            zone_header=meta.zone_header,
            recipients=tuple(
                JobRecipient(
                    token=lease.token,
                    address=lease.recipient.address,
                    notify=lease.recipient.notify,
                    orcpt=lease.recipient.orcpt,
                    attempts=lease.recipient.attempts,
                )
                for lease in planned.items
            ),
        )
        # Registered to the worker only now, when nothing is left that can fail: a job
        # registered and then not returned would hold its recipients and its slot until
        # the worker went away, and be logged then as a possible duplicate.
        job_id = next(self._job_ids)
        tokens = {lease.token for lease in planned.items}
        self._running[job_id] = _Running(
            state.name, planned.domain, owner, tokens, meta.size, meta.sender, slot, meta.is_bounce
        )
        for lease in planned.items:
            self._leases[lease.token] = (lease, job_id)
        return job

    def _expiring(self, schedule: RetrySchedule, msg_id: int) -> bool:
        """Is this the message's last attempt: a failure now finds the schedule given up
        (``_next_attempt``)?  The schedule put the try at the expiry time itself, so it must
        be a real one: the worker then ignores its dead-host cache for the job."""
        return self._clock() >= schedule.expires_at(id_time_ms(msg_id))

    def _inline_body(self, meta: MessageMeta) -> bytes | None:
        """A one-chunk body travels with its job.  One the core cannot read now (missing,
        a damaged block, the database closed) is the worker's to fetch: it goes out all
        the same, and the worker's fetch fails the same way and reports the damaged body
        (``_body_damaged``), which quarantines the message, or defers it for later."""
        if meta.chunks != 1:
            return None
        try:
            return self._store.chunk(meta.msg_id, 0)
        except NotFound:
            return None
        except (StorageUnavailable, StorageCorruption) as exc:
            log.warning(
                "message %s: body not read for its job (%s); the worker reads it",
                format_id(meta.msg_id),
                exc,
                extra=REPEATS,
            )
            return None

    def _finish(self, token: int, kept: Container[int] = ()) -> Lease:
        """Forget a reported token; once its job is fully reported, its slot is kept idle
        if the worker kept the connection (``kept``), else freed."""
        lease, job_id = self._leases.pop(token)
        running = self._running[job_id]
        running.tokens.discard(token)
        if not running.tokens:
            del self._running[job_id]
            zone = self._zone(running.zone)
            if running.slot in kept:
                zone.slots.keep(running.slot, running.owner)  # idle, or told to close
            else:
                zone.slots.release(running.slot)
            if zone.verdicts is not None and running.domain not in zone.verdicts.blocked:
                zone.verdicts = None  # its records may have been turned down: read again
            zone.poke()
        return lease

    # --- reports --------------------------------------------------------------------------

    async def report(
        self, owner: str, outcomes: Sequence[RecipientOutcome], kept: Container[int] = ()
    ) -> tuple[list[int], list[int]]:
        """Apply a worker's outcomes; returns (accepted tokens, refused tokens).

        A token is refused when it is not (or no longer) this worker's, or when the store
        no longer holds its lease (an administrator dropped the message meanwhile).
        ``kept``: the slots of the reported jobs whose connections the worker keeps idle.
        """
        now = self._clock()
        refused: list[int] = []
        work: list[Awaitable[int | None]] = []
        failures: dict[int, list[tuple[int, Lease, Failure, Outcome, bool]]] = {}
        relayed: dict[int, list[tuple[int, Lease, Failure, Outcome]]] = {}  # msg_id -> owed
        deferrals: dict[int, list[tuple[int, Lease, Failure | None, Outcome, int]]] = {}
        damaged: dict[int, list[tuple[int, Lease, Outcome]]] = {}  # msg_id -> to quarantine
        told: list[tuple[Lease, RecipientOutcome, _Running]] = []
        checked: dict[int, str | None] = {}  # msg_id -> why its body is damaged, or None
        for reported in outcomes:
            claimed = self._claim(owner, reported, kept)
            if claimed is None:
                refused.append(reported.token)
                continue
            lease, item, running = claimed
            told.append(claimed)
            _log_if_duplicate(lease, item)
            outcome = Outcome(
                reply=item.reply,
                code=item.code,
                enhanced=item.enhanced,
                mx=item.mx,
                source_ip=item.source_ip,
                possible_duplicate=item.possible_duplicate,
                size=running.size,
                category=item.category,
            )
            settled = self._settled(lease, item, outcome, now)
            if settled is not None:
                work.append(_guarded(item.token, settled))
            elif item.result is Result.DELIVERED:  # (``relayed``): one notice per message
                owed = relayed.setdefault(lease.recipient.msg_id, [])
                owed.append((item.token, lease, _relayed_report(lease, item), outcome))
            elif item.result is Result.DEFERRED and self._body_damaged(lease, item, checked):
                # Grouped by message: one hold per damaged message per report.
                damaged.setdefault(lease.recipient.msg_id, []).append((item.token, lease, outcome))
            elif item.result is Result.DEFERRED:
                next_at = self._next_attempt(lease, running, now)
                if next_at is not None:
                    # Grouped by message: one NOTIFY=DELAY notice per report (``_defer``).
                    delay = self._delay_owed(lease, item, running, now)
                    waiting = deferrals.setdefault(lease.recipient.msg_id, [])
                    waiting.append((item.token, lease, delay, outcome, next_at))
                else:
                    # The last temporary status stands (as Postfix reports it): X.4.7 and
                    # its kin are persistent transient failures (RFC 3463 section 3.5).
                    status = item.enhanced or EXPIRED_STATUS
                    failure = Failure(
                        lease.recipient,
                        status,
                        item.reply or "delivery time expired",
                        item.remote_mta,
                    )
                    failed = failures.setdefault(lease.recipient.msg_id, [])
                    failed.append((item.token, lease, failure, outcome, True))
            else:
                status = item.enhanced or "5.0.0"  # RFC 3463: permanent, no detail given
                failure = Failure(lease.recipient, status, item.reply or None, item.remote_mta)
                failed = failures.setdefault(lease.recipient.msg_id, [])
                failed.append((item.token, lease, failure, outcome, False))
        for msg_id, group in failures.items():
            work.extend(self._bounce(msg_id, group, now))
        for msg_id, deferred in deferrals.items():
            work.extend(self._defer(msg_id, deferred, now))
        for msg_id, delivered in relayed.items():
            work.extend(self._relay(msg_id, delivered, now))
        held = [
            self._quarantine_message(
                msg_id, group, now, f"quarantined: damaged body ({checked[msg_id]})"
            )
            for msg_id, group in damaged.items()
        ]
        done = await self._written(work, held, now, told=told)
        accepted = [token for tokens in done for token in tokens if token is not None]
        refused.extend(item.token for item in outcomes if item.token not in accepted)
        self._tell_plugins(told, accepted)
        return accepted, sorted(set(refused))

    async def _written(
        self,
        work: list[Awaitable[int | None]],
        held: Sequence[Awaitable[list[int | None]]],
        now: int,
        *,
        told: Sequence[tuple[Lease, RecipientOutcome, _Running]],
    ) -> list[list[int | None]]:
        """A report's writes, done; then the failure notices owed by the messages it
        ``told`` of are queued, unless more of a message is still being tried
        (``_settle_owed``).  A report is what ends a message's recipients being tried, so
        this is where a waiting notice is looked at again (``run`` looks only at the new
        ones and those whose wait is up)."""
        done = await asyncio.gather(asyncio.gather(*work), *held)
        touched = {lease.recipient.msg_id for lease, _, _ in told}
        if touched:
            await self._settle_owed(now, among=touched)
        return done

    def _claim(
        self, owner: str, reported: RecipientOutcome, kept: Container[int] = ()
    ) -> tuple[Lease, RecipientOutcome, _Running] | None:
        """End the lease ``reported`` is about, if it is ``owner``'s (None if not); the
        outcome as the reply rules judge it."""
        held = self._leases.get(reported.token)
        if held is None or self._running[held[1]].owner != owner:
            return None
        running = self._running[held[1]]
        if reported.mx is not None:  # per-MX limits learn which host serves the domain
            self._zone(running.zone).slots.learn(running.domain, reported.mx)
        item = self._judged(running, reported)
        return self._finish(item.token, kept), item, running

    def _judged(self, running: _Running, item: RecipientOutcome) -> RecipientOutcome:
        """Feed a failure's reply to the zone's feedback (``feedback.py``), and let the reply
        rule that fits it decide between deferring and bouncing (``reply_rules.py``): a
        block of our address or a "slow down" under a 5xx defers, and the rules say which
        4xx texts are permanent in truth.  The failure's category for its events (issue 6)
        is the same rule's, else the reply's RFC 3463 class (``rule_report``)."""
        if item.result not in (Result.DEFERRED, Result.BOUNCED):
            return item
        feedback = self._zone(running.zone).slots.feedback
        if item.local_reply:
            # A plugin's own refusal, not the provider's: it says nothing of our address's
            # standing there (it must not rest the source address or slow the domain), and
            # the plugin's 4xx/5xx is its decision; only its category is the reply's class.
            feedback = None
        rules = feedback.rules if feedback is not None else ()
        ruling = rule_report(rules, item.code, item.enhanced, item.reply)
        action = ruling.action
        result: Result = item.result
        if feedback is not None and action is not None:
            feedback.note(running.domain, action, item.source_ip)
            if action is ReplyAction.SLOW_DOWN:  # a lower limit: idle ones above it close
                self._zone(running.zone).slots.trim_domain(running.domain)
            result = _RULED[action]
        return replace(item, result=result, category=ruling.category)

    def _tell_plugins(
        self, told: list[tuple[Lease, RecipientOutcome, _Running]], accepted: list[int]
    ) -> None:
        """Outcome hooks (``delivered``, ``deferred``, ``bounced``) for committed outcomes, in
        a task of their own: a slow plugin never holds up the report (``notify`` never
        raises; its failures are logged there)."""
        plugins = self._plugins
        if plugins is None or not told:
            return
        committed = set(accepted)
        calls: list[tuple[Hook, OutcomeArgs]] = []
        for lease, item, running in told:
            hook = _OUTCOME_HOOK.get(item.result)
            if item.token not in committed or hook is None or not plugins.handles(hook):
                continue
            record = lease.recipient
            calls.append(
                (
                    hook,
                    OutcomeArgs(
                        zone=running.zone,
                        message_id=format_id(record.msg_id),
                        sender=running.sender,
                        recipient=record.address,
                        reply=_reply_of(item),
                        attempts=record.attempts + 1,
                    ),
                )
            )
        if calls:
            task = asyncio.ensure_future(_notify_all(plugins, calls))
            self._notifying.add(task)
            task.add_done_callback(self._notifying.discard)

    def _schedule(self, running: _Running) -> RetrySchedule:
        """The retry schedule of the job ``running``'s message."""
        return self._zone(running.zone).schedule_of(running.notice)

    def _next_attempt(self, lease: Lease, running: _Running, now: int) -> int | None:
        """When to try again after this failure, or None: the schedule gives up (expired)."""
        record = lease.recipient
        schedule = self._schedule(running)
        return schedule.next_attempt(record.attempts + 1, id_time_ms(record.msg_id), now)

    def _delay_owed(
        self, lease: Lease, item: RecipientOutcome, running: _Running, now: int
    ) -> Failure | None:
        """The delay this deferral owes the sender a notice about, if any (once per
        recipient, when it has waited ``routing.delay_warning``; RFC 3461 section 4.1)."""
        record = lease.recipient
        if record.delay_notified or "DELAY" not in {n.upper() for n in record.notify}:
            return None
        queued_at = id_time_ms(record.msg_id)
        if now - queued_at < self._config.routing.delay_warning_ms:
            return None
        return Failure(
            record,
            status=delayed_status(item.enhanced),
            diagnostic=item.reply or None,
            remote_mta=item.remote_mta,
            action=Action.DELAYED,
            will_retry_until_ms=self._schedule(running).expires_at(queued_at),
        )

    def _defer(
        self, msg_id: int, group: list[tuple[int, Lease, Failure | None, Outcome, int]], now: int
    ) -> list[Awaitable[int | None]]:
        """Defer every recipient of one message in ``group``.  Those that owe the sender a
        delay notice get one between them, listing them all (RFC 3464 allows any number of
        per-recipient blocks) but those already deleted (``_listed``): it rides with the
        first whose deferral is written (``_defer_listed``), and each is marked as notified,
        so none is told twice."""
        delays = self._listed((lease, delay) for _, lease, delay, _, _ in group)
        # No notice without the message (gone, damaged, or the database closed): the
        # deferrals stand, and the next one owes the notice still.
        notice = self._headers_notice(msg_id, delays, now)
        work: list[Awaitable[int | None]] = []
        shared = _SharedNotice(notice) if notice is not None else None
        for token, lease, delay, outcome, next_at in group:
            if shared is not None and delay is not None:
                defer = self._defer_listed(lease, now, next_at, outcome, shared)
            else:
                defer = self._store.defer(lease, now, next_at, outcome)
            work.append(_guarded(token, defer))
        return work

    async def _defer_listed(
        self, lease: Lease, now: int, next_at: int, outcome: Outcome, shared: _SharedNotice
    ) -> None:
        """Defer one recipient that owes a shared delay notice (``_SharedNotice``): the first
        whose deferral is written carries it, the others only the flag that they were told
        (were the flag written with a notice gone down, nobody would be)."""
        told = shared.carried
        notice = shared.claim(self._store, lease)
        if told:
            lease = replace(lease, recipient=replace(lease.recipient, delay_notified=True))
        await self._store.defer(lease, now, next_at, outcome, delay_notice=notice)

    def _headers_notice(self, msg_id: int, listed: list[Failure], now: int) -> Notice | None:
        """The notice, with the original's headers only, for ``listed`` of ``msg_id``; None
        if none is owed, or the message cannot be read (gone, damaged, database closed)."""
        if not listed:
            return None
        try:
            return self._notice(self._store.message(msg_id), listed, now)
        except (NotFound, StorageCorruption, StorageUnavailable) as exc:
            log.warning("message %s: no notice now: %s", format_id(msg_id), exc, extra=REPEATS)
            return None

    def _relay(
        self, msg_id: int, group: list[tuple[int, Lease, Failure, Outcome]], now: int
    ) -> list[Awaitable[int | None]]:
        """Complete every recipient of one message in ``group`` (delivered to a server that
        does not offer DSN, each with NOTIFY=SUCCESS), with one "relayed" notice listing
        them all (RFC 3461 section 5.2.2), but those already deleted (``_listed``); it rides
        with the first whose completion is written (``_SharedNotice``).

        RFC 3461 section 4.3: RET applies only to a notice that reports a failure; one that
        reports none returns the headers only, whatever RET says.  A message that cannot
        be read now gets no notice: the recipients were delivered, and must not be sent
        again to make up for it."""
        listed = self._listed((lease, relayed) for _, lease, relayed, _ in group)
        notice = self._headers_notice(msg_id, listed, now)
        shared = _SharedNotice(notice) if notice is not None else None
        return [
            _guarded(token, self._complete_listed(lease, now, outcome, shared))
            for token, lease, _, outcome in group
        ]

    async def _complete_listed(
        self, lease: Lease, now: int, outcome: Outcome, shared: _SharedNotice | None
    ) -> None:
        """Complete one recipient of a report's group: the first whose completion is written
        carries the group's "relayed" notice (``_SharedNotice``), in the same batch."""
        notice = shared.claim(self._store, lease) if shared is not None else None
        await self._complete(lease, now, outcome, notice)

    async def _complete(
        self, lease: Lease, now: int, outcome: Outcome, notice: Notice | None = None
    ) -> None:
        """Complete a delivered recipient.  One an administrator deleted while it was on the
        wire is refused (``LeaseError``), but the remote has it all the same: the store
        records its delivery next to the delete (``delivered_after_drop``)."""
        try:
            await self._store.complete(lease, now, outcome, notice=notice)
        except LeaseError:
            await self._store.delivered_after_drop(lease, now, outcome)
            raise

    def _bounce(
        self, msg_id: int, group: list[tuple[int, Lease, Failure, Outcome, bool]], now: int
    ) -> list[Awaitable[int | None]]:
        """Bounce every recipient of one message in ``group``, each with the record that its
        failure is owed a notice, if it is (``bounces.py`` composes one DSN per message).
        One an administrator deleted while it was on the wire has its bounce refused, and
        is not told: a delete is silent, as Postfix's ``postsuper -d`` is."""
        meta: MessageMeta | None = None
        try:
            meta = self._store.message(msg_id)
        except NotFound:
            log.warning("message %s vanished before its bounce could be written", format_id(msg_id))
        except StorageCorruption:
            # Quarantined and reported by the store; the recipients are still bounced (their
            # outcome recorded), only the DSN cannot be composed without the metadata.
            log.error("message %s: no DSN, its metadata is corrupt", format_id(msg_id))
        except StorageUnavailable as exc:
            # The database is closed (a reopen failed): whether a DSN is owed cannot be
            # told, and a bounce without its record would lose it.  The reports are refused
            # and the recipients ready again, to be tried (and bounced) once it is back.
            log.warning(
                "message %s: bounce not written, queue storage unavailable: %s",
                format_id(msg_id),
                exc,
            )
            for _, lease, _, _, _ in group:
                with contextlib.suppress(LeaseError):
                    self._store.release(lease)
            return []
        return [
            _guarded(
                token,
                self._store.bounce(
                    lease, now, outcome, expired=expired, owed=self._owed_by(meta, failure, now)
                ),
            )
            for token, lease, failure, outcome, expired in group
        ]

    def _owed_by(self, meta: MessageMeta | None, failure: Failure, now: int) -> Owed | None:
        """The record that ``failure`` is owed a notice; None if it is not (or, without the
        message's metadata, cannot be told)."""
        if meta is None or not wants_notice(meta, failure):
            return None
        return Owed(owed_failure(failure, now), lambda: self._owed_original(meta))

    def _owed_original(self, meta: MessageMeta) -> OwedOriginal:
        """What the notice owed for ``meta``'s message returns of it, read as its first
        owed failure is written (the message may be gone by the time it is composed).  A
        body that cannot be read is not returned: the failures are told all the same."""
        try:
            whole = self._original_full(meta)
            start = whole if whole is not None else self._original_start(meta)
        except (NotFound, StorageCorruption, StorageUnavailable) as exc:
            log.warning("message %s: its notice returns no text: %s", format_id(meta.msg_id), exc)
            return OwedOriginal(meta, b"", None)
        return OwedOriginal(meta, start, whole)

    async def _settle_owed(
        self, now: int, *, among: Collection[int] | None = None, every: bool = False
    ) -> None:
        """Queue the failure notices owed now (``bounces.OwedNotices``); one the store cannot
        write now stays owed, for the next report or ``run``'s next round."""
        try:
            await self._owed.settle(now, among=among, every=every)
        except (StorageUnavailable, StorageCorruption) as exc:
            log.warning("failure notices not queued now: %s", exc, extra=REPEATS)

    def _listed(self, owed: Iterable[tuple[Lease, Failure | None]]) -> list[Failure]:
        """The failures a shared notice lists: those owed one whose leases the store still
        holds as the report is applied.  A recipient an administrator deleted while it was
        on the wire (``queue delete ID RCPT``) has its outcome refused and a DROPPED event
        on record; telling the sender it failed, or is still being tried, would contradict
        that, and a delete is silent, as Postfix's ``postsuper -d`` is.  (One deleted after
        this look, before its own write, stays listed: its failure was real.)"""
        return [
            failure for lease, failure in owed if failure is not None and self._store.holds(lease)
        ]

    def _notice(self, meta: MessageMeta, failures: list[Failure], now: int) -> Notice | None:
        """The notice for ``failures`` (delays, or deliveries relayed), or None if none is
        owed; it returns the original's header section alone, as RFC 3461 section 4.3 has
        a notice that reports no failure do.  The original is read only when a notice will
        be sent: a ``<>`` sender or NOTIFY=NEVER costs no read."""
        if not any_wanted(meta, failures):
            return None
        return compose(
            meta,
            failures,
            original_start=self._original_start(meta),
            original_full=None,
            reporting_mta=self._hostname,
            bounce_zone=self._config.routing.bounce_zone,
            now_ms=now,
            bounce_from=self._config.server.bounce_from,
        )

    def _body_damaged(
        self, lease: Lease, item: RecipientOutcome, checked: dict[int, str | None]
    ) -> bool:
        """Whether the body a worker found damaged is (``checked`` remembers each message's
        verdict for the rest of the report).

        A worker that cannot send a body whole (a chunk missing, or fewer octets than the
        message's size) closes the connection without the final dot and defers with
        ``DAMAGED_BODY_STATUS``; retried, it would fail the same way until the message
        expired.  So that status, and no other local fault, makes the core check the stored
        body (a read of it, once: the message is then held), and a damaged one goes to
        quarantine (``_quarantine_message``) instead.
        """
        if item.code is not None or item.enhanced != DAMAGED_BODY_STATUS:
            return False
        msg_id = lease.recipient.msg_id
        if msg_id not in checked:
            try:
                self._store.check_body(msg_id)
                checked[msg_id] = None
            except StorageCorruption as exc:  # quarantined (and logged) by the store
                checked[msg_id] = exc.reason
            except (NotFound, StorageUnavailable):
                checked[msg_id] = None  # gone, or unknown for now: the deferral stands
        return checked[msg_id] is not None

    async def _quarantine_message(
        self, msg_id: int, group: list[tuple[int, Lease, Outcome]], now: int, reason: str
    ) -> list[int | None]:
        """Hold the message whose body is damaged, the recipients of ``group`` (those of one
        report) with the rest, with the damage as the reason: out of circulation, kept for
        an operator to inspect, and shown as held (``zoneq queue show``), where a deferral
        would retry it until it expired.  Once per message and report, however many of its
        recipients the report has (each hold reads all its recipients and marks the leased
        ones).  For each of ``group``, its token if it was held (its attempt recorded).

        These leases are never given back first: ready, one could be handed out again
        before the hold.  They stay leased through the message's hold (which marks them)
        and each ends held (``hold_leased``), even when the message's metadata is too
        damaged to hold the rest.  A lease revoked meanwhile (its recipient deleted) is
        refused, and if all of them are, nothing is held on their word."""
        if not any(self._store.holds(lease) for _, lease, _ in group):
            return []
        log.error("message %s: %s; held", format_id(msg_id), reason)
        try:
            await self.hold(msg_id, reason)
        except (NotFound, StorageCorruption, StorageUnavailable) as exc:
            log.warning("message %s: its other recipients not held: %s", format_id(msg_id), exc)
        return await asyncio.gather(
            *(
                _guarded(token, self._store.hold_leased(lease, reason, now, outcome))
                for token, lease, outcome in group
            )
        )

    def _original_start(self, meta: MessageMeta) -> bytes:
        start = b""
        for index in range(meta.chunks):
            start += self._store.chunk(meta.msg_id, index)
            if b"\r\n\r\n" in start or b"\n\n" in start or len(start) >= HEADER_LIMIT:
                break
        return start

    def _original_full(self, meta: MessageMeta) -> bytes | None:
        if (meta.ret or "").upper() != "FULL" or meta.size > FULL_RETURN_LIMIT:
            return None
        return b"".join(self._store.body(meta.msg_id))

    # --- administration -------------------------------------------------------------------

    async def hold(self, msg_id: int, reason: str = "held by administrator") -> HoldCount:
        """Hold a message whatever state its recipients are in, as Postfix's ``postsuper -h``
        holds a message whatever queue it is in.

        The store holds only what is not leased, since a leased recipient may be on the
        wire; but those this service leased and has not handed out are not, so they are
        given back first and held with the rest.  Recipients in flight finish their attempt:
        delivered or bounced, they are done (a hold cannot call back a message the remote
        has); deferred, returned, or left by a worker that went away, they are held, not
        made ready.  The store decides that when it writes their outcome, by a mark it
        stages (and writes to disk, so a restart mid-attempt holds them too) together with
        the hold of the rest (``storage/holdmarks.py``): with no await between giving the
        jobs back and that, nothing can lease one in between, and a report whose outcome
        is not written yet is caught as well.
        """
        for zone in self._zones.values():
            for job in [*zone.queue.remove(msg_id), *zone.filling.remove(msg_id)]:
                for lease in job.items:
                    with contextlib.suppress(LeaseError):
                        self._store.release(lease)
        now, on_return = await self._store.hold_counted(msg_id, reason)
        return HoldCount(now, on_return)

    def _settled(
        self, lease: Lease, item: RecipientOutcome, outcome: Outcome, now: int
    ) -> Awaitable[None] | None:
        """The store's call that ends this attempt on its own: a delivery, or a job given
        back untried; None for a deferral or a bounce (grouped by message: ``_defer``,
        ``_bounce``).  A message held while this was on the wire is the store's to hold."""
        if item.result is Result.DELIVERED:
            if item.relayed:
                return None  # completed with its "relayed" notice (``_relay``)
            return self._complete(lease, now, outcome)
        if item.result is Result.RETURNED:
            return _release(self._store, lease)
        return None

    # --- bodies and connections -----------------------------------------------------------

    def chunk(self, msg_id: int, index: int) -> bytes:
        return self._store.chunk(msg_id, index)

    def disconnected(self, owner: str) -> int:
        """A worker went away: everything it held is ready again at once; how many.  Its
        connections went with it, so the slots it held idle are free too."""
        mine = [
            token for token, (_, job) in self._leases.items() if self._running[job].owner == owner
        ]
        for token in mine:
            lease = self._finish(token)
            # A worker that stops cleanly reports every job it holds before it goes (even
            # untried ones, as RETURNED), so a lease still held here went with a worker
            # that was killed or crashed, maybe after the final dot (RFC 1047): log it.
            log.warning(
                "possible duplicate: %016x to %s via ? (worker %s went away with it in "
                "hand); sent again",
                lease.recipient.msg_id,
                lease.recipient.address,
                owner,
            )
            # (Held instead, by the store, if its message was held meanwhile.)
            with contextlib.suppress(LeaseError):  # revoked meanwhile (dropped by an admin)
                self._store.release(lease)
        for zone in self._zones.values():
            if zone.slots.disconnect(owner):
                zone.verdicts = None
                zone.poke()
        return len(mine)

    def closed(self, zone: str, owner: str, slots: Iterable[int]) -> None:
        """``owner`` closed the idle connections of ``slots`` (or took them up under other
        slots): those slots are free.  Apply before the outcomes of the same report."""
        state = self._zones.get(zone)
        if state is None:
            return
        freed = [slot for slot in slots if state.slots.closed(slot, owner)]
        if freed:
            state.verdicts = None
            state.poke()

    def closing(self, zone: str, owner: str) -> tuple[int, ...]:
        """The slots whose idle connections ``owner`` must close now (each told once)."""
        state = self._zones.get(zone)
        return state.slots.closing(owner) if state is not None else ()

    # --- timers ---------------------------------------------------------------------------

    async def promote_due(self) -> int:
        """Bring every zone's due deferred recipients back to ready; how many.

        Those due further ahead than the zone's longest retry interval too: the wall clock
        stepped back since they were deferred, and a step back must not lengthen a wait
        beyond that interval (``zoneq/storage/stepback.py``).  ``_next_attempt`` needs no
        such care: it counts from the clock of the failure, never from an older time.
        """
        now = self._clock()
        moved = 0
        for zone in sorted(self._store.zones()):
            longest = max(self._zone(zone).schedule.intervals_ms)
            moved += await self._store.promote_due(zone, now, longest_ms=longest)
        return moved

    async def run(self, stop: asyncio.Event, interval_s: float = 1.0) -> None:
        """Promote due recipients, and queue the failure notices owed, until ``stop`` is set.
        Those a stop (or a crash) left owed are queued first, whatever else is under way."""
        await self._settle_owed(self._clock(), every=True)
        while not stop.is_set():
            try:
                await self.promote_due()
            except StorageUnavailable as exc:
                # The store heals itself (maintenance reopens it); deferred mail must still
                # come due afterwards, so the loop outlives the fault.
                log.warning(
                    "due recipients not promoted, queue storage unavailable: %s", exc, extra=REPEATS
                )
            await self._settle_owed(self._clock())
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), interval_s)

    def in_flight(self) -> int:
        return len(self._leases)

    # --- zones paused and held by an administrator -----------------------------------------

    def unqueue(self, zone: str) -> int:
        """Give back the recipients of ``zone`` leased here and not yet handed to a worker,
        so they are ready (and holdable) in the store again; how many."""
        state = self._zones.get(zone)
        if state is None:
            return 0
        returned = 0
        for job in [*state.queue.drain(), *state.filling.flush()]:
            for lease in job.items:
                with contextlib.suppress(LeaseError):  # revoked meanwhile (dropped)
                    self._store.release(lease)
                    returned += 1
        return returned

    @contextlib.contextmanager
    def holding(self, zone: str) -> Iterator[None]:
        """Hand out nothing of ``zone`` while an administrator's hold walks it.

        The walk awaits between pages; a lease in between would refill the job queue with
        records the walk then passes over as leased, and hand them out after it.  So the
        zone's queued jobs go back to the store first (``unqueue``), and nothing is leased
        until the walk is over; jobs already with a worker finish.
        """
        self._holding[zone] += 1
        try:
            self.unqueue(zone)
            yield
        finally:
            self._holding[zone] -= 1
            if not self._holding[zone]:
                del self._holding[zone]
            self._wake(zone)

    async def pause(self, zone: str) -> None:
        """Stop handing out ``zone``'s work (new mail for it still queues); persisted, so the
        pause outlives a restart.  Jobs already with a worker finish."""
        await self._store.set_paused(zone, True)
        self._paused.add(zone)
        self.unqueue(zone)

    async def resume(self, zone: str) -> None:
        await self._store.set_paused(zone, False)
        self._paused.discard(zone)
        self._wake(zone)

    def paused(self) -> frozenset[str]:
        return frozenset(self._paused)


_RULED: Final = {
    ReplyAction.DEFER: Result.DEFERRED,
    ReplyAction.SLOW_DOWN: Result.DEFERRED,
    ReplyAction.BLOCKED: Result.DEFERRED,
    ReplyAction.BOUNCE: Result.BOUNCED,
}
_OUTCOME_HOOK: Final = {
    Result.DELIVERED: Hook.DELIVERED,
    Result.DEFERRED: Hook.DEFERRED,
    Result.BOUNCED: Hook.BOUNCED,
}


def _job_group(lease: Lease) -> tuple[int, str]:
    """What one job holds: recipients of one message for one domain."""
    return lease.recipient.msg_id, lease.recipient.domain


def _log_if_duplicate(lease: Lease, item: RecipientOutcome) -> None:
    # RFC 1047: the message went out whole but no final reply came back, so the remote may
    # have it; a retry can deliver a second copy.  Logged so that a duplicate can be
    # explained (the event carries the flag too).
    if not item.possible_duplicate:
        return
    log.warning(
        "possible duplicate: %016x to %s via %s (%s); retried later",
        lease.recipient.msg_id,
        lease.recipient.address,
        item.mx or "?",
        item.reply or "no reply after the final dot",
    )


def delayed_status(enhanced: str | None) -> str:
    """The Status of a delay notice's block for a deferral reported with ``enhanced``.

    A recipient still being retried has a transient status: RFC 3463 section 3.1 makes
    class 5 permanent, and a bounce processor reading "Action: delayed" with "Status: 5.7.1"
    takes it for a hard bounce.  A deferral can carry class 5 (a 554 greeting from every
    MX is deferred, as Postfix does) or class 2 (a DATA answered 250, out of step), so the
    class becomes 4 and the subject and detail stay (Postfix turns 5.x.x into 4.x.x for a
    deferral the same way); no code at all is 4.0.0."""
    parsed = EnhancedStatus.parse(enhanced or "")
    return "4.0.0" if parsed is None else str(replace(parsed, klass=4))


def _relayed_report(lease: Lease, item: RecipientOutcome) -> Failure:
    """The block of a "relayed" notice (RFC 3461 section 5.2.2): the remote's reply to the
    final dot as the diagnostic, and its status when it gave a 2.x.x one, else 2.0.0 (RFC
    3463 section 3.1: success, no detail)."""
    parsed = EnhancedStatus.parse(item.enhanced or "")
    status = str(parsed) if parsed is not None and parsed.klass == 2 else "2.0.0"
    return Failure(lease.recipient, status, item.reply or None, item.mx, action=Action.RELAYED)


def _reply_of(item: RecipientOutcome) -> Reply | None:
    """The remote reply as a worker reported it (code and one-line text), if there was one."""
    if item.code is None:
        return None
    code = str(item.code)
    text = item.reply[len(code) :].lstrip(" -") if item.reply.startswith(code) else item.reply
    try:
        return reply_from_text(item.code, text)
    except ProtocolError:
        return None


async def _notify_all(plugins: PluginHost, calls: list[tuple[Hook, OutcomeArgs]]) -> None:
    for hook, args in calls:
        await plugins.notify(hook, args)


async def _guarded(token: int, operation: Awaitable[None]) -> int | None:
    """The token if the store applied the operation (or, while it cannot write, holds it
    until it can: ``zoneq/storage/held.py``), None if its lease was gone or the store could
    not take it; the report is then refused like a stale one and the worker goes on."""
    try:
        await operation
    except LeaseError:
        return None
    except (NotFound, StorageCorruption) as exc:
        # The message is damaged (the store quarantined what it could not read): this
        # outcome is refused, the rest of the report stands, and the worker goes on.  Its
        # lease stays with the core, so the recipient is not sent again before a restart.
        log.error("report of lease %d not written, its message is damaged: %s", token, exc)
        return None
    except StorageUnavailable as exc:
        log.warning(
            "report of lease %d not written, queue storage unavailable: %s",
            token,
            exc,
            extra=REPEATS,
        )
        return None
    return token


async def _release(store: QueueStore, lease: Lease) -> None:
    """A job given back untried: ready again (``LeaseError`` if revoked: refused)."""
    store.release(lease)
