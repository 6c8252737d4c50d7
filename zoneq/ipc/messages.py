"""The verbs spoken between the core and a zone worker, as frozen dataclasses.

Theory of operation
-------------------
Every frame carries an envelope ``{"id": int, "verb": str, "body": map}``.  The worker sends
requests; the core answers each with exactly one reply echoing its ``id``, so one connection
carries many requests at once (several delivery loops of a worker share it) and replies may
come back in any order.  ``seal`` builds an envelope, ``open_envelope`` checks one, and
``decode_request`` / ``decode_reply`` turn its body into the dataclass its verb names.

=========================  ======================  ==========================================
request (worker -> core)   reply (core -> worker)  meaning
=========================  ======================  ==========================================
``Hello``                  ``Welcome``             first request on a connection, names the
                                                   zone, the worker and the protocol version
``LeaseRequest``           ``LeaseReply``          up to ``max_jobs`` ready jobs, waiting at
                                                   most ``wait_ms`` for one (empty if none)
``ChunkRequest``           ``ChunkReply``          one chunk of a leased message's body
``Report``                 ``ReportReply``         outcomes per recipient token; tokens whose
                                                   lease is no longer current are refused;
                                                   with ``lease_jobs`` the reply also brings
                                                   up to that many jobs ready at once
any                        ``ErrorReply``          the request failed; ``kind`` says how
=========================  ======================  ==========================================

A busy delivery loop reports a job and takes the next in one round trip: its ``Report``
asks for ``lease_jobs`` and the ``ReportReply`` brings them, so a message costs one frame
each way instead of two.  The core commits the report first and then leases without
waiting, so the reply is never held up by an empty queue (a worker that gets no job asks
with a waiting ``LeaseRequest``) and a worker told to stop still has its report answered
at once.  Both fields are optional on the wire: a core that does not know ``lease_jobs``
ignores it and answers without ``jobs``, which a worker takes as "no job ready".
Likewise ``Job.rested`` (source addresses resting for the job's domain): absent means none,
and ``Job.last_attempt`` (the retry schedule's last try before expiry): absent is false.
``Job.zone_header`` (the routing header field that chose the message's zone, as it was
named when the message came) is sent only when known: absent, the worker removes the field
its own config names, as a worker that does not know it always does.

Connection slots (issue 5): the core's limits per domain and per MX host count connections
open at the remote end, idle ones a worker keeps for reuse included.  ``Job.slot`` names
the slot a job holds; ``Report.kept`` says which reported jobs' connections the worker
keeps (their slots stay held, idle), ``Report.closed`` which idle ones it has closed since;
``close`` in a ``LeaseReply`` or ``ReportReply`` asks it to close some now.  All four are
optional on the wire: an older core sends no slot and ignores ``kept`` (the worker then
keeps connections uncounted, as before), and an older worker never keeps a slot.

Worker figures (issue 7): ``Report.dead_hosts`` is the worker's count of MX addresses its
dead-host cache is resting now (``delivery/hostcache.py``), for the core's ``/metrics``.  A
worker sends it when the count changes, in a report of its own if no report is due (an
empty ``results``, as for closed slots).  Optional on the wire: absent (an older worker, or
a report that does not say) leaves the core's last value as it was, and an older core
ignores it.

Liveness: a worker that has written nothing for a few seconds sends an empty ``Report``
(``delivery/worker.py``), so the core hears from every live worker; one it has not heard
from for a minute is taken for hung and killed (``supervisor.py``).  No new field: an
older core answers it as any report.

Bodies are maps with the field names of the dataclasses, so a capture is readable without
this module.  Decoding validates every field's type and names the field (as a path such as
``lease.jobs[2].recipients[0].token``) in the ``ProtocolError`` it raises; no ``KeyError``
or ``TypeError`` escapes.  Fields a body has beyond those known are ignored.  msgpack arrays
decode as lists; they become tuples here so every message is immutable and hashable.

Versioning: ``Hello`` carries ``version``, and decoding a ``Hello`` of another version
raises ``ProtocolError`` before looking at any other field, since a different version may
have different ones.  Within a version, changes must stay compatible both ways.

``ErrorReply`` carries a zoneq error across the socket: ``ErrorReply.from_exception`` on the
core maps an exception to a ``kind``, ``ErrorReply.to_exception`` on the worker maps it back.

Pure: no asyncio, no I/O.
"""

