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
matches ``u@bücher.test`` and ``u@xn--bcher-kva.test`` alike.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from pydantic import BaseModel, ConfigDict, field_validator, model_validator

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


class Rule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    zone: str
    sender: str | None = None
    recipient: str | None = None

    @field_validator("sender", "recipient")
    @classmethod
    def _compared_form(cls, pattern: str | None) -> str | None:
        return None if pattern is None else address_form(pattern)

    @model_validator(mode="after")
    def _needs_a_pattern(self) -> Rule:
        if self.sender is None and self.recipient is None:
            raise ValueError("a rule needs a sender or a recipient pattern")
        return self

    def matches(self, sender: str, recipient: str) -> bool:
        """Whether the addresses, in ``address_form``, fit the rule's patterns."""
        return all(
            pattern is None or fnmatchcase(value, pattern)
            for pattern, value in ((self.sender, sender), (self.recipient, recipient))
        )


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
        sender, recipient = address_form(args.sender), address_form(args.recipient)
        for rule in options.rules:
            if rule.matches(sender, recipient):
                return rule.zone
        return None

    app.add_hook(Hook.QUEUE_ROUTE, route)
