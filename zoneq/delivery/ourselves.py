"""The addresses this MTA is known by, for the MX loop check (``mx.py``).

RFC 5321 section 5.1: the relay "MUST then inspect the list for any of the names or
addresses by which it might be known in mail transactions".  Ours are the addresses the
SMTP receiver listens on (``listen`` and ``tls_listen``), the zones' source addresses
(``pool``: this machine's, whatever listens there), and, when a listener is a wildcard
(``0.0.0.0``, ``::``), every address of every interface, since mail to any of them reaches
the receiver.  Postfix does the same with ``inet_interfaces`` and ``proxy_interfaces``: mail
whose MX is one of them "loops back to myself" (5.4.6), without a connection.

Loopback addresses are ours anyway unless ``allow_loopback_mx`` is set, which is how the
tests point MX records at their sinks on 127.0.0.x.  Even then a loopback address the
receiver listens on *at the port delivery connects to* (``mx_port``) is ours: connecting
there reaches our own receiver.  A loopback listener on another port, or a loopback pool
address, is not (the test sink on 127.0.0.1 at its own port is someone else); a wildcard
listener at ``mx_port`` makes all of loopback ours again.

The interface list comes from psutil (``net_if_addrs``): the standard library has no call
that lists a machine's addresses.  Where the list cannot be had (getifaddrs refused, EPERM
in a locked-down container), one warning is logged and the listener and pool addresses
stand alone: a worker that died at start on it would deliver nothing at all, while the
unspecified address and (unless allowed) loopback stay a loop anyway (``mx.py``).
"""

from __future__ import annotations

import ipaddress
import logging
import socket
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import psutil

from zoneq.config import Config

__all__ = ["Ourselves", "ourselves"]

log = logging.getLogger("zoneq.delivery")


class _IfAddr(Protocol):
    @property
    def family(self) -> int: ...
    @property
    def address(self) -> str: ...


Interfaces = Callable[[], Mapping[str, Sequence[_IfAddr]]]
"""``psutil.net_if_addrs``, or a stand-in with the same shape."""


@dataclass(frozen=True, slots=True)
class Ourselves:
    """What ``MxResolver`` is given: our addresses, and whether loopback may be an MX."""

    addresses: frozenset[str]
    allow_loopback: bool


def ourselves(config: Config, interfaces: Interfaces = psutil.net_if_addrs) -> Ourselves:
    """Our addresses for the loop check, from the receiver's listeners and the pools."""
    delivery_port = config.delivery.mx_port
    allow_loopback = config.delivery.allow_loopback_mx
    receiver = config.receiver
    listeners = [receiver.listen_address]
    if receiver.tls_listen_address is not None:
        listeners.append(receiver.tls_listen_address)
    # A listener named by a host name has nothing to compare an MX address with.
    bound = [(ip, port) for host, port in listeners if (ip := _ip(host)) is not None]
    found: set[str] = set()
    wildcard: set[int] = set()  # the families a wildcard listener takes
    for ip, port in bound:
        if ip.is_unspecified:
            # "::" takes IPv4 too on a dual-stack machine (the Linux default).
            wildcard |= {socket.AF_INET} if ip.version == 4 else {socket.AF_INET, socket.AF_INET6}
            allow_loopback = allow_loopback and port != delivery_port
        else:
            found.add(str(ip))
    if wildcard:  # asked once, so a failure is one warning
        found |= _listed(wildcard, interfaces)
    for zone in config.zones.values():
        found.update(entry.address for entry in zone.pool)
    if allow_loopback:
        at_port = {str(ip) for ip, port in bound if port == delivery_port}
        found = {a for a in found if a in at_port or not ipaddress.ip_address(a).is_loopback}
    return Ourselves(frozenset(found), allow_loopback)


def _listed(families: Iterable[int], interfaces: Interfaces) -> set[str]:
    """Every address of every interface, of the given families (``socket.AF_INET`` ...),
    IPv6 zone indexes (``fe80::1%eth0``) dropped: the MX answer carries none.  None (with
    a warning) when the system will not say."""
    wanted = set(families)
    found: set[str] = set()
    try:
        for entries in interfaces().values():
            for entry in entries:
                if entry.family in wanted:
                    found.add(entry.address.partition("%")[0])
    except (OSError, psutil.Error) as exc:
        log.warning(
            "cannot list this host's interface addresses for the MX loop check (%s); "
            "using the listener and pool addresses only",
            exc,
        )
        return set()
    return found


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None
