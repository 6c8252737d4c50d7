"""What a misbehaving plugin becomes: one error with the reply to give and the words to log."""

from __future__ import annotations

import enum

from zoneq.errors import TemporaryFailure
from zoneq.plugin.hooks import Hook
from zoneq.protocol.replies import LOCAL_ERROR, Reply

__all__ = ["Fault", "PluginFailure"]


class Fault(enum.StrEnum):
    RAISED = "raised"
    TIMED_OUT = "timed out"
    GARBAGE = "returned garbage"


class PluginFailure(TemporaryFailure):
    """A plugin raised, hung past its time limit, or returned something its hook does not
    allow.  Temporary by definition: the fault is ours (a plugin is part of this server), so
    an SMTP client gets 451 4.3.0 and keeps the message; a delivery is logged and deferred.
    """

    def __init__(self, plugin: str, hook: Hook, fault: Fault, detail: str) -> None:
        super().__init__(f"plugin {plugin!r} {fault} at {hook}: {detail}")
        self.plugin = plugin
        self.hook = hook
        self.fault = fault
        self.detail = detail

    @property
    def reply(self) -> Reply:
        """What to answer an SMTP client: 4yz, transient (RFC 5321 section 4.2.1), never 5xx."""
        return LOCAL_ERROR

    def __reduce__(self) -> tuple[type[PluginFailure], tuple[str, Hook, Fault, str]]:
        return (type(self), (self.plugin, self.hook, self.fault, self.detail))
