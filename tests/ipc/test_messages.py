"""Messages: every verb round-trips through its wire form and a real frame; decoding refuses
bad input with a ProtocolError naming the field; errors map to kinds and back."""

from __future__ import annotations

import contextlib
import re
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zoneq.errors import (
    DiskFull,
    LeaseError,
    NotFound,
    ProtocolError,
    StorageCorruption,
    TemporaryFailure,
    ZoneqError,
)
from zoneq.ipc.framing import FrameDecoder, encode_frame
from zoneq.ipc.messages import (
    PROTOCOL_VERSION,
    ChunkReply,
    ChunkRequest,
    CoreFailure,
    ErrorReply,
    Hello,
    Job,
    JobRecipient,
    LeaseReply,
    LeaseRequest,
    Outcome,
    RecipientReport,
    Reply,
    Report,
    ReportReply,
    Request,
    Welcome,
    decode_reply,
    decode_request,
    open_envelope,
    reply_type_for,
    seal,
)

u64 = st.integers(min_value=0, max_value=2**64 - 1)
i64 = st.integers(min_value=-(2**63), max_value=2**63 - 1)
text = st.text()
opt_text = st.none() | text
# Addresses with non-ASCII local parts and domains (SMTPUTF8).
addresses = st.builds(lambda local, domain: f"{local}@{domain}", st.text(min_size=1), text)

recipients = st.builds(
    JobRecipient,
    token=u64,
    address=addresses,
    notify=st.lists(st.sampled_from(["SUCCESS", "FAILURE", "DELAY", "NEVER"])).map(tuple),
    orcpt=opt_text,
    attempts=st.integers(min_value=0, max_value=2**32),
)
jobs = st.builds(
    Job,
    msg_id=u64,
    sender=st.just("") | addresses,
    size=u64,
    chunks=st.integers(min_value=0, max_value=10_000),
    domain=text,
    envid=opt_text,
    ret=st.none() | st.sampled_from(["FULL", "HDRS"]),
    smtputf8=st.booleans(),
    body_8bit=st.booleans(),
    recipients=st.lists(recipients, max_size=4).map(tuple),
    rested=st.lists(text, max_size=3).map(tuple),
    slot=st.integers(0, 2**63),
)
slot_ids = st.lists(st.integers(0, 2**63), max_size=4).map(tuple)
reports = st.builds(
    RecipientReport,
    token=u64,
    outcome=st.sampled_from(Outcome),
    reply=text,
    code=st.none() | i64,
    enhanced=opt_text,
    mx=opt_text,
    source_ip=opt_text,
    possible_duplicate=st.booleans(),
    relayed=st.booleans(),
    local_reply=st.booleans(),
)
requests: st.SearchStrategy[Request] = st.one_of(
    st.builds(Hello, zone=text, worker=text, pid=i64),
    st.builds(LeaseRequest, max_jobs=st.integers(1, 2**32), wait_ms=st.integers(0, 2**32)),
    st.builds(ChunkRequest, msg_id=u64, index=u64),
    st.builds(
        Report,
        results=st.lists(reports, max_size=5).map(tuple),
        lease_jobs=st.integers(0, 2**32),
        kept=slot_ids,
        closed=slot_ids,
        dead_hosts=st.none() | st.integers(0, 2**63),
    ),
)
replies: st.SearchStrategy[Reply] = st.one_of(
    st.builds(Welcome, core_pid=i64),
    st.builds(LeaseReply, jobs=st.lists(jobs, max_size=3).map(tuple), close=slot_ids),
    st.builds(ChunkReply, data=st.binary(max_size=4096)),
    st.builds(
        ReportReply,
        accepted=st.lists(u64).map(tuple),
        refused=st.lists(u64).map(tuple),
        jobs=st.lists(jobs, max_size=2).map(tuple),
        close=slot_ids,
    ),
    st.builds(ErrorReply, kind=text, message=text),
)


def through_a_frame(obj: dict[str, object]) -> object:
    (decoded,) = FrameDecoder().feed(encode_frame(obj))
    return decoded


@given(req_id=u64, msg=requests)
def test_requests_round_trip(req_id: int, msg: Request) -> None:
    envelope = open_envelope(through_a_frame(seal(req_id, msg)))
    assert envelope.id == req_id
    assert decode_request(envelope) == msg


@given(req_id=u64, msg=replies)
def test_replies_round_trip(req_id: int, msg: Reply) -> None:
    envelope = open_envelope(through_a_frame(seal(req_id, msg)))
    assert envelope.id == req_id
    decoded = decode_reply(envelope)
    assert decoded == msg
    assert hash(decoded) == hash(msg)  # tuples, not lists: immutable all the way down


