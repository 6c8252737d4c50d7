"""Plugins: modules enabled in ``[plugins.<name>]``, called at named hooks with a time limit.

This package is the public API for plugin authors (see ``plugins/README.md``): import the
hook names, argument and result types from here.
"""

from zoneq.plugin.app import PluginApp
from zoneq.plugin.errors import Fault, OptionError, PluginFailure
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
from zoneq.plugin.host import HookResult, PluginHost
from zoneq.protocol.domains import bare_domain, normal_domain
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
    "OptionError",
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
    "bare_domain",
    "normal_domain",
]