from __future__ import annotations

import enum
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import ClassVar, Final, TypeVar

from zoneq.errors import (
    LeaseError,
    NotFound,
    ProtocolError,
    TemporaryFailure,
    ZoneqError,
)

__all__ = [
    "PROTOCOL_VERSION",
    "ChunkReply",
    "ChunkRequest",
    "CoreFailure",
    "Envelope",
    "ErrorReply",
    "Hello",
    "Job",
    "JobRecipient",
    "LeaseReply",
    "LeaseRequest",
    "Outcome",
    "RecipientReport",
    "Reply",
    "Report",
    "ReportReply",
    "Request",
    "Welcome",
    "decode_reply",
    "decode_request",
    "open_envelope",
    "reply_type_for",
    "seal",
]

PROTOCOL_VERSION: Final = 1


class CoreFailure(TemporaryFailure):
    """The core failed to handle a request for a reason of its own (a bug, logged there).

    Temporary from the worker's point of view: the mail is still queued and will be tried
    again, so it must never turn into a bounce.
    """


# ---------------------------------------------------------------------------------------
# Field validation.  ``where`` is the dotted path of the map being read, for error messages.

_Body = Mapping[str, object]
_T = TypeVar("_T")


def _get(body: _Body, name: str, where: str) -> object:
    try:
        return body[name]
    except KeyError:
        raise ProtocolError(f"{where}.{name}: missing") from None


def _fail(where: str, name: str, expected: str, value: object) -> ProtocolError:
    return ProtocolError(f"{where}.{name}: expected {expected}, got {type(value).__name__}")


def _int(body: _Body, name: str, where: str, *, minimum: int | None = None) -> int:
    value = _get(body, name, where)
    # bool is an int subclass in Python but a distinct msgpack type: refuse it, so a peer
    # sending true for a count is caught rather than read as 1.
    if not isinstance(value, int) or isinstance(value, bool):
        raise _fail(where, name, "int", value)
    if minimum is not None and value < minimum:
        raise ProtocolError(f"{where}.{name}: must be at least {minimum}, got {value}")
    return value


def _opt_int(body: _Body, name: str, where: str) -> int | None:
    if _get(body, name, where) is None:
        return None
    return _int(body, name, where)


def _str(body: _Body, name: str, where: str) -> str:
    value = _get(body, name, where)
    if not isinstance(value, str):
        raise _fail(where, name, "str", value)
    return value


def _opt_str(body: _Body, name: str, where: str) -> str | None:
    if _get(body, name, where) is None:
        return None
    return _str(body, name, where)


def _added_str(body: _Body, name: str, where: str) -> str | None:
    """An optional str field: absent or None is None (older peers do not send it)."""
    if body.get(name) is None:
        return None
    return _str(body, name, where)


def _opt_bytes(body: _Body, name: str, where: str) -> bytes | None:
    """An optional bytes field: absent or None is None (older peers do not send it)."""
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, bytes):
        raise _fail(where, name, "bytes or nil", value)
    return value


def _opt_gauge(body: _Body, name: str, where: str) -> int | None:
    """An optional count that may be left unsaid: absent or None is None, else at least 0."""
    if body.get(name) is None:
        return None
    return _int(body, name, where, minimum=0)


def _opt_count(body: _Body, name: str, where: str) -> int:
    """An optional count: absent is 0 (older peers do not send it)."""
    if body.get(name) is None:
        return 0
    return _int(body, name, where, minimum=0)


def _bool(body: _Body, name: str, where: str) -> bool:
    value = _get(body, name, where)
    if not isinstance(value, bool):
        raise _fail(where, name, "bool", value)
    return value


def _opt_flag(body: _Body, name: str, where: str) -> bool:
    """An optional flag: absent or None is false (older peers do not send it)."""
    if body.get(name) is None:
        return False
    return _bool(body, name, where)