def sample_job() -> Job:
    return Job(
        msg_id=7,
        sender="s\u00e9nder@exampl\u00e9.org",
        size=1234,
        chunks=2,
        domain="example.net",
        smtputf8=True,
        recipients=(JobRecipient(token=99, address="r@example.net", notify=("FAILURE",)),),
    )


def test_table_of_wire_forms() -> None:
    assert seal(3, Hello(zone="bulk", worker="w1", pid=42)) == {
        "id": 3,
        "verb": "hello",
        "body": {"version": PROTOCOL_VERSION, "zone": "bulk", "worker": "w1", "pid": 42},
    }
    assert seal(4, LeaseRequest()) == {
        "id": 4,
        "verb": "lease",
        "body": {"max_jobs": 1, "wait_ms": 0},
    }
    assert seal(5, ChunkReply(data=b"\r\n.\r\n"))["body"] == {"data": b"\r\n.\r\n"}
    wire = seal(6, LeaseReply(jobs=(sample_job(),)))["body"]
    assert wire["jobs"][0]["recipients"][0] == {  # type: ignore[index]
        "token": 99,
        "address": "r@example.net",
        "notify": ["FAILURE"],
        "orcpt": None,
        "attempts": 0,
    }
    report = RecipientReport(token=1, outcome=Outcome.RETURNED)
    assert report.to_wire()["outcome"] == "returned"


@pytest.mark.parametrize(
    ("request_", "reply"),
    [
        (Hello(zone="z", worker="w", pid=1), Welcome),
        (LeaseRequest(), LeaseReply),
        (ChunkRequest(msg_id=1, index=0), ChunkReply),
        (Report(results=()), ReportReply),
    ],
)
def test_reply_type_for(request_: Request, reply: type[Reply]) -> None:
    assert reply_type_for(request_) is reply


def lease_body() -> dict[str, Any]:
    return seal(1, LeaseReply(jobs=(sample_job(),)))["body"]  # type: ignore[return-value]


def envelope_of(verb: object, body: object, req_id: object = 1) -> object:
    return {"id": req_id, "verb": verb, "body": body}


@pytest.mark.parametrize(
    ("obj", "field"),
    [
        ([1, 2], "envelope"),
        ({"verb": "lease", "body": {}}, "envelope.id"),
        (envelope_of("lease", {}, req_id="1"), "envelope.id"),
        (envelope_of("lease", {}, req_id=-1), "envelope.id"),
        (envelope_of(7, {}), "envelope.verb"),
        (envelope_of("lease", [1]), "envelope.body"),
    ],
)
def test_bad_envelopes_name_the_field(obj: object, field: str) -> None:
    with pytest.raises(ProtocolError, match=f"^{field}"):
        open_envelope(obj)


@pytest.mark.parametrize(
    ("verb", "body", "field"),
    [
        ("hello", {"version": 1, "zone": "z", "worker": "w"}, "hello.pid: missing"),
        (
            "hello",
            {"version": 1, "zone": b"z", "worker": "w", "pid": 1},
            "hello.zone: expected str",
        ),
        ("hello", {"zone": "z", "worker": "w", "pid": 1}, "hello.version: missing"),
        ("lease", {"max_jobs": True, "wait_ms": 0}, "lease.max_jobs: expected int"),
        ("lease", {"max_jobs": 0, "wait_ms": 0}, "lease.max_jobs: must be at least 1"),
        ("lease", {"max_jobs": 1, "wait_ms": -5}, "lease.wait_ms: must be at least 0"),
        ("chunk", {"msg_id": 1, "index": 1.0}, "chunk.index: expected int"),
        ("report", {"results": {}}, "report.results: expected array"),
        ("report", {"results": [1]}, r"report.results\[0\]: expected map"),
        ("report", {"results": [], "lease_jobs": -1}, "report.lease_jobs: must be at least 0"),
        ("report", {"results": [], "lease_jobs": "1"}, "report.lease_jobs: expected int"),
        (
            "report",
            {"results": [{"token": 1, "outcome": "lost"}]},
            r"report.results\[0\].outcome: unknown outcome",
        ),
        ("nonsense", {}, "envelope.verb: unknown request"),
    ],
)
def test_bad_requests_name_the_field(verb: str, body: object, field: str) -> None:
    with pytest.raises(ProtocolError, match=f"^{field}"):
        decode_request(open_envelope(envelope_of(verb, body)))


