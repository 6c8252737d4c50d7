"""Per-zone sending settings (source address pool, rate, smarthost) and per-destination limits.

The models here describe; they check only what a value says on its own (an address is an
address, a rate is not zero).  Whether a pool address is one of this host's is a question
for the machine, asked by the loader (``zoneq.config.loader``) with a bind to port 0.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Annotated, Final, Literal, Self

from pydantic import AfterValidator, Field, model_validator
from pydantic_core import PydanticCustomError

from zoneq.config.types import (
    EhloName,
    HostName,
    Section,
    domain_keys,
    domain_lookup,
    problems_error,
)

__all__ = [
    "ConnectionLimits",
    "IpAddress",
    "Pool",
    "PoolAddress",
    "Rate",
    "Smarthost",
    "SmarthostAuth",
    "limit_for",
    "parse_rate",
]

# "per" words an operator may write after the slash, and their length in milliseconds.
_UNITS: Final[dict[str, int]] = {
    "s": 1000,
    "sec": 1000,
    "second": 1000,
    "m": 60_000,
    "min": 60_000,
    "minute": 60_000,
    "h": 3_600_000,
    "hour": 3_600_000,
}
_RATE: Final = re.compile(r"\s*(\d{1,9})\s*/\s*([a-z]+)\s*")


MAX_RATE_PER_S = 1_000_000


def parse_rate(text: str) -> tuple[int, int]:
    """``"100/s"`` -> ``(100, 1000)``: a count and the period it is spread over, in ms.

    Raises ``ValueError`` for anything else, including a count of zero: a zone that may
    never send would hold its mail until it expires, which nobody means to configure
    (leave ``rate`` out for no limit).
    """
    match = _RATE.fullmatch(text.lower())
    if match is None or match[2] not in _UNITS:
        raise ValueError(
            f"invalid rate {text!r}: expected a count per second, minute or hour, "
            "such as '100/s', '6000/min' or '20000/h'"
        )
    count = int(match[1])
    if count == 0:
        raise ValueError(
            f"a rate of zero ({text!r}) would never send: leave the key out for no limit"
        )
    per_ms = _UNITS[match[2]]
    if count * 1000 > MAX_RATE_PER_S * per_ms:
        # Past this the limiter's spacing falls below what a float of wall-clock
        # milliseconds can add, and the limit would quietly do nothing.
        raise ValueError(
            f"a rate of {text!r} is more than {MAX_RATE_PER_S:,}/s: leave the key out for no limit"
        )
    return count, per_ms


def _check_rate(value: str) -> str:
    try:
        parse_rate(value)
    except ValueError as exc:
        raise PydanticCustomError("rate", "{reason}", {"reason": str(exc)}) from None
    return value


def _check_ip(value: str) -> str:
    try:
        ipaddress.ip_address(value)
    except ValueError:
        reason = f"invalid IP address {value!r}: expected e.g. '192.0.2.10' or '2001:db8::10'"
        raise PydanticCustomError("ip_address", "{reason}", {"reason": reason}) from None
    return value


Rate = Annotated[str, AfterValidator(_check_rate)]
"""Deliveries (SMTP transactions) per second, minute or hour: ``"100/s"``, ``"6000/min"``."""

IpAddress = Annotated[str, AfterValidator(_check_ip)]
"""One IPv4 or IPv6 address, without a prefix length."""

ConnectionLimits = Annotated[
    # DNS names compare case-insensitively (RFC 4343), a trailing dot is the same name, and
    # a U-label is its A-label (RFC 5890): one key per destination (``domain_keys``).
    dict[str, Annotated[int, Field(ge=1, le=10_000)]],
    AfterValidator(domain_keys),
]
"""Connections at once per name: ``{"gmail.com" = 20, ".google.com" = 40}``.  A key with a
leading dot matches every name below it (Postfix's transport map convention)."""


def limit_for(limits: dict[str, int], name: str) -> int | None:
    """The limit for ``name`` in ``limits`` (``domain_lookup``: the exact name, then the
    closest ``.parent``); None when nothing matches (the caller's default applies)."""
    return domain_lookup(limits, name)


class PoolAddress(Section):
    """``[[zones.<name>.pool]]``: one local address the zone's connections may bind to."""

    address: IpAddress
    """A local address of this host (checked at start-up with a bind to port 0)."""

    ehlo_name: EhloName | None = None
    """EHLO name to use from this address (it should be the address's PTR name: receivers
    compare them, RFC 5321 section 4.1.4 notwithstanding); None: the zone's own."""

    # A float field takes TOML's 1 as well as 1.0, even in strict mode; a string it refuses.
    ratio: Annotated[float, Field(gt=0, le=1_000_000)] = 1.0
    """Share of the zone's connections, relative to the other addresses of the pool (warm-up
    of a new address: give it a small ratio and raise it over the weeks)."""


class SmarthostAuth(Section):
    """``[zones.<name>.smarthost.auth]``: SMTP AUTH (RFC 4954) credentials for the smarthost."""

    username: Annotated[str, Field(min_length=1)]
    password: Annotated[str, Field(min_length=1)]


class Smarthost(Section):
    """``[zones.<name>.smarthost]``: relay all of the zone's mail through one host instead of
    the recipients' MX hosts."""

    host: HostName
    """The relay's host name or a bracketed address literal such as ``[192.0.2.25]``."""

    port: Annotated[int, Field(ge=1, le=65535)] = 587
    """587 is the submission port (RFC 6409); 465 with ``tls = "implicit"`` (RFC 8314)."""

    tls: Literal["required", "opportunistic", "implicit", "none"] = "required"
    """STARTTLS required (defer without it), opportunistic, TLS from the first byte
    (``implicit``), or never; credentials are never sent without TLS unless ``none``."""

    auth: SmarthostAuth | None = None

    @model_validator(mode="after")
    def _check_port(self) -> Self:
        # RFC 8314 section 3.3: 465 is implicit TLS; a STARTTLS client there hangs waiting for
        # a greeting the server will only send inside TLS.
        if self.port == 465 and self.tls in ("required", "opportunistic"):
            text = 'port 465 is implicit TLS (RFC 8314): set tls = "implicit"'
            raise problems_error((("tls",), text))
        return self


def _unique_addresses(pool: list[PoolAddress]) -> list[PoolAddress]:
    seen: set[ipaddress.IPv4Address | ipaddress.IPv6Address] = set()
    for index, entry in enumerate(pool):
        address = ipaddress.ip_address(entry.address)
        if address in seen:
            text = f"address {entry.address} is already in this pool; raise its ratio instead"
            raise problems_error(((index, "address"), text))
        seen.add(address)
    return pool


Pool = Annotated[list[PoolAddress], AfterValidator(_unique_addresses)]
"""A zone's source addresses; empty: the operating system picks one per connection."""
