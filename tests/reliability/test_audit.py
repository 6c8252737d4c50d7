"""The fault suite's verdict (``tests/support/ledger.py``'s :func:`audit`) on made-up runs.

The SIGKILL tests trust it to tell an explained extra copy from an unexplained one, and a
4xx-refused message that landed under way at a kill from one that landed with no excuse; so
it is checked here on ledgers and sink contents written by hand.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.ledger import SENDER, Copy, Dumps, Kill, Ledger, audit, reported

A, B = "<a@src.test>", "<b@src.test>"
R1, R2 = "r1@ok.test", "r2@ok.test"


def sink(*copies: tuple[str, list[str]], dsns: tuple[tuple[str, str], ...] = ()) -> Dumps:
    """The sink after ``copies`` (Message-ID, recipients) and a DSN for each of ``dsns``."""
    dumps = Dumps()
    for n, (message_id, recipients) in enumerate(copies):
        dumps.copies[f"msg.{n}"] = Copy(message_id, recipients, "digest", [])
    for n, pair in enumerate(dsns):
        dumps.copies[f"dsn.{n}"] = Copy(f"<dsn-{n}@zoneq>", [SENDER], "", [pair])
    return dumps


def ledger(kills: list[Kill] | None = None, refused: tuple[str, ...] = ()) -> Ledger:
    book = Ledger(kills=kills or [])
    book.acknowledged = {A: [R1, R2]}
    book.refused = {m: [R1] for m in refused}
    book.digests = {A: "digest", B: "digest"}
    return book


@pytest.mark.parametrize(
    ("case", "book", "dumps", "unexplained", "refused_delivered"),
    [
        ("one copy each", ledger(), sink((A, [R1, R2])), {}, []),
        ("extra copy, no kill", ledger(), sink((A, [R1, R2]), (A, [R1])), {R1: 1}, []),
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
            {R1: 1},
            [],
        ),
        (
            "a kill explains only the pair it caught",
            ledger([Kill({}, set(), delivering={(A, R2)})]),
            sink((A, [R1, R2]), (A, [R1])),
            {R1: 1},
            [],
        ),
        (
            "extra DSN, in flight at a kill",
            ledger([Kill({}, set(), bouncing={(A, R2)})]),
            sink((A, [R1]), dsns=((A, R2), (A, R2))),
            {},
            [],
        ),
        ("extra DSN, no kill", ledger(), sink((A, [R1]), dsns=((A, R2), (A, R2))), {SENDER: 1}, []),
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
    unexplained: dict[str, int],
    refused_delivered: list[str],
) -> None:
    result = audit(book, dumps)
    assert result.unexplained_duplicates(Counter()) == unexplained, case
    assert result.refused_delivered == refused_delivered, case
    assert bool(result.problems()) == bool(refused_delivered), case


def test_a_logged_possible_duplicate_explains_one_extra_copy() -> None:
    result = audit(ledger(), sink((A, [R1, R2]), (A, [R1]), (A, [R1])))
    assert result.unexplained_duplicates(Counter({R1: 1})) == {R1: 1}
    assert result.unexplained_duplicates(Counter({R1: 2})) == {}


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
