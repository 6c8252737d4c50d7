"""One form per domain name: the A-label (RFC 5890 section 2.3.2.1), lower case.

A client may name one destination as ``bücher.example`` (a U-label, allowed in an SMTPUTF8
transaction, RFC 6531 section 3.3) or as ``xn--bcher-kva.example`` (its A-label).  They
are one domain: one MX lookup, one connection limit, one set of counts.  Everything that
keys or compares destination domains (the queue's records and counters, routing rules,
``domain_limits``, ``tls_policy``, the admin filters) goes through ``normal_domain`` (or
``a_label`` for configuration, which must refuse a name rather than keep it).

The mapping is IDNA 2008 (RFC 5891) with the UTS 46 mapping (case folding, full-width
dots and letters), non-transitional (``ß`` stays ``ß``, as the browsers and the registries
do now), by the ``idna`` package: the standard library's ``idna`` codec is IDNA 2003, which
maps ``ß`` to ``ss`` and so names another domain.
"""

from __future__ import annotations

import functools
from typing import Final

import idna

__all__ = [
    "EMPTY_LABEL",
    "a_label",
    "ascii_address",
    "bare_domain",
    "has_empty_label",
    "normal_domain",
]


def a_label(domain: str) -> str:
    """``domain`` as lower-case A-labels; ``ValueError`` when IDNA refuses it.

    ASCII is only lower-cased (RFC 5321 section 2.4: domains are case-insensitive): an
    ASCII name needs no mapping, and an ``xn--`` label is kept as written, so a name and
    its A-label meet without a round trip through Unicode.  An address literal
    (``[192.0.2.1]``) is ASCII and so kept too.
    """
    if domain.isascii():
        return domain.lower()
    return _encoded(domain)


def ascii_address(address: str) -> str:
    """``address`` with an ASCII local part at a U-label domain given the domain's A-label
    (RFC 5890 section 2.3.2.1), so it needs no SMTPUTF8; any other address as it is (no
    ``@``, an ASCII domain, or a non-ASCII local part, which has no ASCII form).
    ``ValueError`` when IDNA refuses the domain: each caller decides what that means."""
    local, at, domain = address.rpartition("@")
    if not at or domain.isascii() or not local.isascii():
        return address
    return f"{local}@{a_label(domain)}"


def normal_domain(domain: str) -> str:
    """``a_label``, but a name IDNA refuses stays as given, lower-cased: never raises.

    The queue calls this on addresses it has already accepted (RCPT TO said 250, or the
    API queued the message); refusing now would lose mail, and a name that is not valid
    IDNA names no host, so its delivery fails and bounces in the ordinary way.
    """
    if domain.isascii():  # the per-recipient hot path: no idna call, no cache lookup
        return domain.lower()
    try:
        return _encoded(domain)
    except ValueError:
        pass
    # str.lower and the UTS 46 mapping differ at the edges ("İ"): a refused name may
    # lower-case to one IDNA accepts, and the normal form must be a fixed point.
    lowered = domain.lower()
    try:
        return _encoded(lowered)
    except ValueError:
        return lowered


def bare_domain(domain: str) -> str:
    """``normal_domain`` without the root's dot (``example.com.`` is ``example.com``): the
    form lookups key by (routing, limits, TLS policy, the admin filters).

    The dots go before the mapping too: IDNA refuses ``bücher.test..`` (an empty label), so
    it would be kept as a U-label and only then lose its dots, and a second call would
    encode it; the form must be a fixed point, or a name stored once normalized never
    matches the same name normalized again.  After the mapping too: UTS 46 maps a final
    full stop (``。``) to ``.``."""
    return normal_domain(domain.rstrip(".")).rstrip(".")


EMPTY_LABEL: Final = "empty domain label (a dot at either end, or two in a row)"
"""Why a name with an empty label is refused, in the SMTP receiver's and the API's words."""

# UTS 46 section 4 (as RFC 3490 section 3.1 before it) maps these full stops to ".".
_FULL_STOPS: Final = str.maketrans("\u3002\uff0e\uff61", "...")


def has_empty_label(domain: str) -> bool:
    """Whether a domain name has an empty label: a dot at either end, or two in a row.

    RFC 5321 section 4.1.2: Domain = sub-domain *("." sub-domain), each sub-domain at least
    one character, so ``b.test.`` (the DNS root's dot) is no Domain.  Taken, it would be
    queued as a destination of its own, with its own counters, routing and suppression
    keys, beside ``b.test``.  An address literal (``[192.0.2.1]``, section 4.1.3) has no
    labels.  In a non-ASCII name the full stops IDNA maps to "." separate labels too.
    """
    if domain.startswith("["):
        return False
    if not domain.isascii():
        domain = domain.translate(_FULL_STOPS)
    return domain.startswith(".") or domain.endswith(".") or ".." in domain


# Non-ASCII names are few and repeat (a list message goes to the same few domains); the
# encoding costs tens of microseconds, so it is cached, bounded.  Refusals are not cached
# (lru_cache does not keep exceptions): they are rarer still.
@functools.lru_cache(maxsize=4096)
def _encoded(domain: str) -> str:
    try:
        encoded: bytes = idna.encode(domain, uts46=True)
    except idna.IDNAError as exc:  # a UnicodeError, so a ValueError
        raise ValueError(f"{domain!r} is not a valid domain name (IDNA 2008): {exc}") from None
    return encoded.decode("ascii").lower()
