"""Value types and the base model shared by every configuration module.

They live apart from ``model.py`` so that the section models kept in their own modules
(``zones.py``, ``routing.py``, ``plugins.py``) can use them while ``model.py`` imports those
modules: one direction of import, no cycle.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Final, TypeVar

from pydantic import AfterValidator, BaseModel, BeforeValidator, ByteSize, ConfigDict, Field
from pydantic_core import PydanticCustomError

from zoneq.protocol.domains import a_label, bare_domain
from zoneq.protocol.retry import parse_duration

__all__ = [
    "MAX_DURATION",
    "PROBLEMS_ERROR_TYPE",
    "SIZE_EXPECTED",
    "Duration",
    "EhloName",
    "HostName",
    "Network",
    "NonEmptyPath",
    "Section",
    "Size",
    "SocketPath",
    "TimeLimit",
    "ZoneName",
    "address_literal",
    "domain_keys",
    "domain_lookup",
    "domain_name",
    "problems_error",
    "time_limit_s",
]

_V = TypeVar("_V")

PROBLEMS_ERROR_TYPE: Final = "zoneq_problems"
"""Error type of ``problems_error``; its context holds ``problems``: (relative key, text) pairs."""

_ZONE_NAME: Final = re.compile(r"[A-Za-z0-9_.-]{1,64}")

# RFC 5321 section 4.1.2: the EHLO argument is a domain (letter-digit-hyphen labels) or an
# address literal in brackets.  A name outside that grammar is refused by some receivers,
# so it is cheaper to catch here than in a deferral days later.
_LABEL: Final = r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOST_NAME: Final = re.compile(rf"{_LABEL}(?:\.{_LABEL})*|\[[^\[\]\s]+\]")
_MAX_HOST_NAME: Final = 253


def problems_error(*problems: tuple[tuple[str | int, ...], str]) -> PydanticCustomError:
    """An error for a model-level validator that still names the keys at fault.

    ``problems`` are (key path relative to the model, text) pairs; an int in a path is an
    index into an array.  The loader expands them; anyone reading the raw pydantic error
    still gets a readable summary.
    """
    summary = "; ".join(f"{'.'.join(map(str, key))}: {text}" for key, text in problems)
    return PydanticCustomError(
        PROBLEMS_ERROR_TYPE, "{summary}", {"summary": summary, "problems": problems}
    )


def domain_name(value: str) -> str:
    """A domain (or ``.domain``, every name below it) as the queue keys destinations:
    lower-case A-labels (``zoneq.protocol.domains``), no root dot, so a rule or a limit
    written ``bücher.example`` applies to mail for ``xn--bcher-kva.example`` and back.

    ``ValueError`` for a name IDNA refuses: the queue would keep such a name as given, but
    in the configuration it is a typo to point out, not a destination to match.
    """
    name = value.lower().rstrip(".")
    if name.startswith("*."):
        # Nothing matches a "*" label (DNS wildcards are the zone's business, RFC 4592),
        # so such a key would be kept and never apply: mail meant for TLS-only would go
        # out in plaintext.  Postfix's maps spell "every name below" with a leading dot.
        below = name.removeprefix("*")
        raise ValueError(f"invalid domain {value!r}: write {below!r} for every name below it")
    dot = "." if name.startswith(".") else ""
    try:
        return dot + a_label(name.removeprefix(dot))
    except ValueError as exc:
        raise ValueError(f"invalid domain {value!r}: {exc}") from None


def domain_keys(value: dict[str, _V]) -> dict[str, _V]:
    """A table keyed by domain, its keys as ``domain_name`` gives them.  Each problem names
    its key: a name IDNA refuses, or two keys that are one domain (``Bücher.example`` and
    ``xn--bcher-kva.example``), where which one applied would depend on the file's order."""
    out: dict[str, _V] = {}
    first: dict[str, str] = {}
    problems: list[tuple[tuple[str | int, ...], str]] = []
    for key, item in value.items():
        try:
            name = domain_name(key)
        except ValueError as exc:
            problems.append(((key,), str(exc)))
            continue
        if name in first:
            problems.append(((key,), f"names the same domain as {first[name]!r} ({name})"))
            continue
        first[name] = key
        out[name] = item
    if problems:
        raise problems_error(*problems)
    return out