def _bytes(body: _Body, name: str, where: str) -> bytes:
    value = _get(body, name, where)
    if not isinstance(value, bytes):
        raise _fail(where, name, "bytes", value)
    return value


def _list(body: _Body, name: str, where: str) -> list[object]:
    value = _get(body, name, where)
    if not isinstance(value, list | tuple):
        raise _fail(where, name, "array", value)
    return list(value)


def _map(value: object, where: str) -> _Body:
    if not isinstance(value, dict):
        raise ProtocolError(f"{where}: expected map, got {type(value).__name__}")
    # Keys are str whenever the peer follows the protocol; a non-str key can only fail a
    # lookup later, which reports the field as missing.
    return value


def _str_tuple(body: _Body, name: str, where: str) -> tuple[str, ...]:
    items = _list(body, name, where)
    for index, item in enumerate(items):
        if not isinstance(item, str):
            raise _fail(where, f"{name}[{index}]", "str", item)
    return tuple(items)  # type: ignore[arg-type]  # every item checked to be str above


def _opt_str_tuple(body: _Body, name: str, where: str) -> tuple[str, ...]:
    """An optional array of strings: absent or None is empty (older peers do not send it)."""
    if body.get(name) is None:
        return ()
    return _str_tuple(body, name, where)


def _int_tuple(body: _Body, name: str, where: str) -> tuple[int, ...]:
    items = _list(body, name, where)
    for index, item in enumerate(items):
        if not isinstance(item, int) or isinstance(item, bool):
            raise _fail(where, f"{name}[{index}]", "int", item)
    return tuple(items)  # type: ignore[arg-type]  # every item checked to be int above


def _opt_int_tuple(body: _Body, name: str, where: str) -> tuple[int, ...]:
    """An optional array of ints: absent or None is empty (older peers do not send it)."""
    if body.get(name) is None:
        return ()
    return _int_tuple(body, name, where)


def _put_ints(body: dict[str, object], name: str, values: tuple[int, ...]) -> None:
    """An optional array of ints goes on the wire only when it has any (absent is empty)."""
    if values:
        body[name] = list(values)


def _nested(
    body: _Body, name: str, where: str, decode: Callable[[_Body, str], _T]
) -> tuple[_T, ...]:
    items = _list(body, name, where)
    out: list[_T] = []
    for index, item in enumerate(items):
        path = f"{where}.{name}[{index}]"
        out.append(decode(_map(item, path), path))
    return tuple(out)


# ---------------------------------------------------------------------------------------
# Requests


@dataclass(frozen=True, slots=True)
class Hello:
    """Introduces a worker; must be the first request on a connection."""

    VERB: ClassVar[str] = "hello"

    zone: str
    worker: str
    pid: int
    version: int = PROTOCOL_VERSION

    def to_wire(self) -> dict[str, object]:
        return {"version": self.version, "zone": self.zone, "worker": self.worker, "pid": self.pid}

    @classmethod
    def from_wire(cls, body: _Body, where: str = VERB) -> Hello:
        version = _int(body, "version", where)
        if version != PROTOCOL_VERSION:
            raise ProtocolError(
                f"{where}.version: protocol version {version} is not supported "
                f"(this side speaks {PROTOCOL_VERSION})"
            )
        return cls(
            zone=_str(body, "zone", where),
            worker=_str(body, "worker", where),
            pid=_int(body, "pid", where),
            version=version,
        )


@dataclass(frozen=True, slots=True)
class LeaseRequest:
    """Asks for up to ``max_jobs`` jobs of the connection's zone, waiting up to ``wait_ms``."""

    VERB: ClassVar[str] = "lease"

    max_jobs: int = 1
    wait_ms: int = 0

    def to_wire(self) -> dict[str, object]:
        return {"max_jobs": self.max_jobs, "wait_ms": self.wait_ms}

    @classmethod
    def from_wire(cls, body: _Body, where: str = VERB) -> LeaseRequest:
        return cls(
            max_jobs=_int(body, "max_jobs", where, minimum=1),
            wait_ms=_int(body, "wait_ms", where, minimum=0),
        )


