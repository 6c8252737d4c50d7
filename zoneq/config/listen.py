"""Listen addresses (``receiver.listen``, ``receiver.tls_listen``, ``api.listen``).

A listen address is ``host:port`` with an IP literal for the host (``[...]`` around an IPv6
one, as in URLs, RFC 3986 section 3.2.2) or ``localhost``.  A name is refused here rather
than looked up: what it resolves to at start-up is a property of the machine serving, not
of the file, and a typo in it would only show when serve fails to bind.  An unbracketed
IPv6 address is refused too: ``2001:db8::25`` would read as host ``2001:db8:``, port 25.
"""

from __future__ import annotations

import ipaddress
from typing import Annotated, Final

from pydantic import AfterValidator
from pydantic_core import PydanticCustomError

__all__ = ["ListenAddress", "is_host_name", "same_listener", "split_listen"]

_EXAMPLES: Final = "e.g. '127.0.0.1:2525', '0.0.0.0:25' or '[::1]:2525'"

# What each name binds: asyncio's create_server binds every address "localhost" resolves
# to, which on any usual host is both loopbacks.
_NAMED_HOSTS: Final[dict[str, frozenset[str]]] = {"localhost": frozenset({"127.0.0.1", "::1"})}


def split_listen(value: str) -> tuple[str, int]:
    """``"host:port"`` (``"[::1]:25"`` for IPv6) as ``(host, port)``; ``ValueError`` if not."""
    if "://" in value:  # ZONEQ_API=http://127.0.0.1:8025 would read as an IPv6 host
        raise ValueError(
            f"invalid listen address {value!r}: give host:port, not a URL, {_EXAMPLES}"
        )
    host, colon, port_text = value.rpartition(":")
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    if not colon or not host or not port_text.isascii() or not port_text.isdigit():
        raise ValueError(f"invalid listen address {value!r}: expected 'host:port', {_EXAMPLES}")
    if ":" in host and not bracketed:
        raise ValueError(
            f"invalid listen address {value!r}: an IPv6 address goes in brackets and "
            "is followed by a port, e.g. '[2001:db8::25]:25'"
        )
    port = int(port_text)
    if port > 65535:
        raise ValueError(f"invalid listen address {value!r}: port must be 0-65535")
    return host, port


def is_host_name(host: str) -> bool:
    """Whether a valid listen host is a name (``localhost``, this host by definition)
    rather than an IP address, which may or may not be one of this host's."""
    return host.lower().rstrip(".") in _NAMED_HOSTS


def _bound_hosts(host: str) -> frozenset[str]:
    """The addresses ``host`` binds, each in its normal form (``::0`` is ``::``)."""
    named = _NAMED_HOSTS.get(host.lower().rstrip("."))  # "Localhost", "localhost." alike
    if named is not None:
        return named
    return frozenset({str(ipaddress.ip_address(host))})


def _check_listen(value: str) -> str:
    try:
        host, _ = split_listen(value)
        _bound_hosts(host)
    except ValueError as exc:
        reason = str(exc)
        if not reason.startswith("invalid listen address"):
            reason = (
                f"invalid listen address {value!r}: the host must be an IP address "
                f"or 'localhost', {_EXAMPLES}"
            )
        raise PydanticCustomError("listen", "{reason}", {"reason": reason}) from None
    return value


def same_listener(one: tuple[str, int], other: tuple[str, int]) -> bool:
    """Whether two listen addresses would bind the same port (port 0 is always a new one;
    a wildcard host takes the port on every address of its own family only: zoneq binds
    IPv6 sockets with IPV6_V6ONLY, as asyncio's create_server does, so ``[::]`` and
    ``0.0.0.0`` can share a port)."""
    if one[1] != other[1] or one[1] == 0:
        return False
    hosts, others = _bound_hosts(one[0]), _bound_hosts(other[0])
    if hosts & others:
        return True
    return any(
        _version(wild) == _version(host)
        for wilds, rest in ((hosts, others), (others, hosts))
        for wild in wilds & _WILDCARDS
        for host in rest
    )


_WILDCARDS: Final = frozenset({"0.0.0.0", "::"})


def _version(host: str) -> int:
    return ipaddress.ip_address(host).version


ListenAddress = Annotated[str, AfterValidator(_check_listen)]
"""``host:port`` to listen on; ``[::1]:25`` for IPv6; port 0 picks a free port (tests)."""
