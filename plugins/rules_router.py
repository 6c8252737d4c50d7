"""Route by rules: send recipients matching a pattern to a zone (the ``queue:route`` hook).

The worked example of plugins/README.md.  zoneq's own ``[[routing.rules]]`` match whole
domains; this plugin adds shell-style patterns on the full addresses, for example every
``noreply-*@shop.example`` sender to the transactional zone:

    [plugins.rules_router]
    options.rules = [
        { sender = "noreply-*@shop.example", zone = "transactional" },
        { recipient = "*@*.edu", zone = "bulk" },
    ]

The first rule whose patterns all match wins; a recipient no rule matches keeps the zone
the built-in rules gave it.  Addresses and patterns compare case-insensitively, and a
domain's U-labels as their A-labels, as zoneq's own rules compare domains: ``*@bücher.test``
matches ``u@bücher.test`` and ``u@xn--bcher-kva.test`` alike.  Each address is tried in
both forms, its A-labels and its U-labels, against each pattern as written and with its
labels as A-labels: a wildcard inside a non-ASCII label (``*@bü*.test``) has no A-label,
and a pattern with no ``@`` (``*bücher.test``) has no domain to convert, so those match
the U-label form only.
"""

from __future__ import annotations

import functools
from fnmatch import fnmatchcase

import idna
from pydantic import BaseModel, ConfigDict, PrivateAttr, model_validator

from zoneq.plugin import Hook, OptionError, PluginApp, RouteArgs, normal_domain


def address_form(address: str) -> str:
    """``address``, or a pattern of one, as the rules compare it: lower-cased, each label of
    its domain an A-label.  RFC 5890 section 2.3.2.1: a U-label and its A-label are one
    name, so ``bücher.test`` and ``xn--bcher-kva.test`` must route alike (zoneq's own rules
    do, ``zoneq/queue/routing.py``).  Label by label, so that a pattern's ``*`` and ``?``
    survive in ASCII labels (IDNA refuses them; ``normal_domain`` then keeps the label
    lower-cased as it is).

    Local parts are lower-cased too: in practice mailbox providers ignore their case,
    though RFC 5321 section 2.4 lets them not to.
    """
    local, at, domain = address.rpartition("@")
    if not at:
        return address.lower()
    return f"{local.lower()}@{'.'.join(normal_domain(label) for label in domain.split('.'))}"


def address_forms(address: str) -> tuple[str, ...]:
    """The forms an address is matched in: ``address_form``, and the same with each
    A-label as its U-label (one name, RFC 5890 section 2.3.2.1), for the patterns that
    only that form can meet (a wildcard in a non-ASCII label, no ``@``)."""
    a_form = address_form(address)
    local, at, domain = a_form.rpartition("@")
    if not at or "xn--" not in domain:
        return (a_form,)
    return (a_form, f"{local}@{'.'.join(_u_label(label) for label in domain.split('.'))}")


@functools.lru_cache(maxsize=4096)  # few domains, repeated (as ``normal_domain``'s cache)
def _u_label(label: str) -> str:
    """An A-label as its U-label; any other label, or one IDNA refuses, as it is."""
    if not label.startswith("xn--"):
        return label
    try:
        decoded: str = idna.decode(label)
    except idna.IDNAError:
        return label
    return decoded


def pattern_forms(pattern: str) -> tuple[str, ...]:
    """A pattern as written and as ``address_form`` writes it (lower-cased both)."""
    return tuple(dict.fromkeys((pattern.lower(), address_form(pattern))))


class Rule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    zone: str
    sender: str | None = None
    recipient: str | None = None
    # (sender's, recipient's) ``pattern_forms``, worked out once, at load.
    _forms: tuple[tuple[str, ...] | None, ...] = PrivateAttr(default=())

    def model_post_init(self, context: object, /) -> None:
        self._forms = tuple(
            None if pattern is None else pattern_forms(pattern)
            for pattern in (self.sender, self.recipient)
        )

    @model_validator(mode="after")
    def _needs_a_pattern(self) -> Rule:
        if self.sender is None and self.recipient is None:
            raise ValueError("a rule needs a sender or a recipient pattern")
        return self

    def matches(self, sender: str, recipient: str) -> bool:
        """Whether the addresses fit the rule's patterns, some form of each (``address_forms``)
        a form of its pattern (``pattern_forms``)."""
        return all(
            patterns is None or _fits(patterns, address_forms(value))
            for patterns, value in zip(self._forms, (sender, recipient), strict=True)
        )


def _fits(patterns: tuple[str, ...], values: tuple[str, ...]) -> bool:
    return any(fnmatchcase(value, pattern) for pattern in patterns for value in values)


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    rules: list[Rule]


def init(app: PluginApp) -> None:
    options = app.options
    assert isinstance(options, Options)
    faults = [
        OptionError(("rules", index, "zone"), f"zone {rule.zone!r} is not defined in [zones]")
        for index, rule in enumerate(options.rules)
        if rule.zone not in app.config.zones
    ]
    if faults:  # every one named, so that one check-config run lists them all
        raise ExceptionGroup("rules name zones not defined in [zones]", faults)

    # Plain (not async) is fine for work this small; the host runs it in a thread.
    def route(args: RouteArgs) -> str | None:
        for rule in options.rules:
            if rule.matches(args.sender, args.recipient):
                return rule.zone
        return None

    app.add_hook(Hook.QUEUE_ROUTE, route)
