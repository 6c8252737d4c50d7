"""STARTTLS for the receiver (RFC 3207): the server's TLS context and the upgrade itself.

The certificate and key come from ``receiver.tls_cert`` / ``receiver.tls_key`` (checked at
config load: the files exist and the pair loads).  TLS 1.2 is the minimum (RFC 8996
deprecates 1.0 and 1.1); the rest is the ``ssl`` module's server defaults, which track
OpenSSL's current cipher and option choices.

Plaintext pipelined behind STARTTLS must never be read as if it had come inside the TLS
session (RFC 3207 section 4.2; the 2011 command-injection bugs, CVE-2011-0411 in Postfix
and its kin).  The state machine drops whatever it had buffered; the bytes asyncio's
``StreamReader`` may already hold are dropped here before the handshake starts.
"""

from __future__ import annotations

import asyncio
import logging
import ssl
from pathlib import Path

__all__ = ["discard_buffered", "server_context", "start_tls"]

log = logging.getLogger("zoneq.receiver")


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """A server-side context for ``cert`` (a PEM chain) and its ``key``."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context


def discard_buffered(reader: asyncio.StreamReader) -> int:
    """Drop the bytes ``reader`` holds unread; returns how many.

    asyncio has no public call for this.  The buffer is ``_buffer`` (a bytearray) in every
    CPython 3.11+ ``StreamReader``; if that ever changes, the upgrade is refused rather
    than risk reading injected plaintext as TLS data.
    """
    buffer = getattr(reader, "_buffer", None)
    if not isinstance(buffer, bytearray):
        raise RuntimeError("cannot clear the StreamReader buffer before STARTTLS")
    dropped = len(buffer)
    buffer.clear()
    return dropped


async def start_tls(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    context: ssl.SSLContext,
    *,
    timeout_s: float,
    peer: str,
) -> bool:
    """Run the server side of the handshake on ``writer``'s connection.

    Returns False when it failed (one log line, no traceback: a client that gives up on
    our certificate or speaks no TLS is not our fault); the session must then end.
    """
    try:
        await writer.drain()  # the 220 is out; nothing is read from here to the handshake
        dropped = discard_buffered(reader)
        if dropped:
            log.info("%s: %d octet(s) pipelined after STARTTLS discarded", peer, dropped)
        await writer.start_tls(context, ssl_handshake_timeout=timeout_s)
    except (ssl.SSLError, OSError, TimeoutError, RuntimeError, EOFError) as exc:
        log.info("%s: TLS handshake failed: %s", peer, exc or type(exc).__name__)
        return False
    return True
