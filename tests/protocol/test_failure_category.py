"""A failure's category for its events: the fitting rule's, else the RFC 3463 class."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zoneq.protocol.provider_replies import PROVIDER_RULES
from zoneq.protocol.replies import Category, EnhancedStatus, Reply, Stage, categorize
from zoneq.protocol.reply_rules import (
    ReplyAction,
    ReplyRule,
    Ruling,
    failure_category,
    judge,
    rule_report,
)

SPAMHAUS = "554 5.7.1 Service unavailable; Client host [192.0.2.1] blocked using zen.spamhaus.org"


@pytest.mark.parametrize(
    ("code", "enhanced", "category"),
    [
        (550, "5.1.1", "addressing"),  # no such user (RFC 3463 section 3.2)
        (452, "4.2.2", "mailbox"),  # mailbox full
        (421, "4.3.2", "mail_system"),
        (None, "4.4.1", "network"),  # no answer from host: a local failure, no reply
        (None, "4.4.3", "network"),  # MX lookup failed for now
        (None, "5.1.10", "addressing"),  # RFC 7505 null MX
        (None, "4.7.5", "policy"),  # TLS handshake failed
        (None, "4.7.4", "policy"),  # STARTTLS required and not offered
        (550, "5.6.7", "content"),
        (550, "5.9.1", "other"),  # a subject RFC 3463 does not define
        (550, None, "addressing"),  # no status: the basic code's usual meaning
        (554, None, "policy"),
        (454, None, "policy"),
        (499, None, "other"),
        (None, None, "other"),  # nothing to go by
        (None, "not a status", "other"),
        (550, "4.7.1", "policy"),  # a status of the other class still names the subject
        (250, "2.0.0", "other"),  # never a failure; no category claims it
    ],
)
def test_failure_category_table(code: int | None, enhanced: str | None, category: str) -> None:
    assert failure_category(code, enhanced) == category


CODES = st.sampled_from([421, 450, 451, 452, 454, 500, 550, 551, 552, 553, 554])
STATUSES = st.builds(
    EnhancedStatus, st.sampled_from([4, 5]), st.integers(0, 999), st.integers(0, 999)
)


@given(CODES, st.none() | STATUSES)
def test_failure_category_agrees_with_categorize(code: int, status: EnhancedStatus | None) -> None:
    if status is not None and status.klass != code // 100:
        status = EnhancedStatus(code // 100, status.subject, status.detail)
    reply = Reply(code, ("whatever",), status)
    expected = categorize(reply).value
    assert failure_category(code, str(status) if status else None) == expected
    assert rule_report((), code, str(status) if status else None, str(reply)).category == expected


@pytest.mark.parametrize(
    ("code", "enhanced", "text", "ruling"),
    [
        (554, "5.7.1", SPAMHAUS, Ruling(ReplyAction.BLOCKED, "blocklisted")),
        (
            421,
            "4.7.28",
            "421 4.7.28 unusual rate of unsolicited mail: rate limited",
            Ruling(ReplyAction.SLOW_DOWN, "rate_limited"),
        ),
        (
            550,
            "5.1.1",
            "550 5.1.1 <a@b.test>: Recipient address rejected",
            Ruling(None, "addressing"),
        ),
        # zoneq's own words for a failure without a reply are never matched against rules,
        # even when they contain a rule's words
        (
            None,
            "4.4.1",
            "no MX host could be reached (blocked using nothing)",
            Ruling(None, "network"),
        ),
        (None, "4.7.5", "TLS handshake failed", Ruling(None, "policy")),
        (421, None, "", Ruling(None, "mail_system")),
    ],
)
def test_rule_report_with_the_shipped_rules(
    code: int | None, enhanced: str | None, text: str, ruling: Ruling
) -> None:
    assert rule_report(PROVIDER_RULES, code, enhanced, text) == ruling


def test_the_operators_rule_names_the_category() -> None:
    own = ReplyRule.make(r"mailbox is over quota", ReplyAction.DEFER, "quota", code="5xx")
    text = "552 5.2.2 mailbox is over quota"
    assert rule_report((own, *PROVIDER_RULES), 552, "5.2.2", text) == Ruling(
        ReplyAction.DEFER, "quota"
    )
    assert rule_report(PROVIDER_RULES, 552, "5.2.2", text) == Ruling(None, Category.MAILBOX.value)


@given(st.sampled_from([r for r in PROVIDER_RULES]), CODES)
def test_rule_report_and_judge_agree_on_the_category(rule: ReplyRule, code: int) -> None:
    """The core (worker reports: parts) and ``judge`` (a parsed reply) categorise alike."""
    reply = Reply(code, ("blocked using zen.spamhaus.org, rate limited",), None)
    judged = judge(reply, Stage.RCPT, (rule,))
    assert rule_report((rule,), code, None, str(reply)).category == judged.category
