"""Routing: which sending zone each recipient is queued in.

Theory of operation
-------------------
The rules of ``[routing]`` are tried by kind, in a fixed order (issue 5), and the first
that matches decides:

1. the routing header (``routing.zone_header``, ``X-Sending-Zone``) naming a defined zone,
   honoured only when the caller says the client is trusted (authenticated, or in
   ``receiver.allow_networks``): anyone else could pick the zone with the best reputation;
2. the envelope sender's domain (``sender_domain`` rules);
3. the recipient's domain (``recipient_domain`` rules);
4. the client's address (``client_network`` rules);
5. ``routing.default_zone``.

Within one kind, rules are tried in the order of the file.  A domain rule ``example.com``
matches that domain only; ``.example.com`` every domain below it (Postfix's transport map
convention).  Domains compare case-insensitively (RFC 5321 section 2.4), a trailing dot
ignored, and a U-label is its A-label (``zoneq.protocol.domains``), in the rules and in
the addresses alike.  Then a ``queue:route`` plugin may override the zone per recipient,
refuse the recipient with its own reply, or drop it (``Router.route``).  ``Router.consult`` is that
plugin step alone, for a decision made elsewhere: the receiver reads the routing header
only at the final dot, and puts the recipients it moves through the plugins again there.

``decide`` is pure and synchronous: the receiver calls it at RCPT without awaiting.
Removing the header before delivery is the receiver's job, once it reads headers.
"""

from __future__ import annotations

import functools
import ipaddress
from collections.abc import Collection
from dataclasses import dataclass
from typing import Final

from zoneq.config.model import Config, RoutingConfig
from zoneq.config.routing import RoutingRule
from zoneq.plugin.hooks import Drop, Hook, RouteArgs, Session
from zoneq.plugin.host import PluginHost
from zoneq.protocol.domains import bare_domain
from zoneq.protocol.replies import Reply

__all__ = ["DEFAULT", "HEADER", "Route", "Router"]

IpNetwork = ipaddress.IPv4Network | ipaddress.IPv6Network

HEADER: Final = "header"
DEFAULT: Final = "default"


@dataclass(frozen=True, slots=True)
class Route:
    """A routing decision: the zone, and which rule chose it (for logs and events)."""

    zone: str
    rule: str
    """``header``, ``sender_domain``, ``recipient_domain``, ``client_network``, ``default``,
    or ``plugin:<name>`` for a ``queue:route`` override."""


def _domain_of(address: str) -> str | None:
    """The domain of ``local@domain`` in the queue's normal form (lower-case A-labels, as
    the rules are kept), no trailing dot; None for ``<>`` or a bare local part
    (``postmaster``, RFC 5321 section 4.5.1)."""
    _local, at, domain = address.rpartition("@")
    if not at or not domain:
        return None
    return bare_domain(domain)


@dataclass(frozen=True, slots=True)
class _DomainRule:
    exact: frozenset[str]
    suffixes: tuple[str, ...]  # ".example.com" patterns, dot included
    zone: str

    @classmethod
    def of(cls, patterns: list[str], zone: str) -> _DomainRule:
        exact = frozenset(p for p in patterns if not p.startswith("."))
        suffixes = tuple(p for p in patterns if p.startswith("."))
        return cls(exact, suffixes, zone)

    def matches(self, domain: str) -> bool:
        return domain in self.exact or domain.endswith(self.suffixes)


@dataclass(frozen=True, slots=True)
class _NetworkRule:
    networks: tuple[IpNetwork, ...]
    zone: str

    def matches(self, address: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        return any(address in network for network in self.networks)


class Router:
    """The routing rules of one config, compiled once; see the module docstring."""

    def __init__(
        self,
        routing: RoutingConfig,
        zones: Collection[str],
        plugins: PluginHost | None = None,
    ) -> None:
        self._default = routing.default_zone
        self._zones = frozenset(zones)
        self._plugins = plugins
        rules: list[RoutingRule] = routing.rules
        self._sender = tuple(
            _DomainRule.of(r.sender_domain, r.zone) for r in rules if r.sender_domain
        )
        self._recipient = tuple(
            _DomainRule.of(r.recipient_domain, r.zone) for r in rules if r.recipient_domain
        )
        self._client = tuple(
            _NetworkRule(tuple(ipaddress.ip_network(n) for n in r.client_network), r.zone)
            for r in rules
            if r.client_network
        )

    @classmethod
    def from_config(cls, config: Config, plugins: PluginHost | None = None) -> Router:
        return cls(config.routing, config.zones, plugins)

    def decide(
        self,
        recipient: str,
        *,
        sender: str | None = None,
        client_ip: str | None = None,
        trusted: bool = False,
        zone_header: str | None = None,
    ) -> Route:
        """The zone the rules give ``recipient`` (no plugins)."""
        if trusted and zone_header is not None:
            # An unknown zone in the header falls through to the rules rather than failing
            # the message: the sender's mistake should not cost them the mail.
            named = zone_header.strip()
            if named in self._zones:
                return Route(named, HEADER)
        sender_domain = _domain_of(sender) if sender else None
        if sender_domain is not None:
            for rule in self._sender:
                if rule.matches(sender_domain):
                    return Route(rule.zone, "sender_domain")
        recipient_domain = _domain_of(recipient)
        if recipient_domain is not None:
            for rule in self._recipient:
                if rule.matches(recipient_domain):
                    return Route(rule.zone, "recipient_domain")
        client = _parse_ip(client_ip)
        if client is not None:
            for net_rule in self._client:
                if net_rule.matches(client):
                    return Route(net_rule.zone, "client_network")
        return Route(self._default, DEFAULT)

    async def route(
        self,
        recipient: str,
        *,
        sender: str = "",
        client_ip: str | None = None,
        trusted: bool = False,
        zone_header: str | None = None,
        session: Session | None = None,
    ) -> Route | Reply | Drop:
        """``decide``, then the ``queue:route`` plugins: a zone, a refusal, or a drop.

        Raises ``PluginFailure`` when a plugin misbehaves; the caller answers 451 4.3.0.
        """
        decided = self.decide(
            recipient,
            sender=sender,
            client_ip=client_ip,
            trusted=trusted,
            zone_header=zone_header,
        )
        return await self.consult(recipient, decided, sender=sender, session=session)

    async def consult(
        self,
        recipient: str,
        decided: Route,
        *,
        sender: str = "",
        session: Session | None = None,
    ) -> Route | Reply | Drop:
        """The ``queue:route`` plugins' verdict on ``decided``: it, another zone, a refusal
        or a drop.  Raises ``PluginFailure`` when a plugin misbehaves."""
        if self._plugins is None or not self._plugins.handles(Hook.QUEUE_ROUTE):
            return decided
        args = RouteArgs(sender, recipient, decided.zone, decided.rule, session)
        result = await self._plugins.call(Hook.QUEUE_ROUTE, args)
        if result.reply is not None:
            return result.reply
        if result.drop is not None:
            return result.drop
        if result.zone is not None:
            return Route(result.zone, f"plugin:{result.plugin}")
        return decided


# Called for every recipient with the session's client address: parsing it with
# ipaddress each time was about 4.6% of the core's CPU per accepted message (py-spy under
# tools/bench/accept_bench.py).  Few distinct clients send at once; the cache is bounded.
@functools.lru_cache(maxsize=4096)
def _parse_ip(text: str | None) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    if not text:
        return None
    try:
        address = ipaddress.ip_address(text)
    except ValueError:
        return None
    # An IPv4 client seen through an IPv6 socket (::ffff:192.0.2.1) is the IPv4 client.
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address