@dataclass(frozen=True, slots=True)
class ChunkRequest:
    """Asks for chunk ``index`` (from 0) of a leased message's body."""

    VERB: ClassVar[str] = "chunk"

    msg_id: int
    index: int

    def to_wire(self) -> dict[str, object]:
        return {"msg_id": self.msg_id, "index": self.index}

    @classmethod
    def from_wire(cls, body: _Body, where: str = VERB) -> ChunkRequest:
        return cls(
            msg_id=_int(body, "msg_id", where, minimum=0),
            index=_int(body, "index", where, minimum=0),
        )


class Outcome(enum.StrEnum):
    DELIVERED = "delivered"  # 2xx after the final dot
    DEFERRED = "deferred"  # temporary failure; the core schedules another attempt
    BOUNCED = "bounced"  # permanent failure; the core writes the DSN
    RETURNED = "returned"  # given back untried (shutdown, zone paused): not an attempt


@dataclass(frozen=True, slots=True)
class RecipientReport:
    """The result of one attempt for one leased recipient, named by its lease token."""

    token: int
    outcome: Outcome
    reply: str = ""
    code: int | None = None
    enhanced: str | None = None
    mx: str | None = None
    source_ip: str | None = None
    # RFC 1047: the connection was lost after the final dot; see zoneq.protocol.events.
    possible_duplicate: bool = False
    # Delivered, the recipient asked for NOTIFY=SUCCESS, and the server that took it did
    # not offer DSN: the core owes the sender a "relayed" notice (RFC 3461 section 5.2.2).
    # Optional on the wire, sent only when true: absent is false (an older worker), and an
    # older core ignores it (no notice, as before).
    relayed: bool = False
    # The reply is our own (a ``sender:connect`` plugin's refusal or failure), made with no
    # connection: ``mx`` names the host it was about (events, per-MX limits), not one that
    # replied, so a notice names no Remote-MTA (RFC 3464 sections 2.3.5, 2.3.6).  On the
    # wire as ``relayed`` is: only when true.
    local_reply: bool = False

    def to_wire(self) -> dict[str, object]:
        body: dict[str, object] = {
            "token": self.token,
            "outcome": self.outcome.value,
            "reply": self.reply,
            "code": self.code,
            "enhanced": self.enhanced,
            "mx": self.mx,
            "source_ip": self.source_ip,
            "possible_duplicate": self.possible_duplicate,
        }
        if self.relayed:
            body["relayed"] = True
        if self.local_reply:
            body["local_reply"] = True
        return body

    @classmethod
    def from_wire(cls, body: _Body, where: str) -> RecipientReport:
        outcome = _str(body, "outcome", where)
        try:
            parsed = Outcome(outcome)
        except ValueError:
            raise ProtocolError(f"{where}.outcome: unknown outcome {outcome!r}") from None
        return cls(
            token=_int(body, "token", where),
            outcome=parsed,
            reply=_str(body, "reply", where),
            code=_opt_int(body, "code", where),
            enhanced=_opt_str(body, "enhanced", where),
            mx=_opt_str(body, "mx", where),
            source_ip=_opt_str(body, "source_ip", where),
            possible_duplicate=_bool(body, "possible_duplicate", where),
            relayed=_opt_flag(body, "relayed", where),
            local_reply=_opt_flag(body, "local_reply", where),
        )


