"""Routing and the receive-time plugin hooks, as the SMTP receiver asks for them.

Theory of operation
-------------------
Issue 5 puts four hooks at receive time and routing at RCPT.  ``ReceiveHooks`` is built
once per receiver (one ``PluginHost``, one compiled ``Router``) and the session calls it at
each step, getting back a plain decision:

* AUTH (``smtp:auth``): a plugin may accept (True) or refuse (False, 535 5.7.8) the
  credentials, or answer its own reply; with no opinion the configured users decide.
* MAIL (``smtp:mail_from``) and RCPT (``smtp:rcpt_to``): a plugin reply refuses the
  command with that reply (RFC 5321 section 4.2: 4yz defers, 5yz refuses).
* RCPT routing: the rules of ``[routing]`` (sender domain, recipient domain, client
  network, default), then ``queue:route`` plugins, which may choose another zone, refuse
  the recipient, or drop it (accepted with 250, never queued; the session keeps it as a
  ``DroppedRecipient``, and the commit writes its DROPPED event, issue 5).
* The final dot (``message:headers``): the header section (first stored chunk) is known;
  a plugin reply refuses the whole message, before anything is committed, so a client is
  never told 250 for a message that is then lost.  Here too the routing header
  (``routing.zone_header``) is read: from a trusted client (authenticated, or in
  ``receiver.allow_networks``) naming a defined zone, it moves every recipient that the
  rules placed (not a plugin's override, which ranks above the header) to that zone.  The
  header can only be read after DATA, which is why it is applied here and not at RCPT.

Re-checking the header's zone
-----------------------------
The ``queue:route`` plugins saw, at RCPT, the zone the rules chose; a recipient the header
moves to another zone is put through them again with the header's zone and rule
``header`` (a suppression list is per zone).  Their answer can no longer be an RCPT reply:
after DATA, SMTP has one reply for the whole transaction (RFC 5321 sections 3.3 and 4.2),
so:

* another zone: the recipient goes there; a ``Drop``: dropped with its DROPPED event;
* a 4yz reply for any recipient: the whole message is deferred with that reply (nothing
  is stored; the client retries, and the plugin may answer otherwise then);
* a 5yz reply: that recipient alone is dropped with a DROPPED event whose text is the
  reply, and logged; the others are queued and the client gets 250.  Only when every
  recipient of the message is refused so is the message refused, with the first reply.
  Refusing the whole message for one refused recipient would make the client retry (or
  bounce) mail for the others, which were accepted at RCPT;
* a misbehaving plugin: 451 4.3.0 for the message, as at any other hook.

A recipient already in the header's zone (or placed by a plugin) is not asked again: the
plugins judged that zone at RCPT.

The recipients are asked side by side, a few at a time, under one deadline for them all
(``zoneq.queue.consults``): one after another, a thousand of them could outlast the
client's ten minutes at the final dot (RFC 5321 section 4.5.3.2.6), and a client that gave
up retries, a duplicate if the message was stored meanwhile.  Past the deadline the
message gets 451 4.3.0 and nothing is stored.

A plugin's reply goes to the client only as SMTP allows a reply (``for_client``): its text
printable ASCII, each line within 512 octets.  A plugin's text is not trusted to be either.

A plugin that raises, hangs past its time limit or returns garbage is a local fault
(``PluginFailure``): the command gets 451 4.3.0, never a 5xx (the client keeps the message
and retries, RFC 5321 section 4.2.1), and the failure is logged.

The ``Session`` a hook sees is built only when a plugin listens at that hook: without
plugins the accept path pays for nothing but the routing rules.
"""

from __future__ import annotations

import logging
import re
import textwrap
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Final

from zoneq.config.model import Config
from zoneq.ipc.intake_messages import DroppedRecipient, ReceivedRecipient
from zoneq.plugin import (
    AuthArgs,
    Drop,
    Hook,
    HookResult,
    MailFromArgs,
    MessageHeadersArgs,
    PluginFailure,
    PluginHost,
    RcptToArgs,
    Session,
)
from zoneq.protocol.replies import LOCAL_ERROR, Reply
from zoneq.queue.consults import ROUTE_DEADLINE_S, RoutingTooSlow, consult_all
from zoneq.queue.routing import HEADER, Route, Router

__all__ = ["Accepted", "ReceiveHooks", "Routed", "SessionFactory", "for_client"]

log = logging.getLogger("zoneq.receiver")

SessionFactory = Callable[[], Session]
"""Builds the hook's view of the SMTP session; called only when a plugin will see it."""

_PLUGIN_RULE = "plugin:"

# RFC 5321 section 4.5.3.1.5: a reply line is at most 512 octets, its code and CRLF included.
_MAX_REPLY_LINE: Final = 512
# A plugin's text past this many lines is cut: it explains a refusal to a person, and a
# client reads (and may log) every line of it.
_MAX_REPLY_LINES: Final = 8
# RFC 5321 section 4.2: reply text is printable US-ASCII (and HT).  Kept so in an SMTPUTF8
# session too: a refusal's text is for a person reading a client's log, and no client is
# relied on to decode UTF-8 there.  Controls (HT too) and the rest become "?", as Postfix's
# printable() does.
_NOT_PRINTABLE: Final = re.compile(r"[^\x20-\x7e]")

