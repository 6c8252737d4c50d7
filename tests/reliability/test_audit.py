"""The fault suite's bookkeeping (``tests/support/ledger.py``) on made-up runs.

The fault tests trust :func:`audit` to tell an explained extra copy from an unexplained one,
a 4xx-refused message that landed under way at a kill from one that landed with no excuse,
and a DSN where the remote refuses from one where it accepts everything; so it is checked
here on ledgers and sink contents written by hand.  And they trust the client to note every
refusal, the greeting's included: it is checked against the transport tests' fault server.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.storage.conftest import async_test
from tests.support.faultserver import Faults, FaultServer
from tests.support.ledger import (
    SENDER,
    Copy,
    Dumps,
    Extra,
    Kill,
    Ledger,
    Load,
    audit,
    logged_duplicates,
    queue_id_of,
    reported,
    send_until_cut,
)
from zoneq.protocol.ids import format_id
from zoneq.receiver.message import received_header

A, B = "<a@src.test>", "<b@src.test>"
R1, R2 = "r1@ok.test", "r2@ok.test"
X1 = "x1@bad.test"  # bad.test's MX refuses: its recipients are bounced
QUEUE_IDS = {A: format_id(0xAA), B: format_id(0xBB)}  # as zoneq's Received field names them
DSN_QUEUE_ID = format_id(0xDD)


def sink(*copies: tuple[str, list[str]], dsns: tuple[tuple[str, str], ...] = ()) -> Dumps:
    """The sink after ``copies`` (Message-ID, recipients) and a DSN for each of ``dsns``."""
    dumps = Dumps()
    for n, (message_id, recipients) in enumerate(copies):
        copy = Copy(message_id, recipients, "digest", [], QUEUE_IDS.get(message_id, ""))
        dumps.copies[f"msg.{n}"] = copy
    for n, pair in enumerate(dsns):
        dumps.copies[f"dsn.{n}"] = Copy(f"<dsn-{n}@zoneq>", [SENDER], "", [pair])
    return dumps


def ledger(
    kills: list[Kill] | None = None, refused: tuple[str, ...] = (), to: tuple[str, ...] = (R1, R2)
) -> Ledger:
    book = Ledger(kills=kills or [])
    book.acknowledged = {A: list(to)}
    book.refused = {m: [R1] for m in refused}
    book.digests = {A: "digest", B: "digest"}
    return book


@pytest.mark.parametrize(
    ("case", "book", "dumps", "unexplained", "refused_delivered"),
    [
        ("one copy each", ledger(), sink((A, [R1, R2])), {}, []),
        ("extra copy, no kill", ledger(), sink((A, [R1, R2]), (A, [R1])), {Extra(A, R1): 1}, []),
        (
            "extra copy in flight at a kill",
            ledger([Kill({}, set(), delivering={(A, R1)})]),
            sink((A, [R1, R2]), (A, [R1])),
            {},
            [],
        ),
        (
            "one kill explains one extra copy, not two",
            ledger([Kill({}, set(), delivering={(A, R1)})]),
            sink((A, [R1, R2]), (A, [R1]), (A, [R1])),
            {Extra(A, R1): 1},
            [],
        ),
        (
            "a kill explains only the pair it caught",
            ledger([Kill({}, set(), delivering={(A, R2)})]),
            sink((A, [R1, R2]), (A, [R1])),
            {Extra(A, R1): 1},
            [],
        ),
        (
            "extra DSN, in flight at a kill",
            ledger([Kill({}, set(), bouncing={(A, X1)})], to=(R1, X1)),
            sink((A, [R1]), dsns=((A, X1), (A, X1))),
            {},
            [],
        ),
        (
            "extra DSN, no kill",
            ledger(to=(R1, X1)),
            sink((A, [R1]), dsns=((A, X1), (A, X1))),
            {Extra(A, X1, dsn=True): 1},
            [],
        ),
        ("refused, then delivered", ledger(refused=(B,)), sink((A, [R1, R2]), (B, [R1])), {}, [B]),
        (
            "refused under way at a kill, then delivered",
            ledger([Kill({B: [R1]}, {B})], refused=(B,)),
            sink((A, [R1, R2]), (B, [R1])),
            {},
            [],
        ),
        ("refused, not delivered", ledger(refused=(B,)), sink((A, [R1, R2])), {}, []),
    ],
)
def test_audit_explains_extra_copies_only_by_a_kill(
    case: str,
    book: Ledger,
    dumps: Dumps,
    unexplained: dict[Extra, int],
    refused_delivered: list[str],
) -> None:
    result = audit(book, dumps, may_bounce=("bad.test",))
    assert result.unexplained_duplicates(Counter()) == unexplained, case
    assert result.refused_delivered == refused_delivered, case
    assert bool(result.problems()) == bool(refused_delivered), case


def test_a_logged_possible_duplicate_explains_one_extra_copy() -> None:
    result = audit(ledger(), sink((A, [R1, R2]), (A, [R1]), (A, [R1])))
    assert result.unexplained_duplicates(Counter({(QUEUE_IDS[A], R1): 1})) == {Extra(A, R1): 1}
    assert result.unexplained_duplicates(Counter({(QUEUE_IDS[A], R1): 2})) == {}


# The core's two log lines for RFC 1047's window (zoneq/queue/service.py).
FINAL_DOT = "possible duplicate: {} to {} via 127.0.0.9 (timeout); retried later"
WORKER_GONE = "possible duplicate: {} to {} via ? (worker w1 went away with it in hand); sent again"


@pytest.mark.parametrize(
    ("case", "logged_for", "unexplained"),
    [
        ("logged for the message copied twice", (B, R1), {}),
        ("logged for another message to the same address", (A, R1), {Extra(B, R1): 1}),
        ("logged for the message, to another address", (B, R2), {Extra(B, R1): 1}),
        ("logged for a message no copy names", ("<c@src.test>", R1), {Extra(B, R1): 1}),
    ],
)
@pytest.mark.parametrize("line", [FINAL_DOT, WORKER_GONE], ids=["final dot", "worker gone"])
def test_a_logged_duplicate_explains_only_its_own_message_and_recipient(
    tmp_path: Path,
    case: str,
    logged_for: tuple[str, str],
    unexplained: dict[Extra, int],
    line: str,
) -> None:
    book = ledger(to=(R1,))
    book.acknowledged[B] = [R1]
    message_id, recipient = logged_for
    log = tmp_path / "serve.log"
    queue_id = QUEUE_IDS.get(message_id, format_id(0xCC))
    log.write_text(f"07:00:00 zoneq.queue WARNING {line.format(queue_id, recipient)}\n")
    result = audit(book, sink((A, [R1]), (B, [R1]), (B, [R1])))
    assert result.unexplained_duplicates(logged_duplicates([log])) == unexplained, case


@pytest.mark.parametrize(
    ("case", "queue_ids", "unexplained"),
    [
        (
            "the DSN's queue id known from a queue read at a kill",
            {DSN_QUEUE_ID: "<dsn-0@zoneq>"},
            {},
        ),
        ("the DSN's queue id never learnt", {}, {Extra(A, X1, dsn=True): 1}),
        (
            "the queue id is another DSN's",
            {DSN_QUEUE_ID: "<dsn-9@zoneq>"},
            {Extra(A, X1, dsn=True): 1},
        ),
    ],
)
def test_a_logged_duplicate_of_a_dsn_explains_an_extra_report_of_its_pairs(
    case: str, queue_ids: dict[str, str], unexplained: dict[Extra, int]
) -> None:
    # The kill caught nothing in flight; it only read the queue (and learnt its ids).
    book = ledger([Kill({}, set(), queue_ids=queue_ids)], to=(R1, X1))
    dumps = sink((A, [R1]), dsns=((A, X1),))
    dumps.copies["dsn.again"] = dumps.copies["dsn.0"]  # the same DSN delivered twice
    result = audit(book, dumps, may_bounce=("bad.test",))
    logged = Counter({(DSN_QUEUE_ID, SENDER): 1})
    assert result.unexplained_duplicates(logged) == unexplained, case


Y1 = "y1@worse.test"  # worse.test's MX refuses too
DX, DY = "<dsn-x@zoneq>", "<dsn-y@zoneq>"  # the DSNs reporting (A, X1) and (A, Y1)
DSN_IDS = {DX: format_id(0xD0), DY: format_id(0xD1)}


@pytest.mark.parametrize(
    ("case", "delivered", "logged_for", "unexplained"),
    [
        ("the other DSN's logged", [DX, DY, DY], [DX], {Extra(A, Y1, dsn=True): 1}),
        ("its own logged", [DX, DY, DY], [DY], {}),
        ("both twice, one logged", [DX, DY, DX, DY], [DY], {Extra(A, X1, dsn=True): 1}),
        ("both twice, both logged", [DX, DY, DX, DY], [DX, DY], {}),
    ],
)
def test_a_logged_duplicate_of_one_dsn_does_not_explain_another_dsn_of_the_message(
    case: str, delivered: list[str], logged_for: list[str], unexplained: dict[Extra, int]
) -> None:
    """A message to two domains that refuse gets a DSN for each (zoneq/queue/bounces.py:
    one per message and destination domain); the possible duplicate logged for one of them
    explains an extra copy of that DSN only."""
    reports = {DX: (A, X1), DY: (A, Y1)}
    queue_ids = {queue_id: dsn for dsn, queue_id in DSN_IDS.items()}
    book = ledger([Kill({}, set(), queue_ids=queue_ids)], to=(X1, Y1))
    dumps = Dumps()
    for n, dsn in enumerate(delivered):
        dumps.copies[f"dsn.{n}"] = Copy(dsn, [SENDER], "", [reports[dsn]])
    result = audit(book, dumps, may_bounce=("bad.test", "worse.test"))
    logged = Counter({(DSN_IDS[dsn], SENDER): 1 for dsn in logged_for})
    assert result.unexplained_duplicates(logged) == unexplained, case
    assert not result.problems(), case


@pytest.mark.parametrize(
    ("may_bounce", "copies", "dsns", "wrongly", "both"),
    [
        pytest.param(("bad.test",), [(A, [R1])], [(A, X1)], [], [], id="where the MX refuses"),
        pytest.param(
            ("bad.test",), [(A, [R1])], [(A, R2)], [(A, R2)], [], id="where the MX accepts all"
        ),
        pytest.param((), [(A, [R1])], [(A, X1)], [(A, X1)], [], id="no domain may bounce"),
        pytest.param(
            ("ok.test",), [(A, [R1, R2])], [(A, R2)], [], [(A, R2)], id="delivered and bounced"
        ),
        pytest.param((), [(A, [R1, R2])], [], [], [], id="delivered, no bounce"),
    ],
)
def test_a_dsn_is_an_outcome_only_where_the_remote_refuses(
    may_bounce: Collection[str],
    copies: list[tuple[str, list[str]]],
    dsns: list[tuple[str, str]],
    wrongly: list[tuple[str, str]],
    both: list[tuple[str, str]],
) -> None:
    book = ledger(to=(R1, dsns[0][1]) if dsns else (R1, R2))
    result = audit(book, sink(*copies, dsns=tuple(dsns)), may_bounce=may_bounce)
    assert result.bounced_wrongly == wrongly
    assert result.delivered_and_bounced == both
    assert not result.missing
    assert bool(result.problems()) == bool(wrongly or both)


@given(copies=st.lists(st.integers(1, 5), min_size=1, max_size=4), kills=st.integers(0, 6))
def test_extra_copies_are_either_explained_or_reported(copies: list[int], kills: int) -> None:
    """Every extra copy is counted once: explained by a kill that caught it, or not."""
    pairs = [(f"<m{n}@src.test>", R1) for n in range(len(copies))]
    book = Ledger(kills=[Kill({}, set(), delivering=set(pairs)) for _ in range(kills)])
    book.acknowledged = {m: [r] for m, r in pairs}
    dumps = sink(*[(m, [r]) for (m, r), n in zip(pairs, copies, strict=True) for _ in range(n)])
    result = audit(book, dumps)
    extra = sum(n - 1 for n in copies)
    assert result.explained + sum(result.unexplained.values()) == extra
    assert sum(result.unexplained.values()) == sum(max(0, n - 1 - kills) for n in copies)


def test_a_dsn_reports_the_original_message_and_recipient_only() -> None:
    dsn = (
        b"Message-ID: <dsn-1@zoneq>\r\n\r\nFinal-Recipient: rfc822; X1@bad.test\r\n"
        b"Action: failed\r\n\r\nMessage-ID: <a@src.test>\r\n"
    )
    assert reported(dsn, "<dsn-1@zoneq>") == [(A, "x1@bad.test")]


def per_recipient(recipient: str, action: str) -> bytes:
    """One recipient's fields of a DSN (RFC 3464 section 2.3)."""
    return f"Final-Recipient: rfc822; {recipient}\r\nAction: {action}\r\nStatus: 5.0.0\r\n".encode()


