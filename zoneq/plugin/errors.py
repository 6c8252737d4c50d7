"""What a misbehaving plugin becomes: one error with the reply to give and the words to log."""

from __future__ import annotations

import enum

from zoneq.errors import ConfigError, TemporaryFailure
from zoneq.plugin.hooks import Hook
from zoneq.protocol.replies import LOCAL_ERROR, Reply

__all__ = ["Fault", "OptionError", "PluginFailure"]


class Fault(enum.StrEnum):
    RAISED = "raised"
    TIMED_OUT = "timed out"
    GARBAGE = "returned garbage"
    STUCK = "is stuck"
    """Every thread of the plugin is held by a call past its time limit: failed at once."""
    BUSY = "is busy"
    """Every thread of the plugin stayed busy with other calls for as long as the time
    limit: this call never ran (it did not hang; the plugin is short of threads)."""


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


class OptionError(ConfigError):
    """Raised by a plugin's ``init`` for an option that cannot work (a key file that does
    not exist, a zone that is not defined).  ``where`` is the option's path inside the
    plugin's ``options`` table (``("domains", "example.com", "key_file")``), so the problem
    is reported as ``plugins.<name>.options.domains."example.com".key_file``.  To report
    several at once, raise an ``ExceptionGroup`` of them.
    """

    def __init__(self, where: tuple[str | int, ...], problem: str) -> None:
        super().__init__(".".join(map(str, where)), problem)
        self.where = where

    def __reduce__(self) -> tuple[type[OptionError], tuple[tuple[str | int, ...], str]]:
        return (type(self), (self.where, self.problem))