def domain_lookup(table: Mapping[str, _V], name: str) -> _V | None:
    """The entry for ``name`` in a table whose keys ``domain_keys`` made: the exact name
    first, then the closest parent written with a leading dot (``.example.com`` for
    ``mx.example.com``, never for ``example.com`` itself, as in Postfix's transport and TLS
    policy maps); None when nothing matches (the caller's default applies).  ``name`` is
    put in the keys' normal form first, so a U-label finds its A-label's entry (a record
    queued before domains were normalised has one)."""
    name = bare_domain(name)
    if name in table:
        return table[name]
    labels = name.split(".")
    for start in range(1, len(labels)):
        parent = "." + ".".join(labels[start:])
        if parent in table:
            return table[parent]
    return None


MAX_DURATION: Final = "36500d"
"""The longest duration any key takes: 100 years, an operator's "for ever".  Without a
ceiling, "100000d" passes here and then breaks arithmetic on wall-clock milliseconds (a
retention cut-off before 1970, a packed key that no longer fits its field)."""
MAX_DURATION_MS: Final = parse_duration(MAX_DURATION)


def duration_ceiling_problem(value: str, ms: int) -> str | None:
    """Why ``value`` (``ms`` long) is too long for any key, or None if it is not."""
    if ms <= MAX_DURATION_MS:
        return None
    return f"duration {value.strip()!r} is longer than 100 years: at most {MAX_DURATION!r}"


def _check_duration(value: str) -> str:
    try:
        ms = parse_duration(value)
    except ValueError as exc:
        raise PydanticCustomError("duration", "{reason}", {"reason": str(exc)}) from None
    too_long = duration_ceiling_problem(value, ms)
    if too_long is not None:
        raise PydanticCustomError("duration", "{reason}", {"reason": too_long})
    # parse_duration accepts zero; none of the durations configured here means anything
    # at zero (a zero sweep interval would spin, a zero retention would keep nothing).
    if ms == 0:
        raise PydanticCustomError(
            "duration", "{reason}", {"reason": f"duration must be greater than zero, got {value!r}"}
        )
    return value


# A time limit may be under a second: "500ms" or "0.5s" (or "0.5": seconds), beside every
# form parse_duration takes.  Retry schedules and lifetimes keep whole seconds.
_SUBSECOND: Final = re.compile(r"(?:([0-9]+)ms|([0-9]+\.[0-9]{1,3}|[0-9]*\.[0-9]{1,3})s?)")
MIN_TIME_LIMIT_MS: Final = 100
"""A hook call costs a thread hop and the loop's scheduling; on a loaded machine that is
tens of milliseconds, so a shorter limit would fail healthy plugins at random."""


def time_limit_s(value: str) -> float:
    """A ``TimeLimit`` string in seconds."""
    text = value.strip()
    match = _SUBSECOND.fullmatch(text)
    if match is None:
        return parse_duration(text) / 1000
    millis, seconds = match.groups()
    return int(millis) / 1000 if millis is not None else float(seconds)


def _check_time_limit(value: str) -> str:
    try:
        seconds = time_limit_s(value)
    except ValueError as exc:
        reason = f"{exc}; under a second, write e.g. '500ms' or '0.5s'"
        raise PydanticCustomError("duration", "{reason}", {"reason": reason}) from None
    if seconds * 1000 < MIN_TIME_LIMIT_MS:
        reason = f"time limit {value!r} is too short: at least {MIN_TIME_LIMIT_MS}ms"
        raise PydanticCustomError("duration", "{reason}", {"reason": reason})
    return value


def _check_zone_name(value: str) -> str:
    if not _ZONE_NAME.fullmatch(value):
        reason = f"invalid zone name {value!r}: use 1 to 64 letters, digits, '-', '_' or '.'"
        raise PydanticCustomError("zone_name", "{reason}", {"reason": reason})
    return value


def _check_host_name(value: str) -> str:
    if len(value) > _MAX_HOST_NAME or not _HOST_NAME.fullmatch(value):
        reason = (
            f"invalid host name {value!r}: expected a domain such as 'mx.example.com' "
            "or an address literal such as '[192.0.2.1]'"
        )
        raise PydanticCustomError("host_name", "{reason}", {"reason": reason})
    return value


def address_literal(name: str) -> str | None:
    """The address literal (RFC 5321 section 4.1.3) for ``name`` when it is a bare IP
    address: ``[192.0.2.1]``, ``[IPv6:2001:db8::1]``; None for anything else."""
    try:
        address = ipaddress.ip_address(name)
    except ValueError:
        return None
    return f"[IPv6:{address}]" if address.version == 6 else f"[{address}]"