@dataclass(frozen=True, slots=True)
class Report:
    """Outcomes for leased recipients; the core commits them and ends their leases.

    ``lease_jobs``: once they are committed, lease up to that many jobs of the zone that
    are ready now (no waiting) and send them with the reply; 0 for none.

    ``kept``: the slots (``Job.slot``) of the reported jobs whose connections the worker
    keeps idle for the next job; ``closed``: slots whose idle connections the worker has
    closed, or taken up for a job on another slot, since its last report.  ``results``
    may be empty: a worker that closed idle connections says so at once.

    ``dead_hosts``: how many MX addresses the worker's dead-host cache rests now; None when
    the report does not say (the core keeps the last value it was told).
    """

    VERB: ClassVar[str] = "report"

    results: tuple[RecipientReport, ...]
    lease_jobs: int = 0
    kept: tuple[int, ...] = ()
    closed: tuple[int, ...] = ()
    dead_hosts: int | None = None

    def to_wire(self) -> dict[str, object]:
        body: dict[str, object] = {
            "results": [result.to_wire() for result in self.results],
            "lease_jobs": self.lease_jobs,
        }
        _put_ints(body, "kept", self.kept)
        _put_ints(body, "closed", self.closed)
        if self.dead_hosts is not None:
            body["dead_hosts"] = self.dead_hosts
        return body

    @classmethod
    def from_wire(cls, body: _Body, where: str = VERB) -> Report:
        return cls(
            results=_nested(body, "results", where, RecipientReport.from_wire),
            lease_jobs=_opt_count(body, "lease_jobs", where),
            kept=_opt_int_tuple(body, "kept", where),
            closed=_opt_int_tuple(body, "closed", where),
            dead_hosts=_opt_gauge(body, "dead_hosts", where),
        )


# ---------------------------------------------------------------------------------------
# Replies


@dataclass(frozen=True, slots=True)
class Welcome:
    VERB: ClassVar[str] = "welcome"

    core_pid: int

    def to_wire(self) -> dict[str, object]:
        return {"core_pid": self.core_pid}

    @classmethod
    def from_wire(cls, body: _Body, where: str = VERB) -> Welcome:
        return cls(core_pid=_int(body, "core_pid", where))


