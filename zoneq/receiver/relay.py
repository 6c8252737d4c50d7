"""Who may relay through the receiver, and which addresses nobody may use for relaying.

zoneq has no local mailboxes: every recipient is relayed, so each RCPT is a relay
decision.  Relaying is allowed to clients in ``receiver.allow_networks`` and to clients
that authenticated (RFC 4954 section 7, the submission model of RFC 6409); everyone else
gets 554 5.7.1 at RCPT.

Some addresses ask the next hop to relay further, whoever is sending, and are refused from
every client, so that zoneq never becomes a step in an open-relay chain:

* a source route, ``<@hop1,@hop2:user@example>`` (RFC 5321 section 3.6.1: servers "MAY
  decline ... to accept addresses that specify source routes"; appendix C deprecates
  them).  Following it would deliver to a host the sender chose; dropping it silently
  would deliver somewhere the sender did not ask for.  553 5.7.1, like Postfix's refusal
  of sender-specified routing (``allow_untrusted_routing = no``).
* the percent hack, ``user%other.example@relay.example`` (RFC 5321 section 2.3.11 leaves
  local parts to their domain, and the percent form is that old relay convention):
  550 5.7.1.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable
from typing import Final

from zoneq.protocol.relay_addresses import is_percent_hack
from zoneq.protocol.replies import EnhancedStatus, Reply

__all__ = [
    "PERCENT_HACK",
    "RELAY_DENIED",
    "SOURCE_ROUTE",
    "RelayPolicy",
    "address_refusal",
]

Network = ipaddress.IPv4Network | ipaddress.IPv6Network

RELAY_DENIED: Final = Reply(554, ("Relay access denied",), EnhancedStatus(5, 7, 1))
PERCENT_HACK: Final = Reply(
    550, ("Percent-hack addresses are not accepted",), EnhancedStatus(5, 7, 1)
)
SOURCE_ROUTE: Final = Reply(
    553, ("Source-routed addresses are not accepted",), EnhancedStatus(5, 7, 1)
)


def address_refusal(address: str, route: str | None) -> Reply | None:
    """The refusal for a recipient that asks for relaying beyond us, or None."""
    if route is not None:
        return SOURCE_ROUTE
    if is_percent_hack(address):
        return PERCENT_HACK
    return None


class RelayPolicy:
    """Which client addresses may relay without authenticating."""

    def __init__(self, networks: Iterable[Network]) -> None:
        self._networks = tuple(networks)

    def client_allowed(self, ip: str) -> bool:
        try:
            address = ipaddress.ip_address(ip)
        except ValueError:
            return False
        if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
            address = address.ipv4_mapped  # an IPv4 client on a dual-stack socket
        return any(address in network for network in self._networks)