@pytest.mark.parametrize(
    ("case", "blocks", "failed"),
    [
        ("failed", [per_recipient(X1, "failed")], [X1]),
        ("delayed: still queued", [per_recipient(R1, "delayed")], []),
        ("delivered, relayed", [per_recipient(R1, "delivered"), per_recipient(R2, "relayed")], []),
        (
            "one failed, one delayed",
            [per_recipient(R1, "delayed"), per_recipient(X1, "failed")],
            [X1],
        ),
        (
            "the Action field first",
            [b"Action: failed\r\nFinal-Recipient: rfc822; " + X1.encode()],
            [X1],
        ),
    ],
)
def test_a_dsn_reports_only_the_recipients_whose_action_is_failed(
    case: str, blocks: list[bytes], failed: list[str]
) -> None:
    dsn = (
        b"Message-ID: <dsn-1@zoneq>\r\n\r\nReporting-MTA: dns; mx.test\r\n\r\n"
        + b"\r\n".join(blocks)
        + b"\r\n\r\nMessage-ID: <a@src.test>\r\n"
    )
    assert reported(dsn, "<dsn-1@zoneq>") == [(A, r) for r in failed], case


@pytest.mark.parametrize("helo", ["c.test", "client." + "x" * 40 + ".test", "y" * 70])
@pytest.mark.parametrize("recipient", [R1, None])
def test_a_copy_names_its_queue_id_by_the_received_field_zoneq_wrote(
    helo: str, recipient: str | None
) -> None:
    """Whatever the folding of the field (smtp-sink dumps LF line ends)."""
    field = received_header(
        helo=helo,
        client_ip="127.0.0.5",
        hostname="mx.zoneq.test",
        protocol="ESMTP",
        msg_id=QUEUE_IDS[A],
        recipient=recipient,
        now_ms=1_700_000_000_000,
    )
    content = field.replace(b"\r\n", b"\n") + f"From: {SENDER}\nMessage-ID: {A}\n\nbody\n".encode()
    assert queue_id_of(content) == QUEUE_IDS[A]
    assert queue_id_of(content.split(b"From:")[1]) == ""  # no Received field of zoneq's


