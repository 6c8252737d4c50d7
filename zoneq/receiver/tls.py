"""TLS for the receiver: the server's context, STARTTLS (RFC 3207) and implicit TLS (RFC 8314).

The certificate and key come from ``receiver.tls_cert`` / ``receiver.tls_key`` (checked at
config load: the files exist and the pair loads).  TLS 1.2 is the minimum (RFC 8996
deprecates 1.0 and 1.1); the rest is the ``ssl`` module's server defaults, which track
OpenSSL's current cipher and option choices.

Plaintext pipelined behind STARTTLS must never be read as if it had come inside the TLS
session (RFC 3207 section 4.2; the 2011 command-injection bugs, CVE-2011-0411 in Postfix
and its kin).  The state machine drops whatever it had buffered; the bytes the connection
(``connection.Link``) may already hold are dropped here before the handshake starts.

Implicit TLS (``receiver.tls_listen``, RFC 8314 section 3.3, the "submissions" port 465):
the handshake is the first thing on the connection, before the greeting.  The listener is a
plain TCP one and each connection is upgraded here, rather than ``start_server(ssl=...)``,
so that a failed or slow handshake gets our one log line (asyncio's own server is silent
about them outside debug mode) and the server can cancel handshakes in progress when it
closes.  The client's ClientHello may be read before the handshake starts: asyncio runs a
task created in ``connection_made`` before it first reads the socket, but uvloop does not
(it reads a new connection before that task's first step), and ``accept_tls``, that task's
first await, may come after a read.  What the link holds then is TLS, and
``Link.start_tls`` hands it to the TLS layer first.  The handshake is bounded by
``handshake_timeout`` (a client that never sends a ClientHello is dropped, not kept).
"""

from __future__ import annotations

import logging
import ssl
from pathlib import Path
from typing import Final

from zoneq.receiver.connection import Link

__all__ = [
    "HANDSHAKE_TIMEOUT_S",
    "accept_tls",
    "handshake_timeout",
    "server_context",
    "start_tls",
]

log = logging.getLogger("zoneq.receiver")

HANDSHAKE_TIMEOUT_S: Final = 60.0
"""The longest an implicit-TLS handshake may take: asyncio's own default.  A handshake is a
few round trips; a connection still without one after this is a client that will never
send it.  Until then it is not a session counted against ``max_connections_per_client``;
its handshakes in progress are bounded by that number on their own (``server.py``)."""


def handshake_timeout(idle_timeout_s: float) -> float:
    """The implicit-TLS handshake's time limit: never longer than the idle timeout."""
    return min(idle_timeout_s, HANDSHAKE_TIMEOUT_S)


def server_context(cert: Path, key: Path) -> ssl.SSLContext:
    """A server-side context for ``cert`` (a PEM chain) and its ``key``."""
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.minimum_version = ssl.TLSVersion.TLSv1_2
    context.load_cert_chain(cert, key)
    return context


def _reason(exc: BaseException) -> str:
    # Many of these exceptions have no text (EOFError(), a reset by the peer): name the
    # type then, so the log line says why the handshake failed.
    return str(exc) or type(exc).__name__


async def start_tls(link: Link, context: ssl.SSLContext, *, timeout_s: float, peer: str) -> bool:
    """Run the server side of the STARTTLS handshake on ``link``.

    Returns False when it failed (one log line, no traceback: a client that gives up on
    our certificate or speaks no TLS is not our fault); the session must then end.
    """
    try:
        await link.drain()  # the 220 is out; nothing is read from here to the handshake
        dropped = link.discard_buffered()
    except OSError as exc:
        log.info("%s: TLS handshake failed: %s", peer, _reason(exc))
        return False
    if dropped:
        log.info("%s: %d octet(s) pipelined after STARTTLS discarded", peer, dropped)
    return await accept_tls(link, context, timeout_s=timeout_s, peer=peer) is not None


async def accept_tls(
    link: Link, context: ssl.SSLContext, *, timeout_s: float, peer: str
) -> str | None:
    """The server side of a TLS handshake on ``link``, within ``timeout_s``:
    the protocol version agreed (``"TLSv1.3"``), or None when it failed (logged at info
    without a traceback: a plaintext client on the TLS port, or one that rejects our
    certificate, is not a fault of ours).  The caller closes the connection on None."""
    try:
        await link.start_tls(context, timeout_s=timeout_s)
    except (ssl.SSLError, OSError, TimeoutError, RuntimeError, EOFError) as exc:
        log.info("%s: TLS handshake failed: %s", peer, _reason(exc))
        return None
    ssl_object = link.get_extra_info("ssl_object")
    version = ssl_object.version() if isinstance(ssl_object, ssl.SSLObject) else None
    return str(version or "TLS")
