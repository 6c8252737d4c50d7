"""Reply rules: the shipped provider rules on real texts, the matcher, and their config."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zoneq.config import InvalidConfig, load_config, validate_config
from zoneq.protocol.provider_replies import PROVIDER_RULES
from zoneq.protocol.replies import Reply, Stage, Verdict, classify, parse_reply
from zoneq.protocol.reply_rules import (
    ReplyAction,
    ReplyRule,
    code_matches,
    enhanced_matches,
    first_match,
    judge,
)

SLOW, BLOCKED = ReplyAction.SLOW_DOWN, ReplyAction.BLOCKED


def wire(*lines: str) -> Reply:
    return parse_reply([line.encode() for line in lines])


# Texts as the providers send them (sources cited in zoneq/protocol/provider_replies.py),
# with documentation addresses (RFC 5737) in place of real ones.
PROVIDER_TEXTS = [
    (
        "gmail unusual rate",
        [
            "421-4.7.28 [192.0.2.1      15] Our system has detected an unusual rate of",
            "421-4.7.28 unsolicited mail originating from your IP address. To protect our",
            "421-4.7.28 users from spam, mail sent from your IP address has been temporarily",
            "421 4.7.28 rate limited. For more information, go to  - gsmtp",
        ],
        Stage.RCPT,
        (Verdict.DEFER, "rate_limited", SLOW),
    ),
    (
        "gmail one busy mailbox",
        [
            "450-4.2.1 The user you are trying to contact is receiving mail at a rate that",
            "450 4.2.1 prevents additional messages from being delivered. - gsmtp",
        ],
        Stage.RCPT,
        (Verdict.DEFER, "recipient_rate", ReplyAction.DEFER),
    ),
    (
        "gmail spam",
        [
            "550-5.7.1 Our system has detected that this message is",
            "550 5.7.1 likely unsolicited mail.",
        ],
        Stage.END_OF_DATA,
        (Verdict.BOUNCE, "spam", ReplyAction.BOUNCE),
    ),
    (
        "spamhaus via postfix",
        ["554 5.7.1 Service unavailable; Client host [192.0.2.1] blocked using zen.spamhaus.org"],
        Stage.RCPT,
        (Verdict.DEFER, "blocklisted", BLOCKED),
    ),
    (
        "blocked with spamhaus in a 550",
        ["550-5.7.1 [192.0.2.1] blocked. Your address is in Spamhaus's", "550 5.7.1 list."],
        Stage.MAIL,
        (Verdict.DEFER, "blocklisted", BLOCKED),
    ),
    (
        "listed",
        ["554 5.7.1 Your address 192.0.2.1 is listed on bl.example.net"],
        Stage.RCPT,
        (Verdict.DEFER, "blocklisted", BLOCKED),
    ),
    (
        "yahoo complaints",
        [
            "421 4.7.0 [TSS04] Messages from 192.0.2.1 temporarily deferred due to unexpected "
            "volume or user complaints - 4.16.55.1; see https://postmaster.yahooinc.com"
        ],
        Stage.GREETING,  # classify alone: next host
        (Verdict.DEFER, "complaints", SLOW),
    ),
    (
        "yahoo permanently deferred",
        ["421 4.7.0 [TSS09] All messages from 192.0.2.1 will be permanently deferred"],
        Stage.GREETING,
        (Verdict.DEFER, "reputation", BLOCKED),
    ),
    (
        "yahoo block list",
        ["553 5.7.1 [BL21] Connections will not be accepted from 192.0.2.1"],
        Stage.MAIL,
        (Verdict.DEFER, "blocklisted", BLOCKED),
    ),
    (
        "outlook block list",
        [
            "550 5.7.1 Unfortunately, messages from [192.0.2.1] weren't sent. Please contact "
            "your Internet service provider since part of their network is on our block list "
            "(S3150)."
        ],
        Stage.RCPT,
        (Verdict.DEFER, "blocklisted", BLOCKED),
    ),
    (
        "outlook hourly limits",
        [
            "421 RP-001 (COL004-MC1F12) Unfortunately, some messages from 192.0.2.1 weren't "
            "sent. Please try again. We have limits for how many messages can be sent per hour"
        ],
        Stage.MAIL,
        (Verdict.DEFER, "rate_limited", SLOW),
    ),
    (
        "exchange online busy",
        ["451 4.7.500 Server busy. Please try again later from [192.0.2.1]. (S77714)"],
        Stage.RCPT,
        (Verdict.DEFER, "rate_limited", SLOW),
    ),
    (
        "exchange online refused address",
        ["550 5.7.708 Service unavailable. Access denied, traffic not accepted from this IP."],
        Stage.MAIL,
        (Verdict.DEFER, "reputation", BLOCKED),
    ),
    (
        "exchange online throttled, by its AS code",
        ["451 4.7.501 Access denied, please try again later (AS843)"],
        Stage.MAIL,
        (Verdict.DEFER, "rate_limited", SLOW),
    ),
    (
        "postfix anvil",
        ["421 4.7.0 mx.example.net Error: too many connections from 192.0.2.1"],
        Stage.GREETING,
        (Verdict.DEFER, "concurrency", SLOW),
    ),
    # No rule: the codes decide, as before.
    ("unknown user", ["550 5.1.1 <x@example.net>: Recipient address rejected"], Stage.RCPT,
     (Verdict.BOUNCE, "addressing", None)),
    ("greylisting", ["450 4.7.1 <x@example.net>: Recipient address rejected: Greylisted"],
     Stage.RCPT, (Verdict.DEFER, "policy", None)),
    # Block-list words that are not about our sending address: the codes decide, so an
    # unknown user bounces (RFC 3463 3.2: X.1.1) instead of resting our address for days.
    ("domino unknown user", ["550 5.1.1 <x@example.net>... User not listed in public Name & "
     "Address Book"], Stage.RCPT, (Verdict.BOUNCE, "addressing", None)),
    ("not listed, no status", ["550 <x@example.net>: user is not listed in our directory"],
     Stage.RCPT, (Verdict.BOUNCE, "addressing", None)),
    ("x.1.x status on a list", ["550 5.1.1 <x@example.net>: Recipient on our block list"],
     Stage.RCPT, (Verdict.BOUNCE, "addressing", None)),
    ("url on a content list", ["554 5.7.1 Message rejected: contains a URL listed in SURBL"],
     Stage.END_OF_DATA, (Verdict.BOUNCE, "policy", None)),
    ("uribl", ["554 5.7.1 Rejected: example.org is blacklisted at multi.uribl.com"],
     Stage.END_OF_DATA, (Verdict.BOUNCE, "policy", None)),
    ("body domain in the dbl", ["554 5.7.1 Message contains a domain listed in dbl.spamhaus.org"],
     Stage.END_OF_DATA, (Verdict.BOUNCE, "policy", None)),
    ("attachment block list", ["554 5.6.0 Message rejected: attachment type on our block list"],
     Stage.END_OF_DATA, (Verdict.BOUNCE, "content", None)),
    ("x.6.x status on a list", ["550 5.6.0 Content blacklisted"], Stage.END_OF_DATA,
     (Verdict.BOUNCE, "content", None)),
    ("blacklisted without a status", ["554 Your IP 192.0.2.1 is blacklisted at bl.example.net"],
     Stage.RCPT, (Verdict.DEFER, "blocklisted", BLOCKED)),
    ("comcast dnsbls", ["554 resimta-h1p-0.comcast.net comcast 192.0.2.1 found on one or more "
     "DNSBLs, see http://postmaster.comcast.net/smtp-error-codes.php#BL000001"], Stage.RCPT,
     (Verdict.DEFER, "blocklisted", BLOCKED)),
    ("cbl", ["550 5.7.1 Mail refused, see http://www.abuseat.org/lookup.cgi?ip=192.0.2.1"],
     Stage.MAIL, (Verdict.DEFER, "blocklisted", BLOCKED)),
    ("proofpoint", ["554 5.7.0 Blocked - see https://ipcheck.proofpoint.com/?ip=192.0.2.1"],
     Stage.MAIL, (Verdict.DEFER, "blocklisted", BLOCKED)),
    # Greylisting (rspamd's default text and the like): a plain retry, not a slower domain.
    ("greylisted, try again later", ["451 4.7.1 Try again later"], Stage.RCPT,
     (Verdict.DEFER, "policy", None)),
    ("greylisted, please try again later", ["451 4.7.1 Please try again later"], Stage.RCPT,
     (Verdict.DEFER, "policy", None)),
    ("gmail try again later at ehlo", ["421 4.7.0 Try again later, closing connection. (EHLO)"],
     Stage.EHLO, (Verdict.NEXT_HOST, "policy", None)),
    ("421 without a rule", ["421 4.3.2 Service shutting down"], Stage.MAIL,
     (Verdict.NEXT_HOST, "mail_system", None)),
    ("delivered, whatever it says", ["250 2.0.0 Ok: queued, not blocked using anything"],
     Stage.END_OF_DATA, (Verdict.DONE, "other", None)),
]  # fmt: skip


@pytest.mark.parametrize(
    ("lines", "stage", "expected"),
    [
        pytest.param(lines, stage, expected, id=name)
        for name, lines, stage, expected in PROVIDER_TEXTS
    ],
)
def test_provider_texts_are_judged_by_the_shipped_rules(
    lines: list[str], stage: Stage, expected: tuple[Verdict, str, ReplyAction | None]
) -> None:
    judgement = judge(wire(*lines), stage, PROVIDER_RULES)
    assert (judgement.verdict, judgement.category, judgement.action) == expected


def test_the_operators_rules_come_before_the_shipped_ones() -> None:
    config = validate_config(
        {
            "zones": {"default": {}, "bounces": {}},
            "reply_rules": {
                "rules": [
                    {"pattern": "spamhaus", "action": "bounce", "category": "mine", "code": "55x"}
                ]
            },
        }
    )
    rules = config.reply_rules.compiled()
    assert len(rules) == 1 + len(PROVIDER_RULES)
    spamhaus = wire("554 5.7.1 Client host [192.0.2.1] blocked using zen.spamhaus.org")
    assert judge(spamhaus, Stage.RCPT, rules).category == "mine"
    assert judge(spamhaus, Stage.RCPT, rules).verdict is Verdict.BOUNCE
    # Narrowed by code: a 4xx saying the same is left to the shipped rule.
    soft = wire("451 4.7.1 Client host [192.0.2.1] blocked using zen.spamhaus.org")
    assert judge(soft, Stage.RCPT, rules).category == "blocklisted"


def test_the_shipped_rules_can_be_left_out() -> None:
    config = validate_config(
        {"zones": {"default": {}, "bounces": {}}, "reply_rules": {"defaults": False}}
    )
    assert config.reply_rules.compiled() == ()
    assert load_config().reply_rules.compiled() == PROVIDER_RULES  # on by default


@pytest.mark.parametrize(
    ("rule", "key", "words"),
    [
        ({"pattern": "(unclosed"}, "reply_rules.rules[0].pattern", "invalid regular expression"),
        ({"pattern": ""}, "reply_rules.rules[0].pattern", "empty pattern"),
        ({"code": "42"}, "reply_rules.rules[0].code", "invalid reply code"),
        ({"code": "250"}, "reply_rules.rules[0].code", "invalid reply code"),
        ({"enhanced": "4.07"}, "reply_rules.rules[0].enhanced", "invalid enhanced status"),
        ({"code": "4xx", "enhanced": "5.7"}, "reply_rules.rules[0].enhanced", "differs"),
        ({"action": "retry"}, "reply_rules.rules[0].action", ""),
        ({"category": "Rate Limited"}, "reply_rules.rules[0].category", "invalid category"),
    ],
)
def test_a_bad_rule_is_refused_naming_its_key(rule: dict[str, str], key: str, words: str) -> None:
    table = {"pattern": "x", "action": "defer", "category": "c", **rule}
    with pytest.raises(InvalidConfig) as info:
        validate_config(
            {"zones": {"default": {}, "bounces": {}}, "reply_rules": {"rules": [table]}}
        )
    problems = {p.key: p.text for p in info.value.problems}
    assert key in problems, problems
    assert words in problems[key]


# --- the matcher's parts ------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("spec", "code", "matches"),
    [("421", 421, True), ("421", 451, False), ("4xx", 421, True), ("4xx", 550, False),
     ("45x", 452, True), ("45x", 421, False), ("5xx", None, False)],
)  # fmt: skip
def test_code_specs(spec: str, code: int | None, matches: bool) -> None:
    assert code_matches(spec, code) is matches


@pytest.mark.parametrize(
    ("spec", "status", "matches"),
    [("5.7", "5.7.1", True), ("5.7", "5.7.28", True), ("5.7.2", "5.7.28", False),
     ("5", "5.1.1", True), ("5.7.1", "5.7.1", True), ("4.7", "5.7.1", False),
     ("4.7", None, False)],
)  # fmt: skip
def test_enhanced_specs_match_by_whole_parts(spec: str, status: str | None, matches: bool) -> None:
    assert enhanced_matches(spec, status) is matches


@pytest.mark.parametrize(
    ("code", "enhanced"),
    [("42", None), ("2xx", None), (None, "2.0.0"), (None, "5.07"), ("4xx", "5.7")],
)
def test_rules_refuse_impossible_parts(code: str | None, enhanced: str | None) -> None:
    with pytest.raises(ValueError):
        ReplyRule.make("x", "defer", "c", code=code, enhanced=enhanced)


def test_patterns_ignore_case_and_search_the_whole_one_line_form() -> None:
    rule = ReplyRule.make(r"^452 4\.2\.2 .*QUOTA", "defer", "mailbox_full")
    reply = wire("452-4.2.2 The email account that you tried to reach is over", "452 4.2.2 quota.")
    assert first_match([rule], reply.code, str(reply.enhanced), str(reply)) is rule


# --- properties ----------------------------------------------------------------------------------

codes = st.sampled_from([250, 251, 354, 334, 421, 450, 451, 452, 454, 550, 552, 553, 554])
texts = st.lists(
    st.one_of(
        st.sampled_from(
            ["blocked using zen.spamhaus.org", "too many connections", "[TSS04]", "RP-001",
             "unusual rate", "user unknown", "ok", "listed on", "rate limited", "server busy"]
        ),
        st.text(st.characters(codec="ascii", exclude_characters="\r\n"), max_size=30),
    ),
    min_size=1,
    max_size=4,
)  # fmt: skip


@given(code=codes, words=texts, stage=st.sampled_from(list(Stage)))
def test_rules_only_ever_change_a_failure_and_only_to_their_own_action(
    code: int, words: list[str], stage: Stage
) -> None:
    reply = Reply(code, (" ".join(words),))
    base = classify(reply, stage)
    judgement = judge(reply, stage, PROVIDER_RULES)
    if base is Verdict.DONE:
        assert judgement.verdict is Verdict.DONE and judgement.action is None
    elif judgement.action is None:
        assert judgement.verdict is base  # no rule: the codes decide
    else:
        bounce = judgement.action is ReplyAction.BOUNCE
        assert judgement.verdict is (Verdict.BOUNCE if bounce else Verdict.DEFER)
    # Without rules, judge is classify.
    assert judge(reply, stage, ()).verdict is base


@given(code=st.integers(400, 599), mask=st.lists(st.booleans(), min_size=3, max_size=3))
def test_a_code_spec_with_any_digits_wildcarded_matches_its_own_code(
    code: int, mask: list[bool]
) -> None:
    spec = "".join(
        "x" if hide and i else digit
        for i, (digit, hide) in enumerate(zip(str(code), mask, strict=True))
    )
    assert code_matches(spec, code)
    assert not code_matches(spec, code + 100 if code < 500 else code - 100)