@dataclass(frozen=True, slots=True)
class JobRecipient:
    """One leased recipient.  ``token`` names the lease; a report quotes it."""

    token: int
    address: str
    notify: tuple[str, ...] = ()
    orcpt: str | None = None
    attempts: int = 0

    def to_wire(self) -> dict[str, object]:
        return {
            "token": self.token,
            "address": self.address,
            "notify": list(self.notify),
            "orcpt": self.orcpt,
            "attempts": self.attempts,
        }

    @classmethod
    def from_wire(cls, body: _Body, where: str) -> JobRecipient:
        return cls(
            token=_int(body, "token", where),
            address=_str(body, "address", where),
            notify=_str_tuple(body, "notify", where),
            orcpt=_opt_str(body, "orcpt", where),
            attempts=_int(body, "attempts", where, minimum=0),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class Job:
    """One message for one destination domain, with its leased recipients there.

    The body is fetched chunk by chunk (``ChunkRequest``), ``chunks`` of them, so a worker
    never holds a whole large message; except that a body of one chunk (most mail) comes
    along in ``body``, which saves a round trip per message.
    """

    msg_id: int
    sender: str
    size: int
    chunks: int
    domain: str
    envid: str | None = None
    ret: str | None = None  # RFC 3461 RET: FULL or HDRS
    smtputf8: bool = False
    body_8bit: bool = False
    recipients: tuple[JobRecipient, ...] = ()
    body: bytes | None = None  # the whole body, when it is a single chunk
    # Source addresses resting for this domain after a "blocked" reply (queue/feedback.py):
    # the worker binds another address of the pool.  Optional on the wire: a core that does
    # not send it means none are resting.
    rested: tuple[str, ...] = ()
    # The connection slot the job holds at the core (its domain's and MX host's limits count
    # open connections): a connection kept idle after the job is kept under it, and one the
    # worker keeps under it already is the one to use.  Optional on the wire: 0 (a core
    # that does not send it) means none, and the worker keeps connections as it likes.
    slot: int = 0
    # The recipients expire after this attempt (the core hands the job out at or past the
    # retry schedule's expiry): the worker tries every MX address, resting ones included,
    # since the schedule promises one last attempt at the end of the message's life
    # (``RetrySchedule.next_attempt``) and a bounce must follow a real try.  On the wire
    # only when true, as ``RecipientReport.relayed``: absent is false (a core that does not
    # send it), and a worker that does not know it skips resting addresses, as before.
    last_attempt: bool = False
    # The routing header field that chose the message's zone (``MessageMeta.zone_header``),
    # to be removed from the copy that goes out: the config may name another one by now.
    # On the wire only when known: absent is None, the worker's configured name.
    zone_header: str | None = None

    def to_wire(self) -> dict[str, object]:
        body: dict[str, object] = {
            "slot": self.slot,
            "rested": list(self.rested),
            "body": self.body,
            "msg_id": self.msg_id,
            "sender": self.sender,
            "size": self.size,
            "chunks": self.chunks,
            "domain": self.domain,
            "envid": self.envid,
            "ret": self.ret,
            "smtputf8": self.smtputf8,
            "body_8bit": self.body_8bit,
            "recipients": [recipient.to_wire() for recipient in self.recipients],
        }
        if self.last_attempt:
            body["last_attempt"] = True
        if self.zone_header is not None:
            body["zone_header"] = self.zone_header
        return body

    @classmethod
    def from_wire(cls, body: _Body, where: str) -> Job:
        return cls(
            msg_id=_int(body, "msg_id", where, minimum=0),
            sender=_str(body, "sender", where),
            size=_int(body, "size", where, minimum=0),
            chunks=_int(body, "chunks", where, minimum=0),
            domain=_str(body, "domain", where),
            envid=_opt_str(body, "envid", where),
            ret=_opt_str(body, "ret", where),
            smtputf8=_bool(body, "smtputf8", where),
            body_8bit=_bool(body, "body_8bit", where),
            recipients=_nested(body, "recipients", where, JobRecipient.from_wire),
            body=_opt_bytes(body, "body", where),
            rested=_opt_str_tuple(body, "rested", where),
            slot=_opt_count(body, "slot", where),
            last_attempt=_opt_flag(body, "last_attempt", where),
            zone_header=_added_str(body, "zone_header", where),
        )


@dataclass(frozen=True, slots=True)
class LeaseReply:
    """The jobs leased; and ``close``: slots whose idle connections the worker must close
    now (above a limit), then report ``closed`` (optional on the wire: absent is none)."""

    VERB: ClassVar[str] = "leased"

    jobs: tuple[Job, ...] = ()
    close: tuple[int, ...] = ()

    def to_wire(self) -> dict[str, object]:
        body: dict[str, object] = {"jobs": [job.to_wire() for job in self.jobs]}
        _put_ints(body, "close", self.close)
        return body

    @classmethod
    def from_wire(cls, body: _Body, where: str = VERB) -> LeaseReply:
        return cls(
            jobs=_nested(body, "jobs", where, Job.from_wire),
            close=_opt_int_tuple(body, "close", where),
        )


@dataclass(frozen=True, slots=True)
class ChunkReply:
    VERB: ClassVar[str] = "chunk-data"

    data: bytes

    def to_wire(self) -> dict[str, object]:
        return {"data": self.data}

    @classmethod
    def from_wire(cls, body: _Body, where: str = VERB) -> ChunkReply:
        return cls(data=_bytes(body, "data", where))


@dataclass(frozen=True, slots=True)
class ReportReply:
    """Which reported tokens were committed, and which refused (their lease had ended);
    the jobs leased for the report's ``lease_jobs``; and ``close``, as in ``LeaseReply``
    (a kept connection the core did not let the worker keep is among them)."""

    VERB: ClassVar[str] = "reported"

    accepted: tuple[int, ...] = ()
    refused: tuple[int, ...] = ()
    jobs: tuple[Job, ...] = ()
    close: tuple[int, ...] = ()

    def to_wire(self) -> dict[str, object]:
        body: dict[str, object] = {
            "accepted": list(self.accepted),
            "refused": list(self.refused),
            "jobs": [job.to_wire() for job in self.jobs],
        }
        _put_ints(body, "close", self.close)
        return body

    @classmethod
    def from_wire(cls, body: _Body, where: str = VERB) -> ReportReply:
        jobs = _nested(body, "jobs", where, Job.from_wire) if body.get("jobs") is not None else ()
        return cls(
            accepted=_int_tuple(body, "accepted", where),
            refused=_int_tuple(body, "refused", where),
            jobs=jobs,
            close=_opt_int_tuple(body, "close", where),
        )


# Most specific class first: the first isinstance match gives the kind.  TemporaryFailure
# covers the storage failures too: to a worker they all mean "try again later".
_KIND_OF_ERROR: Final[tuple[tuple[type[ZoneqError], str], ...]] = (
    (ProtocolError, "protocol"),
    (LeaseError, "lease"),
    (NotFound, "not-found"),
    (TemporaryFailure, "temporary"),
    (ZoneqError, "error"),
)
_ERROR_OF_KIND: Final[dict[str, type[ZoneqError]]] = {
    "protocol": ProtocolError,
    "lease": LeaseError,
    "not-found": NotFound,
    "temporary": TemporaryFailure,
    "error": ZoneqError,
    "internal": CoreFailure,
}


@dataclass(frozen=True, slots=True)
class ErrorReply:
    """The request failed.  ``kind`` picks the error the worker raises; ``message`` is for
    people and logs.  Kinds: protocol, lease, not-found, temporary, error (another zoneq
    error), internal (an unexpected exception in the core, raised as ``CoreFailure``).
    """

    VERB: ClassVar[str] = "error"

    kind: str
    message: str

    def to_wire(self) -> dict[str, object]:
        return {"kind": self.kind, "message": self.message}

    @classmethod
    def from_wire(cls, body: _Body, where: str = VERB) -> ErrorReply:
        return cls(kind=_str(body, "kind", where), message=_str(body, "message", where))

    @classmethod
    def from_exception(cls, exc: BaseException) -> ErrorReply:
        for error_type, kind in _KIND_OF_ERROR:
            if isinstance(exc, error_type):
                return cls(kind=kind, message=str(exc) or type(exc).__name__)
        # Not one of ours: the details belong in the core's log, not on the wire.
        return cls(kind="internal", message=f"internal error ({type(exc).__name__})")

    def to_exception(self) -> ZoneqError:
        # A kind from a newer core that this worker does not know is still a zoneq error.
        error_type = _ERROR_OF_KIND.get(self.kind, ZoneqError)
        return error_type(self.message)


# ---------------------------------------------------------------------------------------
# Envelopes

Request = Hello | LeaseRequest | ChunkRequest | Report
Reply = Welcome | LeaseReply | ChunkReply | ReportReply | ErrorReply

_REQUESTS: Final[dict[str, Callable[[_Body], Request]]] = {
    cls.VERB: cls.from_wire for cls in (Hello, LeaseRequest, ChunkRequest, Report)
}
_REPLIES: Final[dict[str, Callable[[_Body], Reply]]] = {
    cls.VERB: cls.from_wire for cls in (Welcome, LeaseReply, ChunkReply, ReportReply, ErrorReply)
}
_REPLY_TYPE: Final[dict[type[Request], type[Reply]]] = {
    Hello: Welcome,
    LeaseRequest: LeaseReply,
    ChunkRequest: ChunkReply,
    Report: ReportReply,
}


def reply_type_for(request: Request) -> type[Reply]:
    """The reply class that answers ``request`` when it succeeds."""
    return _REPLY_TYPE[type(request)]


@dataclass(frozen=True, slots=True)
class Envelope:
    """A checked envelope whose body is not decoded yet (its ``id`` is known even if the
    body turns out to be bad, so the error can be answered to the right request)."""

    id: int
    verb: str
    body: _Body


def seal(req_id: int, message: Request | Reply) -> dict[str, object]:
    """The wire form of ``message`` as request or reply number ``req_id``."""
    return {"id": req_id, "verb": message.VERB, "body": message.to_wire()}


def open_envelope(obj: object) -> Envelope:
    envelope = _map(obj, "envelope")
    return Envelope(
        id=_int(envelope, "id", "envelope", minimum=0),
        verb=_str(envelope, "verb", "envelope"),
        body=_map(_get(envelope, "body", "envelope"), "envelope.body"),
    )


def decode_request(envelope: Envelope) -> Request:
    decode = _REQUESTS.get(envelope.verb)
    if decode is None:
        raise ProtocolError(f"envelope.verb: unknown request {envelope.verb!r}")
    return decode(envelope.body)


def decode_reply(envelope: Envelope) -> Reply:
    decode = _REPLIES.get(envelope.verb)
    if decode is None:
        raise ProtocolError(f"envelope.verb: unknown reply {envelope.verb!r}")
    return decode(envelope.body)