def test_nested_reply_fields_are_named() -> None:
    body = lease_body()
    body["jobs"][0]["recipients"][0]["notify"] = ["FAILURE", 3]
    with pytest.raises(ProtocolError, match=r"^leased.jobs\[0\].recipients\[0\].notify\[1\]"):
        decode_reply(open_envelope(envelope_of("leased", body)))
    body = lease_body()
    del body["jobs"][0]["smtputf8"]
    with pytest.raises(ProtocolError, match=r"^leased.jobs\[0\].smtputf8: missing"):
        decode_reply(open_envelope(envelope_of("leased", body)))
    with pytest.raises(ProtocolError, match=r"^chunk-data.data: expected bytes"):
        decode_reply(open_envelope(envelope_of("chunk-data", {"data": "text"})))
    with pytest.raises(ProtocolError, match=r"^reported.refused\[0\]: expected int"):
        decode_reply(open_envelope(envelope_of("reported", {"accepted": [], "refused": [None]})))
    reported = {"accepted": [], "refused": [], "jobs": [{"msg_id": 1}]}
    with pytest.raises(ProtocolError, match=r"^reported.jobs\[0\].sender: missing"):
        decode_reply(open_envelope(envelope_of("reported", reported)))
    with pytest.raises(ProtocolError, match="unknown reply"):
        decode_reply(open_envelope(envelope_of("lease", {})))


def test_unknown_extra_fields_are_ignored() -> None:
    body = {"max_jobs": 2, "wait_ms": 5, "priority": "high"}
    assert decode_request(open_envelope(envelope_of("lease", body))) == LeaseRequest(2, 5)


def test_other_hello_version_refused_before_other_fields() -> None:
    with pytest.raises(ProtocolError, match="version 2 is not supported"):
        decode_request(open_envelope(envelope_of("hello", {"version": 2})))


@given(body=st.dictionaries(st.text(max_size=12), st.none() | st.integers() | st.text()))
def test_arbitrary_bodies_raise_only_protocol_errors(body: dict[str, object]) -> None:
    for verb in ("hello", "lease", "chunk", "report"):
        with contextlib.suppress(ProtocolError):
            decode_request(open_envelope(envelope_of(verb, body)))
    for verb in ("welcome", "leased", "chunk-data", "reported", "error"):
        with contextlib.suppress(ProtocolError):
            decode_reply(open_envelope(envelope_of(verb, body)))


@pytest.mark.parametrize(
    ("exc", "kind", "raised"),
    [
        (ProtocolError("bad"), "protocol", ProtocolError),
        (LeaseError("stale"), "lease", LeaseError),
        (NotFound("gone"), "not-found", NotFound),
        (TemporaryFailure("later"), "temporary", TemporaryFailure),
        (DiskFull("full"), "temporary", TemporaryFailure),
        (StorageCorruption(b"k", "bad"), "error", ZoneqError),
        (RuntimeError("secret detail"), "internal", CoreFailure),
    ],
)
def test_errors_map_to_kinds_and_back(
    exc: BaseException, kind: str, raised: type[ZoneqError]
) -> None:
    reply = ErrorReply.from_exception(exc)
    assert reply.kind == kind
    back = reply.to_exception()
    assert type(back) is raised
    if kind == "internal":
        # Details of an unexpected failure stay in the core's log.
        assert "secret" not in reply.message
        assert isinstance(back, TemporaryFailure)
    else:
        assert str(back) == str(exc)


def test_unknown_error_kind_is_still_a_zoneq_error() -> None:
    assert type(ErrorReply("from-the-future", "x").to_exception()) is ZoneqError


def test_a_job_carries_an_inline_body_or_none() -> None:
    from zoneq.ipc.messages import Job

    with_body = Job(msg_id=1, sender="", size=3, chunks=1, domain="d", body=b"abc")
    assert Job.from_wire(with_body.to_wire(), "job") == with_body
    without = Job(msg_id=1, sender="", size=3, chunks=2, domain="d")
    wire = without.to_wire()
    assert Job.from_wire(wire, "job").body is None
    del wire["body"]  # an older core does not send it
    assert Job.from_wire(wire, "job").body is None
    wire["body"] = "not bytes"
    with pytest.raises(ProtocolError, match=r"job\.body"):
        Job.from_wire(wire, "job")