def brief(note: str, book: Ledger) -> str:
    """A note as "what code": ``what`` is the session, or the message the client sent."""
    what, reply = note.split(": ", 1)
    return f"{'message' if what in book.digests else what} {reply.split(' ')[0]}"


@pytest.mark.parametrize(
    ("case", "faults", "refused_5xx", "refusals", "refused"),
    [
        ("greeting 554", Faults(greeting=b"554 5.3.2 no service"), ["session 554"], [], False),
        ("greeting 421", Faults(greeting=b"421 4.3.2 closing"), [], ["session 421"], False),
        ("MAIL 550", Faults(mail_reply=b"550 5.7.1 no"), ["message 550"], [], False),
        ("MAIL 451", Faults(mail_reply=b"451 4.3.0 later"), [], ["message 451"], True),
    ],
)
@async_test
async def test_the_client_notes_every_refusal_the_greeting_included(
    case: str, faults: Faults, refused_5xx: list[str], refusals: list[str], refused: bool
) -> None:
    book = Ledger()
    async with FaultServer(faults) as server:
        sent = await send_until_cut(server.port, book, "t", Load((R1,), sizes=(300,)), limit=1)
    assert sent == 0, case
    assert [brief(note, book) for note in book.refused_5xx] == refused_5xx, case
    assert [brief(note, book) for note in book.refusals] == refusals, case
    assert bool(book.refused) == refused, case
    assert not book.cut and not book.acknowledged, case
