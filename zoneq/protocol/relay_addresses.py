"""Addresses that ask the next hop to relay further, refused on every way in.

The percent hack, ``user%other.example@relay.example``, is the old convention by which a
relay forwards to the part after the ``%`` (RFC 5321 section 2.3.11 leaves local parts to
their domain; appendix C deprecates the routing forms).  zoneq never takes part in such a
chain: the SMTP receiver (``zoneq.receiver.relay``) and the HTTP API's intake
(``zoneq.queue.intake``) both refuse it, with this one test.
"""

from __future__ import annotations

__all__ = ["is_percent_hack"]


def is_percent_hack(address: str) -> bool:
    """Whether the local part of ``address`` (all of it when it has no ``@``) has a ``%``."""
    local, at, _ = address.rpartition("@")
    return "%" in (local if at else address)
