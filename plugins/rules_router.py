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
the built-in rules gave it.
"""

from __future__ import annotations

from fnmatch import fnmatchcase

from pydantic import BaseModel, ConfigDict, model_validator

from zoneq.plugin import Hook, OptionError, PluginApp, RouteArgs


class Rule(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    zone: str
    sender: str | None = None
    recipient: str | None = None

    @model_validator(mode="after")
    def _needs_a_pattern(self) -> Rule:
        if self.sender is None and self.recipient is None:
            raise ValueError("a rule needs a sender or a recipient pattern")
        return self

    def matches(self, sender: str, recipient: str) -> bool:
        # Addresses compare case-insensitively here: in practice mailbox providers ignore
        # local-part case, though RFC 5321 section 2.4 lets them not to.
        return all(
            pattern is None or fnmatchcase(value.lower(), pattern.lower())
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
        for rule in options.rules:
            if rule.matches(args.sender, args.recipient):
                return rule.zone
        return None

    app.add_hook(Hook.QUEUE_ROUTE, route)