def test_a_job_names_the_source_addresses_resting_for_its_domain() -> None:
    from zoneq.ipc.messages import Job

    job = Job(msg_id=1, sender="", size=3, chunks=1, domain="d", rested=("192.0.2.1",))
    wire = job.to_wire()
    assert wire["rested"] == ["192.0.2.1"]
    assert Job.from_wire(wire, "job") == job
    del wire["rested"]  # a core of the previous release: none resting
    assert Job.from_wire(wire, "job").rested == ()
    wire["rested"] = None
    assert Job.from_wire(wire, "job").rested == ()
    wire["rested"] = [1]
    with pytest.raises(ProtocolError, match=r"job\.rested\[0\]: expected str"):
        Job.from_wire(wire, "job")


@pytest.mark.parametrize(
    ("verb", "body", "decoded"),
    [
        # A worker of the previous release: a report that does not ask for the next job.
        ("report", {"results": []}, Report(results=())),
        ("report", {"results": [], "lease_jobs": None}, Report(results=())),
        ("report", {"results": [], "lease_jobs": 1}, Report(results=(), lease_jobs=1)),
    ],
)
def test_report_asks_for_the_next_job_only_when_it_says_so(
    verb: str, body: object, decoded: Request
) -> None:
    assert decode_request(open_envelope(envelope_of(verb, body))) == decoded


@pytest.mark.parametrize(
    ("body", "decoded"),
    [
        # A core of the previous release answers without jobs: "no job ready".
        ({"accepted": [1], "refused": []}, ReportReply(accepted=(1,))),
        ({"accepted": [], "refused": [2], "jobs": None}, ReportReply(refused=(2,))),
        ({"accepted": [], "refused": [], "jobs": []}, ReportReply()),
    ],
)
def test_report_reply_without_jobs_means_none_ready(body: object, decoded: Reply) -> None:
    assert decode_reply(open_envelope(envelope_of("reported", body))) == decoded


def test_report_reply_carries_jobs_in_the_lease_reply_form() -> None:
    job = sample_job()
    wire = seal(8, ReportReply(accepted=(1,), jobs=(job,)))["body"]
    assert wire == {"accepted": [1], "refused": [], "jobs": [job.to_wire()]}
    assert seal(9, Report(results=(), lease_jobs=1))["body"] == {"results": [], "lease_jobs": 1}


# --- connection slots (issue 5): optional both ways ----------------------------------------

SLOTTED_JOB = Job(msg_id=1, sender="", size=3, chunks=1, domain="d").to_wire()
del SLOTTED_JOB["slot"]  # as a core of the previous release sends it


@pytest.mark.parametrize(
    ("verb", "body", "decoded"),
    [
        # A worker of the previous release keeps nothing under a slot and closes nothing.
        ("report", {"results": []}, Report(results=())),
        ("report", {"results": [], "kept": None, "closed": None}, Report(results=())),
        ("report", {"results": [], "kept": [4]}, Report(results=(), kept=(4,))),
        ("report", {"results": [], "closed": [5, 6]}, Report(results=(), closed=(5, 6))),
    ],
)
def test_report_names_kept_and_closed_slots_only_when_it_has_any(
    verb: str, body: object, decoded: Request
) -> None:
    assert decode_request(open_envelope(envelope_of(verb, body))) == decoded


@pytest.mark.parametrize(
    ("verb", "body", "decoded"),
    [
        # A core of the previous release asks for nothing to be closed.
        ("leased", {"jobs": []}, LeaseReply()),
        ("leased", {"jobs": [], "close": [3]}, LeaseReply(close=(3,))),
        ("reported", {"accepted": [], "refused": []}, ReportReply()),
        ("reported", {"accepted": [], "refused": [], "close": [3]}, ReportReply(close=(3,))),
    ],
)
def test_replies_ask_to_close_slots_only_when_they_say_so(
    verb: str, body: object, decoded: Reply
) -> None:
    assert decode_reply(open_envelope(envelope_of(verb, body))) == decoded


def test_empty_slot_lists_stay_off_the_wire_and_a_job_without_slot_has_none() -> None:
    assert seal(1, Report(results=()))["body"] == {"results": [], "lease_jobs": 0}
    assert seal(2, Report(results=(), kept=(1,), closed=(2,)))["body"] == {
        "results": [],
        "lease_jobs": 0,
        "kept": [1],
        "closed": [2],
    }
    assert seal(3, LeaseReply())["body"] == {"jobs": []}
    assert Job.from_wire(dict(SLOTTED_JOB), "job").slot == 0  # a core of the previous release
    assert Job.from_wire({**SLOTTED_JOB, "slot": 9}, "job").slot == 9


