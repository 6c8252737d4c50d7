"""Reply rules: what a remote server's words mean, beyond its reply code.

Pure: no I/O, no clock.  ``classify`` (``replies.py``) decides from the codes alone, as
RFC 5321 section 4.2.1 says a client should.  The big mailbox providers say more in the
text: "you are sending too fast" under a 421, "your address is on a block list" under a
550.  A rule is a pattern over the reply (its one-line form, ``550 5.7.1 text``, as logs and
DSNs show it, so an operator can copy a pattern from a log), optionally narrowed by the
reply code and the enhanced status code, and says what to do:

* ``defer``: try again later (a 5xx the operator knows to be temporary, say);
* ``bounce``: give up now with a DSN;
* ``slow_down``: defer, and lower that destination's concurrency and rate for a while
  (Postfix's feedback on "421 too many connections", ``queue/feedback.py``);
* ``blocked``: defer, and make the next attempt to that destination use another source
  address of the zone's pool, resting this one for that destination (issue 5: ZoneMTA's
  users asked for exactly this).  A block of our address says nothing about the recipient,
  so even a 5xx reply to it is deferred, not bounced: the zone's ``max_age`` still ends it.

A rule's action decides the verdict even where ``classify`` would try the next MX host
(a 421 at the greeting): the other MX hosts of a provider throttle and block alike, and
asking each of them in turn is what the provider asked us not to do.  A positive reply
(2yz, or 354/334 where expected) is never reinterpreted: the mail is delivered.

Rules are tried in order, the operator's first, then the shipped defaults
(``provider_replies.py``); the first match wins.

Every failure also gets a *category* for its event (issue 6's "reply texts per category"):
the category of the rule that fits it, else ``failure_category``'s RFC 3463 subject class.
The core decides both at once from a worker's report (``rule_report``), since it holds the
rules and writes the events; ``judge`` is the same for a parsed ``Reply`` and its stage.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Final

from zoneq.protocol.replies import (
    Category,
    EnhancedStatus,
    Reply,
    Stage,
    Verdict,
    categorize,
    classify,
)

__all__ = [
    "Judgement",
    "ReplyAction",
    "ReplyRule",
    "Ruling",
    "code_matches",
    "enhanced_matches",
    "failure_category",
    "first_match",
    "judge",
    "rule_report",
]

# "4xx", "55x", "421": a reply code, 'x' for any digit (Postfix's access-table habit).
CODE_PATTERN: Final = re.compile(r"[45][0-9x][0-9x]")
# "5", "5.7", "5.7.1": an RFC 3463 status code or a prefix of it, by whole parts.
ENHANCED_PATTERN: Final = re.compile(r"[45](?:\.(?:0|[1-9][0-9]{0,2})){0,2}")


class ReplyAction(enum.StrEnum):
    DEFER = "defer"
    BOUNCE = "bounce"
    SLOW_DOWN = "slow_down"
    BLOCKED = "blocked"


_VERDICT: Final[dict[ReplyAction, Verdict]] = {
    ReplyAction.DEFER: Verdict.DEFER,
    ReplyAction.BOUNCE: Verdict.BOUNCE,
    ReplyAction.SLOW_DOWN: Verdict.DEFER,
    ReplyAction.BLOCKED: Verdict.DEFER,
}


def code_matches(spec: str, code: int | None) -> bool:
    """Whether reply ``code`` fits ``spec`` (``"4xx"``, ``"421"``); no code fits nothing."""
    if code is None:
        return False
    return all(want in ("x", have) for want, have in zip(spec, f"{code:03d}", strict=True))


def enhanced_matches(spec: str, status: str | None) -> bool:
    """Whether RFC 3463 ``status`` (``"5.7.1"``) is ``spec`` or below it (``"5.7"``), by whole
    parts: ``"5.7"`` covers 5.7.1 and 5.7.28 but ``"5.7.2"`` does not cover 5.7.28."""
    if status is None:
        return False
    want, have = spec.split("."), status.split(".")
    return have[: len(want)] == want


@dataclass(frozen=True, slots=True)
class ReplyRule:
    """One rule; build with :meth:`make`, which compiles and checks the parts."""

    pattern: re.Pattern[str]
    action: ReplyAction
    category: str
    code: str | None = None
    enhanced: str | None = None

    @classmethod
    def make(
        cls,
        pattern: str,
        action: ReplyAction | str,
        category: str,
        *,
        code: str | None = None,
        enhanced: str | None = None,
    ) -> ReplyRule:
        """Raises ``ValueError`` (``re.error`` is one) for a bad pattern, code or status.

        Patterns are searched anywhere in the reply, case-insensitively: providers change
        the capitals and the wrapping of their texts more often than the words.
        """
        if code is not None and not CODE_PATTERN.fullmatch(code):
            raise ValueError(f"invalid reply code {code!r}: expected e.g. '421', '45x' or '5xx'")
        if enhanced is not None and not ENHANCED_PATTERN.fullmatch(enhanced):
            raise ValueError(
                f"invalid enhanced status {enhanced!r}: expected e.g. '5.7.1' or '4.7' "
                "(RFC 3463, class 4 or 5)"
            )
        if code is not None and enhanced is not None and code[0] != enhanced[0]:
            raise ValueError(f"code {code} and enhanced status {enhanced} differ in class")
        return cls(
            re.compile(pattern, re.IGNORECASE), ReplyAction(action), category, code, enhanced
        )

    def matches(self, code: int | None, enhanced: str | None, text: str) -> bool:
        """``text`` is the one-line form of the reply (``str(Reply)``)."""
        if self.code is not None and not code_matches(self.code, code):
            return False
        if self.enhanced is not None and not enhanced_matches(self.enhanced, enhanced):
            return False
        return self.pattern.search(text) is not None


def first_match(
    rules: Iterable[ReplyRule], code: int | None, enhanced: str | None, text: str
) -> ReplyRule | None:
    """The first rule that fits the reply, for callers holding its parts (the core gets a
    worker's report as code, status and one-line text, not as a ``Reply``)."""
    for rule in rules:
        if rule.matches(code, enhanced, text):
            return rule
    return None


@dataclass(frozen=True, slots=True)
class Judgement:
    """What a reply means: the verdict, a category for events and analytics, and the action
    of the rule that decided (None: no rule matched, the codes decided)."""

    verdict: Verdict
    category: str
    action: ReplyAction | None = None


def judge(reply: Reply, stage: Stage, rules: Iterable[ReplyRule]) -> Judgement:
    """``classify`` with the rules applied on top (see the module's docstring)."""
    verdict = classify(reply, stage)
    if verdict is not Verdict.DONE:
        status = str(reply.enhanced) if reply.enhanced is not None else None
        rule = first_match(rules, reply.code, status, str(reply))
        if rule is not None:
            return Judgement(_VERDICT[rule.action], rule.category, rule.action)
    return Judgement(verdict, categorize(reply).value)


@dataclass(frozen=True, slots=True)
class Ruling:
    """What the core makes of a failure a worker reported: the action of the rule that fits
    (None: no rule fits, the worker's verdict stands) and the category for its event."""

    action: ReplyAction | None
    category: str


def failure_category(code: int | None, enhanced: str | None) -> str:
    """``categorize`` for a failure as a worker reports it: code (None when no reply came:
    no MX, connection refused, TLS failed) and enhanced status as text.

    The status decides when it parses, as in ``categorize``: a local failure carries one of
    its own (X.4.x no answer or unable to route, X.7.x TLS or AUTH not possible; RFC 3463
    sections 3.5 and 3.8), so it is filed with the remote replies that mean the same.
    """
    status = EnhancedStatus.parse(enhanced) if enhanced else None
    if status is not None and status.klass != 2:
        # categorize reads only the status when there is one; the code is a carrier of
        # the status's class, so a status that disagrees with the reply code still counts
        return categorize(Reply(status.klass * 100, ("",), status)).value
    if code is not None and 400 <= code <= 599:
        return categorize(Reply(code, ("",))).value
    return Category.OTHER.value


def rule_report(
    rules: Iterable[ReplyRule], code: int | None, enhanced: str | None, text: str
) -> Ruling:
    """The rule's action and category for a reported failure (``text``: the one-line reply),
    else no action and ``failure_category``'s category.

    Only a remote negative reply (4yz or 5yz) is matched: zoneq's own texts for a failure
    without a reply (reported with no code) are not a remote server's words, and a rule
    must not slow down or rest an address over them.
    """
    if text and code is not None and code >= 400:
        rule = first_match(rules, code, enhanced, text)
        if rule is not None:
            return Ruling(rule.action, rule.category)
    return Ruling(None, failure_category(code, enhanced))