def _check_ehlo_name(value: str) -> str:
    # RFC 5321 section 4.1.1.1: EHLO takes a domain or an address literal.  A bare address
    # is neither: "EHLO 192.0.2.1" reads as a domain whose labels are all digits, which
    # receivers refuse or score as a forged or non-FQDN HELO.
    literal = address_literal(value)
    if literal is not None:
        reason = (
            f"{value!r} is an IP address, not a host name: write {literal!r} "
            "(an address literal, RFC 5321 section 4.1.3), or a domain"
        )
        raise PydanticCustomError("host_name", "{reason}", {"reason": reason})
    if not value.startswith("[") and value.rstrip(".").rpartition(".")[2].isdigit():
        # "127.1" or "1234": an address in a form ip_address does not take, and no domain
        # either (no top-level domain is all digits, RFC 3696 section 2).
        reason = (
            f"{value!r} is no domain (its last label is all digits): write a domain, or an "
            "address literal such as '[192.0.2.1]' (RFC 5321 section 4.1.3)"
        )
        raise PydanticCustomError("host_name", "{reason}", {"reason": reason})
    return _check_host_name(value)


def _check_network(value: str) -> str:
    try:
        ipaddress.ip_network(value)
    except ValueError as exc:
        reason = f"invalid network {value!r}: {exc} (expected CIDR, e.g. '192.0.2.0/24')"
        raise PydanticCustomError("network", "{reason}", {"reason": reason}) from None
    return value


def _non_empty_path(value: object) -> object:
    # Checked before pydantic makes a Path: Path("") is ".", so an empty string would
    # silently mean "the directory zoneq was started from".
    if isinstance(value, str) and not value.strip():
        raise PydanticCustomError("path", "{reason}", {"reason": "must not be empty"})
    return value


# unix(7): sun_path is 108 bytes, one of them the terminating NUL.
MAX_SOCKET_PATH: Final = 107


def _check_socket_path(value: Path) -> Path:
    # The path is bound as written (a relative one against the working directory, which
    # is the same for the core and its workers), so its own length is what the kernel sees.
    length = len(os.fsencode(value))
    if length > MAX_SOCKET_PATH:
        reason = (
            f"{str(value)!r} is {length} bytes, and a Unix socket path may have at most "
            f"{MAX_SOCKET_PATH} (unix(7)): use a shorter path"
        )
        raise PydanticCustomError("socket_path", "{reason}", {"reason": reason})
    return value


SIZE_EXPECTED: Final = 'an integer number of bytes or a string like "50MiB"'


def _size_input(value: object) -> object:
    # ByteSize would read true as 1 and 1000.0 as 1000, and say only "could not parse
    # value and unit" of 1000.7; TOML has integers, so a size is one or a string.
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise PydanticCustomError("size", "expected {expected}", {"expected": SIZE_EXPECTED})
    # ByteSize refuses a negative integer as unparsable, and "expected an integer" would
    # then be said of an integer.
    if isinstance(value, int) and value < 0:
        raise PydanticCustomError(
            "size_negative", "must be 0 or more, got integer {value}", {"value": value}
        )
    return value


Duration = Annotated[str, AfterValidator(_check_duration)]
"""A positive duration in ``parse_duration`` syntax: ``"90"`` (seconds), ``"15m"``, ``"1h30m"``."""

TimeLimit = Annotated[str, AfterValidator(_check_time_limit)]
"""A ``Duration``, or under a second (``"500ms"``, ``"0.5s"``), at least 100 ms."""

ZoneName = Annotated[str, AfterValidator(_check_zone_name)]
"""1..64 of letters, digits, ``-``, ``_``, ``.``: safe in log lines, metrics labels and keys."""

HostName = Annotated[str, AfterValidator(_check_host_name)]
"""A name usable as our EHLO argument: a domain or a bracketed address literal."""

EhloName = Annotated[str, AfterValidator(_check_ehlo_name)]
"""A name zoneq gives itself in EHLO: a ``HostName`` that is not a bare IP address."""

Network = Annotated[str, AfterValidator(_check_network)]
"""An IP network in CIDR notation, host bits zero: ``"192.0.2.0/24"``, ``"::1/128"``."""

# Not strict: TOML has no path type, so a path arrives as a string.
NonEmptyPath = Annotated[Path, BeforeValidator(_non_empty_path), Field(strict=False)]
"""A file or directory path; relative ones are relative to the working directory."""

SocketPath = Annotated[NonEmptyPath, AfterValidator(_check_socket_path)]
"""A ``NonEmptyPath`` short enough to bind a Unix socket to."""

Size = Annotated[ByteSize, BeforeValidator(_size_input)]
"""A size in bytes: an integer, or a string with a unit (``"64MiB"``, ``"1GB"``)."""


class Section(BaseModel):
    """Shared settings: unknown keys refused, values immutable, no type coercion."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True)