@pytest.mark.parametrize(
    ("verb", "body", "field"),
    [
        ("report", {"results": [], "kept": [True]}, "report.kept[0]: expected int"),
        ("report", {"results": [], "closed": "1"}, "report.closed: expected array"),
    ],
)
def test_bad_slot_lists_name_the_field(verb: str, body: object, field: str) -> None:
    with pytest.raises(ProtocolError, match=re.escape(field)):
        decode_request(open_envelope(envelope_of(verb, body)))


def test_a_bad_slot_names_the_field() -> None:
    with pytest.raises(ProtocolError, match=r"job\.slot: must be at least 0"):
        Job.from_wire({**SLOTTED_JOB, "slot": -1}, "job")
    with pytest.raises(ProtocolError, match=r"leased\.close: expected array"):
        decode_reply(open_envelope(envelope_of("leased", {"jobs": [], "close": 3})))


# --- the worker's count of dead MX addresses (issue 7): optional both ways ----------------


@pytest.mark.parametrize(
    ("body", "decoded"),
    [
        # A worker of the previous release says nothing: the core keeps what it knew.
        ({"results": []}, Report(results=())),
        ({"results": [], "dead_hosts": None}, Report(results=())),
        ({"results": [], "dead_hosts": 0}, Report(results=(), dead_hosts=0)),
        ({"results": [], "dead_hosts": 3}, Report(results=(), dead_hosts=3)),
        ({"results": [], "closed": [5], "dead_hosts": 1}, Report((), closed=(5,), dead_hosts=1)),
    ],
)
def test_report_tells_the_dead_host_count_only_when_it_says_so(
    body: object, decoded: Request
) -> None:
    assert decode_request(open_envelope(envelope_of("report", body))) == decoded


@pytest.mark.parametrize(
    ("report", "wire"),
    [
        (Report(results=()), {"results": [], "lease_jobs": 0}),
        # 0 is said: "none now" is news to a core that was told 2 before.
        (Report(results=(), dead_hosts=0), {"results": [], "lease_jobs": 0, "dead_hosts": 0}),
        (Report(results=(), dead_hosts=2), {"results": [], "lease_jobs": 0, "dead_hosts": 2}),
    ],
)
def test_an_unsaid_dead_host_count_stays_off_the_wire(
    report: Report, wire: dict[str, object]
) -> None:
    assert seal(1, report)["body"] == wire


@pytest.mark.parametrize(
    ("value", "says"),
    [
        (-1, "report.dead_hosts: must be at least 0, got -1"),
        (True, "report.dead_hosts: expected int, got bool"),
        ("2", "report.dead_hosts: expected int, got str"),
        (1.0, "report.dead_hosts: expected int, got float"),
    ],
)
def test_a_bad_dead_host_count_names_the_field(value: object, says: str) -> None:
    body = {"results": [], "dead_hosts": value}
    with pytest.raises(ProtocolError, match=re.escape(says)):
        decode_request(open_envelope(envelope_of("report", body)))


REPORTED = {
    "token": 7,
    "outcome": "delivered",
    "reply": "250 Ok",
    "code": 250,
    "enhanced": None,
    "mx": "mx.example.net",
    "source_ip": None,
    "possible_duplicate": False,
}


# The optional flags of a report: ``relayed`` (RFC 3461 section 5.2.2) and ``local_reply``
# (a plugin's own reply, RFC 3464 section 2.3.5).
FLAGS = pytest.mark.parametrize("flag", ["relayed", "local_reply"])


@FLAGS
@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (..., False),  # a worker of the previous release sends no flag
        (None, False),
        (False, False),
        (True, True),
    ],
)
def test_a_report_flag_is_set_only_when_sent_true(flag: str, value: object, expected: bool) -> None:
    wire = REPORTED if value is ... else {**REPORTED, flag: value}
    assert getattr(RecipientReport.from_wire(wire, "r"), flag) is expected


@FLAGS
def test_a_report_flag_stays_off_the_wire_unless_true(flag: str) -> None:
    """The flags cost a bulk sender's reports nothing."""
    plain = RecipientReport(token=7, outcome=Outcome.DELIVERED, reply="250 Ok", code=250)
    assert flag not in plain.to_wire()
    flagged = RecipientReport.from_wire({**REPORTED, flag: True}, "r")
    assert flagged.to_wire()[flag] is True


@FLAGS
def test_a_report_flag_that_is_not_a_bool_names_the_field(flag: str) -> None:
    with pytest.raises(ProtocolError, match=re.escape(f"r.{flag}: expected bool")):
        RecipientReport.from_wire({**REPORTED, flag: 1}, "r")
