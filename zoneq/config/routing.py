"""Routing rules: ``[[routing.rules]]``, each sending one kind of match to one zone.

A rule names its zone and exactly one of ``sender_domain``, ``recipient_domain`` or
``client_network``.  Which *kind* of rule wins is fixed (issue 5): the routing header from a
trusted client, then sender domain, recipient domain, client network, then the default
zone; within a kind, the first rule in the file that matches.  ``zoneq.queue.routing``
applies them.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Final, Self

from pydantic import AfterValidator, Field, model_validator
from pydantic_core import PydanticCustomError

from zoneq.config.types import Network, Section, ZoneName, domain_name, problems_error

__all__ = [
    "MATCH_KINDS",
    "DomainPattern",
    "HeaderName",
    "RoutingRule",
    "unknown_rule_zones",
]

MATCH_KINDS: Final = ("sender_domain", "recipient_domain", "client_network")
"""The keys a rule matches on, in the order the router tries them (after the header)."""

_LABEL: Final = r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?"
_DOMAIN_PATTERN: Final = re.compile(rf"\.?{_LABEL}(?:\.{_LABEL})*")


def _check_domain_pattern(value: str) -> str:
    # A-labels, as the queue keys recipients' domains: a rule for "bücher.example" routes
    # mail for "xn--bcher-kva.example" too, and back (RFC 5890).
    expected = "expected 'example.com' (that domain only) or '.example.com' (every domain below it)"
    try:
        name = domain_name(value)
    except ValueError as exc:
        reason = f"{exc}; {expected}"
        raise PydanticCustomError("domain_pattern", "{reason}", {"reason": reason}) from None
    if not _DOMAIN_PATTERN.fullmatch(name):
        reason = f"invalid domain {value!r}: {expected}"
        raise PydanticCustomError("domain_pattern", "{reason}", {"reason": reason})
    return name


DomainPattern = Annotated[str, AfterValidator(_check_domain_pattern)]
"""``example.com`` matches that domain only; ``.example.com`` every domain below it (not
``example.com`` itself), as in Postfix's transport maps.  Kept as lower-case A-labels."""


# RFC 5322 section 3.6.8: a field name is printable US-ASCII except the colon.
_FIELD_NAME: Final = re.compile(r"[\x21-\x39\x3b-\x7e]{1,76}")


def _check_header_name(value: str) -> str:
    if not _FIELD_NAME.fullmatch(value):
        reason = f"invalid header field name {value!r} (RFC 5322 section 3.6.8)"
        raise PydanticCustomError("header_name", "{reason}", {"reason": reason})
    return value


HeaderName = Annotated[str, AfterValidator(_check_header_name)]
"""A message header field name such as ``X-Sending-Zone``."""


class RoutingRule(Section):
    """One ``[[routing.rules]]`` entry."""

    zone: ZoneName
    """The zone that mail matching this rule goes to; must be defined in ``[zones]``."""

    sender_domain: list[DomainPattern] = Field(default_factory=list)
    """Domains of the envelope sender (MAIL FROM); the null sender ``<>`` matches none."""

    recipient_domain: list[DomainPattern] = Field(default_factory=list)
    """Domains of the recipient (RCPT TO)."""

    client_network: list[Network] = Field(default_factory=list)
    """Networks of the submitting client (CIDR)."""

    @model_validator(mode="after")
    def _one_kind(self) -> Self:
        # One kind per rule keeps precedence readable: a rule with two kinds would have to
        # mean "both", and its place in the order would be ambiguous.
        given = [kind for kind in MATCH_KINDS if getattr(self, kind)]
        if len(given) != 1:
            text = (
                f"a rule needs exactly one of {', '.join(MATCH_KINDS)} (non-empty), "
                f"got {len(given)}{': ' + ', '.join(given) if given else ''}"
            )
            raise problems_error(((), text))
        return self


def unknown_rule_zones(
    rules: list[RoutingRule], zones: Mapping[str, object]
) -> list[tuple[tuple[str | int, ...], str]]:
    """(key, text) for each rule whose zone is not defined, keys relative to ``[routing]``."""
    return [
        (("rules", index, "zone"), f"names zone {rule.zone!r}, which is not defined in [zones]")
        for index, rule in enumerate(rules)
        if rule.zone not in zones
    ]