Accepted = tuple[list[ReceivedRecipient], tuple[DroppedRecipient, ...]]
"""At the final dot: the recipients to queue, and those dropped (with their events)."""


@dataclass(frozen=True, slots=True)
class Routed:
    """An accepted recipient and the rule that chose its zone (``Route.rule``)."""

    recipient: ReceivedRecipient
    rule: str


class ReceiveHooks:
    """Routing and the receive-time hooks of one receiver; see the module docstring."""

    def __init__(
        self,
        config: Config,
        plugins: PluginHost | None = None,
        *,
        recheck_deadline_s: float = ROUTE_DEADLINE_S,
    ) -> None:
        self.router = Router.from_config(config, plugins)
        self.recheck_deadline_s = recheck_deadline_s
        self.zone_header = config.routing.zone_header.lower()
        self._zone_field = config.routing.zone_header  # as configured, for the metadata
        self._plugins = plugins
        # Looked up once: these run for every message on the accept path.
        live = set() if plugins is None else {hook for hook in Hook if plugins.handles(hook)}
        self.auth_hook = Hook.SMTP_AUTH in live
        self._mail_hook = Hook.SMTP_MAIL_FROM in live
        self._rcpt_hook = Hook.SMTP_RCPT_TO in live
        self._route_hook = Hook.QUEUE_ROUTE in live
        self._headers_hook = Hook.MESSAGE_HEADERS in live

    async def auth(
        self, who: SessionFactory, mechanism: str, username: str, password: str
    ) -> bool | Reply | None:
        """The ``smtp:auth`` plugins' verdict on the credentials; None: no opinion (the
        configured users decide).  A misbehaving plugin gives its 451 reply."""
        if not self.auth_hook:
            return None
        args = AuthArgs(who(), mechanism, username, password)
        try:
            result = await self._call(Hook.SMTP_AUTH, args)
        except PluginFailure as exc:
            return exc.reply
        if result.reply is not None:
            return for_client(result.reply)
        return result.authenticated

    async def mail_from(self, who: SessionFactory, sender: str) -> Reply | None:
        """A plugin's refusal of MAIL FROM, or None to go on."""
        if not self._mail_hook:
            return None
        return await self._refusal(Hook.SMTP_MAIL_FROM, MailFromArgs(who(), sender))

    async def rcpt(
        self,
        who: SessionFactory,
        *,
        sender: str,
        recipient: str,
        client_ip: str,
        trusted: bool,
    ) -> Route | Reply | DroppedRecipient:
        """The recipient's zone (routing rules, then ``queue:route``), a refusal, or a drop
        (in the zone the rules gave); then the ``smtp:rcpt_to`` plugins, told the zone, may
        still refuse it."""
        rules = self.router.decide(recipient, sender=sender, client_ip=client_ip, trusted=trusted)
        try:
            decided = await self.router.consult(
                recipient, rules, sender=sender, session=who() if self._route_hook else None
            )
        except PluginFailure as exc:
            log.error("RCPT %s from %s: %s", recipient, client_ip, exc)
            return exc.reply
        if isinstance(decided, Drop):
            return DroppedRecipient(recipient, decided.zone or rules.zone, decided.reason)
        if isinstance(decided, Reply):
            return for_client(decided)
        if not self._rcpt_hook:
            return decided
        args = RcptToArgs(who(), sender, recipient, decided.zone)
        refusal = await self._refusal(Hook.SMTP_RCPT_TO, args)
        return decided if refusal is None else refusal

    def header_zone(self, fields: Sequence[tuple[str, str]], *, trusted: bool) -> str | None:
        """The zone the routing header names, when it may be honoured: from a trusted
        client, naming a defined zone (the first such field, the one added last).  An
        unknown name is ignored rather than failing the message (``Router.decide``)."""
        if not trusted:
            return None
        for name, value in fields:
            if name.lower() == self.zone_header:
                decided = self.router.decide("", trusted=True, zone_header=value)
                return decided.zone if decided.rule == HEADER else None
        return None

    def routing_field(self, fields: Sequence[tuple[str, str]], *, trusted: bool) -> str | None:
        """The routing header's field name when that header chose the zone (``header_zone``),
        for the message's metadata: delivery removes that field, even once the config names
        another (``MessageMeta.zone_header``)."""
        if self.header_zone(fields, trusted=trusted) is None:
            return None
        return self._zone_field

    async def message(
        self,
        who: SessionFactory,
        *,
        sender: str,
        routed: Sequence[Routed],
        dropped: tuple[DroppedRecipient, ...],
        fields: Sequence[tuple[str, str]],
        trusted: bool,
    ) -> Accepted | Reply:
        """At the final dot: the recipients to queue (moved by a trusted routing header,
        re-checked by ``queue:route``) and the dropped ones (``dropped``, those dropped at
        RCPT, and any the re-check dropped), or one reply refusing the whole message (the
        re-check's, or the ``message:headers`` plugins')."""
        zone = self.header_zone(fields, trusted=trusted)
        if zone is not None and self._route_hook:
            checked = await self._recheck(who, sender, routed, zone)
            if isinstance(checked, Reply):
                return checked
            recipients, more = checked
            if more:
                dropped = (*dropped, *more)
        else:
            recipients = with_header_zone(routed, zone)
        if self._headers_hook and recipients:
            args = MessageHeadersArgs(
                who(), sender, tuple(r.address for r in recipients), tuple(fields)
            )
            refusal = await self._refusal(Hook.MESSAGE_HEADERS, args)
            if refusal is not None:
                return refusal
        return recipients, dropped

    async def _recheck(
        self, who: SessionFactory, sender: str, routed: Sequence[Routed], zone: str
    ) -> Accepted | Reply:
        """The header's zone for the recipients it moves, through the ``queue:route``
        plugins again (see "Re-checking the header's zone" above)."""
        session = who()
        header_route = Route(zone, HEADER)
        asks = [(e.recipient.address, header_route) for e in routed if _moved(e, zone)]
        try:
            verdicts = iter(
                await consult_all(
                    self.router,
                    asks,
                    sender=sender,
                    session=session,
                    deadline_s=self.recheck_deadline_s,
                )
            )
        except PluginFailure as exc:
            log.error("message from %s: %s", session.client_ip, exc)
            return exc.reply
        except RoutingTooSlow as exc:
            log.error("message from %s deferred at the routing header: %s", session.client_ip, exc)
            return LOCAL_ERROR
        recipients: list[ReceivedRecipient] = []
        dropped: list[DroppedRecipient] = []
        refusals: list[Reply] = []
        for entry in routed:
            rcpt = entry.recipient
            if not _moved(entry, zone):
                recipients.append(rcpt)
                continue
            verdict = next(verdicts)
            if isinstance(verdict, Route):
                recipients.append(replace(rcpt, zone=verdict.zone))
            elif isinstance(verdict, Drop):
                dropped.append(DroppedRecipient(rcpt.address, verdict.zone or zone, verdict.reason))
            elif verdict.is_transient:
                log.warning(
                    "message from %s deferred: %s in zone %s (routing header): %s",
                    session.client_ip,
                    rcpt.address,
                    zone,
                    verdict,
                )
                return for_client(verdict)
            else:
                log.warning(
                    "message from %s: %s refused in zone %s (routing header), dropped: %s",
                    session.client_ip,
                    rcpt.address,
                    zone,
                    verdict,
                )
                refusals.append(verdict)
                dropped.append(DroppedRecipient(rcpt.address, zone, str(verdict)))
        if refusals and len(refusals) == len(routed):
            return for_client(refusals[0])  # every recipient refused: the message is
        return recipients, tuple(dropped)

    async def _refusal(self, hook: Hook, args: object) -> Reply | None:
        try:
            result = await self._call(hook, args)
        except PluginFailure as exc:
            return exc.reply
        return None if result.reply is None else for_client(result.reply)

    async def _call(self, hook: Hook, args: object) -> HookResult:
        assert self._plugins is not None  # only called for hooks found live at start
        try:
            return await self._plugins.call(hook, args)
        except PluginFailure as exc:
            log.error("%s", exc)
            raise


