"""``[reply_rules]``: what remote replies mean beyond their codes, and how long feedback lasts.

```toml
[reply_rules]
defaults = true              # the shipped rules for the big providers, after these
slow_down_period = "10m"     # how long a "slow down" lasts for a destination
slow_down_rate = "1/s"       # that destination's rate meanwhile (per zone)
blocked_rest = "1h"          # how long a blocked source address rests for a destination

[[reply_rules.rules]]
pattern = "too many recipients this hour"
code = "4xx"                 # optional: "421", "45x", "5xx"
enhanced = "4.7"             # optional: RFC 3463 status or a prefix of it
action = "slow_down"         # defer | bounce | slow_down | blocked
category = "rate_limited"
```

Each pattern is compiled here, at load time, so a bad regular expression is reported with
its key (``reply_rules.rules[0].pattern``) by ``zoneq check-config`` instead of failing at the
first reply it meets.  The meaning of the actions is in ``zoneq/protocol/reply_rules.py``.
"""

from __future__ import annotations

import re
from typing import Annotated, Final, Literal, Self

from pydantic import AfterValidator, Field, model_validator
from pydantic_core import PydanticCustomError

from zoneq.config.types import Duration, Section, problems_error
from zoneq.config.zones import Rate, parse_rate
from zoneq.protocol.provider_replies import PROVIDER_RULES
from zoneq.protocol.reply_rules import CODE_PATTERN, ENHANCED_PATTERN, ReplyRule
from zoneq.protocol.retry import parse_duration

__all__ = ["ReplyRuleConfig", "ReplyRulesConfig"]

# Long enough for any real reply (RFC 5321 section 4.5.3.1.5: 512 octets a line), and a
# bound on what one pattern may cost to compile.
_MAX_PATTERN: Final = 1000
_CATEGORY: Final = re.compile(r"[a-z][a-z0-9_]{0,31}")


def _check_pattern(value: str) -> str:
    if not value:
        raise PydanticCustomError(
            "pattern", "{reason}", {"reason": "empty pattern matches every reply"}
        )
    if len(value) > _MAX_PATTERN:
        reason = f"pattern longer than {_MAX_PATTERN} characters"
        raise PydanticCustomError("pattern", "{reason}", {"reason": reason})
    try:
        re.compile(value)
    except re.error as exc:
        reason = f"invalid regular expression {value!r}: {exc}"
        raise PydanticCustomError("pattern", "{reason}", {"reason": reason}) from None
    return value


def _checker(pattern: re.Pattern[str], kind: str, example: str) -> AfterValidator:
    def check(value: str) -> str:
        if not pattern.fullmatch(value):
            reason = f"invalid {kind} {value!r}: expected e.g. {example}"
            raise PydanticCustomError(kind.replace(" ", "_"), "{reason}", {"reason": reason})
        return value

    return AfterValidator(check)


Pattern = Annotated[str, AfterValidator(_check_pattern)]
CodeSpec = Annotated[str, _checker(CODE_PATTERN, "reply code", "'421', '45x' or '5xx'")]
EnhancedSpec = Annotated[
    str, _checker(ENHANCED_PATTERN, "enhanced status", "'5.7.1' or '4.7' (RFC 3463, class 4 or 5)")
]
Category = Annotated[
    str, _checker(_CATEGORY, "category", "'rate_limited' (lower case, digits, '_')")
]


class ReplyRuleConfig(Section):
    """``[[reply_rules.rules]]``: one rule; the first that fits a reply decides."""

    pattern: Pattern
    """A regular expression searched, ignoring case, in the reply's one-line form
    (``550 5.7.1 text``, as logs show it)."""

    code: CodeSpec | None = None
    enhanced: EnhancedSpec | None = None
    action: Literal["defer", "bounce", "slow_down", "blocked"]
    category: Category

    @model_validator(mode="after")
    def _same_class(self) -> Self:
        if self.code is not None and self.enhanced is not None and self.code[0] != self.enhanced[0]:
            text = f"class {self.enhanced[0]} differs from the code's ({self.code}): never matches"
            raise problems_error((("enhanced",), text))
        return self

    def rule(self) -> ReplyRule:
        return ReplyRule.make(
            self.pattern, self.action, self.category, code=self.code, enhanced=self.enhanced
        )


class ReplyRulesConfig(Section):
    """``[reply_rules]``: the operator's rules, the shipped ones, and feedback timings."""

    defaults: bool = True
    """Try the shipped rules (Gmail, Yahoo, Microsoft, block lists) after ``rules``."""

    slow_down_period: Duration = "10m"
    """How long a destination stays slowed after a "slow down" reply; another one while it
    lasts starts the period again (and lowers the concurrency further)."""

    slow_down_rate: Rate = "1/s"
    """Transactions per destination domain and zone while it is slowed."""

    blocked_rest: Duration = "1h"
    """How long a source address that was blocked rests for that destination."""

    rules: list[ReplyRuleConfig] = Field(default_factory=list)

    def compiled(self) -> tuple[ReplyRule, ...]:
        """The rules in the order they are tried: the operator's, then the shipped ones."""
        own = tuple(rule.rule() for rule in self.rules)
        return own + PROVIDER_RULES if self.defaults else own

    @property
    def slow_down_period_ms(self) -> int:
        return parse_duration(self.slow_down_period)

    @property
    def slow_down_limit(self) -> tuple[int, int]:
        return parse_rate(self.slow_down_rate)

    @property
    def blocked_rest_ms(self) -> int:
        return parse_duration(self.blocked_rest)
