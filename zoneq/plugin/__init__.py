"""Plugins: modules enabled in ``[plugins.<name>]``, called at named hooks with a time limit.

This package is the public API for plugin authors (see ``plugins/README.md``): import the
hook names, argument and result types from here.
"""

from zoneq.plugin.errors import Fault, PluginFailure
from zoneq.plugin.hooks import (
    SPECS,
    AddHeaders,
    AuthArgs,
    ConnectArgs,
    Drop,
    Hook,
    MailFromArgs,
    MessageHeadersArgs,
    OutcomeArgs,
    Phase,
    RcptToArgs,
    RouteArgs,
    SenderHeadersArgs,
    Session,
)
from zoneq.plugin.host import HookResult, PluginApp, PluginHost
from zoneq.protocol.replies import EnhancedStatus, Reply

__all__ = [
    "SPECS",
    "AddHeaders",
    "AuthArgs",
    "ConnectArgs",
    "Drop",
    "EnhancedStatus",
    "Fault",
    "Hook",
    "HookResult",
    "MailFromArgs",
    "MessageHeadersArgs",
    "OutcomeArgs",
    "Phase",
    "PluginApp",
    "PluginFailure",
    "PluginHost",
    "RcptToArgs",
    "Reply",
    "RouteArgs",
    "SenderHeadersArgs",
    "Session",
]