def for_client(reply: Reply) -> Reply:
    """A plugin's ``reply`` as it may go to the client: each line's text printable ASCII
    (``_NOT_PRINTABLE``) and cut into lines that fit 512 octets on the wire, at spaces
    where it can be (the multi-line form of RFC 5321 section 4.2.1), at most
    ``_MAX_REPLY_LINES`` of them.  A reply that is already so is returned as it is."""
    # Every line of the wire form carries the code, "-" or " ", the enhanced code and a
    # space (RFC 2034 section 4), and CRLF.
    prefix = 4 if reply.enhanced is None else 5 + len(str(reply.enhanced))
    width = _MAX_REPLY_LINE - prefix - 2
    if len(reply.lines) <= _MAX_REPLY_LINES and all(
        len(line) <= width and not _NOT_PRINTABLE.search(line) for line in reply.lines
    ):
        return reply
    lines: list[str] = []
    for line in reply.lines:
        printable = _NOT_PRINTABLE.sub("?", line)
        lines += textwrap.wrap(printable, width, break_on_hyphens=False) or [printable.strip()]
    return replace(reply, lines=tuple(lines[:_MAX_REPLY_LINES]))


def _moved(entry: Routed, zone: str) -> bool:
    """Whether the header moves ``entry`` to ``zone`` (and so the plugins must judge it
    there): not a plugin's choice, nor already in that zone."""
    return not entry.rule.startswith(_PLUGIN_RULE) and entry.recipient.zone != zone


def with_header_zone(routed: Sequence[Routed], zone: str | None) -> list[ReceivedRecipient]:
    """The recipients, those the rules placed moved to ``zone`` (the header's); a plugin's
    choice ranks above the header (issue 5: "a plugin may override per recipient")."""
    if zone is None:
        return [r.recipient for r in routed]
    return [
        r.recipient if r.rule.startswith(_PLUGIN_RULE) else replace(r.recipient, zone=zone)
        for r in routed
    ]
