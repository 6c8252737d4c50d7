"""``zoneq receiver``: one SMTP receiver process of ``receiver.processes`` (started by serve).

Why processes: one event loop serving SMTP sessions is bound by its own thread (the
receiver's work per message is mostly the event loop's and the replies' send calls, seven
per message from a client that does not pipeline), so a single process accepts at most
about 1 / (CPU per message).  Several processes accepting on one listening socket spread
the sessions over the cores; the queue stays in the core, which each receiver reaches
through the socket the supervisor handed it (``zoneq.ipc.intake_client``).

With ``receiver.tls_listen`` the core binds the implicit-TLS socket too (RFC 8314 section
3.3, port 465) and every receiver process is handed both; each loads the certificate from
``tls_cert`` and ``tls_key`` itself, so a restarted receiver also picks up a renewed one.

The process runs the same ``SmtpReceiver`` as the core would, with ``IntakeClient`` as its
sink, until SIGTERM (it then stops accepting on both, answers 421 4.3.2 to new commands and lets
commits in flight finish, as the in-core receiver does) or until the core's socket closes
(the core died: sessions get 421 4.3.0 and the process exits 1, releasing the listening
socket, so a restarted core can bind its port again).  Its clock reads the wall clock for
the Received field and the message's arrival time, as the core's does.  It loads the
plugins itself: the receive-time hooks and ``queue:route`` run where the sessions are.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import time

import uvloop

from zoneq.config.model import Config
from zoneq.ipc.intake_client import IntakeClient
from zoneq.plugin import PluginHost
from zoneq.receiver.server import SmtpReceiver

__all__ = ["main", "run"]

log = logging.getLogger("zoneq.receiver")


def now_ms() -> int:
    return time.time_ns() // 1_000_000


def main(
    config: Config, name: str, listen_fd: int, intake_fd: int, tls_listen_fd: int | None = None
) -> int:
    """On uvloop, as the core runs (most of a receiver's CPU is event-loop work)."""
    # It follows the core's lifecycle: the core ignores SIGHUP (no reload), and a hangup of
    # the terminal reaches the whole process group.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    return uvloop.run(run(config, name, listen_fd, intake_fd, tls_listen_fd))


async def run(
    config: Config, name: str, listen_fd: int, intake_fd: int, tls_listen_fd: int | None = None
) -> int:
    """Accept on ``listen_fd`` (and implicit TLS on ``tls_listen_fd``) into the core at
    ``intake_fd`` until SIGTERM (exit 0) or the core goes away (exit 1)."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, stop.set)
    sink = await IntakeClient.from_fd(intake_fd, name)
    listener = _listener(listen_fd)
    tls_listener = None if tls_listen_fd is None else _listener(tls_listen_fd)
    # Its own plugins (the receive hooks run here, in this process), closed on the way out.
    plugins = PluginHost.from_config(config)
    receiver = SmtpReceiver(sink, config, clock=now_ms, plugins=plugins)
    await receiver.start(listener, tls_listener)
    log.info("receiver %s (pid %d) accepting on %s", name, os.getpid(), config.receiver.listen)
    if tls_listener is not None:
        where = config.receiver.tls_listen
        log.info("receiver %s (pid %d) accepting implicit TLS on %s", name, os.getpid(), where)
    stopped = asyncio.ensure_future(stop.wait())
    lost = asyncio.ensure_future(sink.lost.wait())
    try:
        await asyncio.wait((stopped, lost), return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        lost.cancel()
        await receiver.close()
        await sink.close()
        await plugins.close()
    if sink.lost.is_set() and not stop.is_set():
        log.error("receiver %s: the core is gone; exiting", name)
        return 1
    return 0


def _listener(fd: int) -> socket.socket:
    """The listening socket the core bound and passed down as ``fd`` (``pass_fds``)."""
    listener = socket.socket(fileno=fd)
    listener.setblocking(False)
    return listener
