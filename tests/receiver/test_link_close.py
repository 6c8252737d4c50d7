"""``Link.wait_closed`` with a time limit, and the receiver's relay decision per address.

``wait_closed(timeout_s=...)`` bounds how long a session's end waits for its socket to
close: a client that reads nothing keeps a closing transport open (its replies are still
queued), and the wait must end after the limit all the same; a connection that closes
ends it at once.  ``SmtpReceiver.may_relay`` remembers ``RelayPolicy``'s answer per client
address: it must give the policy's answer every time, the first and the later ones.
A write to a connection the client reset is a lost client, on uvloop too, never an error
logged as ours.
"""

from __future__ import annotations

import asyncio
import gc
import logging
import socket
import struct
import time
from pathlib import Path

import pytest

from tests.receiver.harness import Raw, run
from tests.receiver.test_connection import _linked  # a Link server and a raw client
from zoneq.receiver import SmtpReceiver
from zoneq.receiver.relay import RelayPolicy
from zoneq.storage.store import QueueStore

TIMEOUT = 20.0
CLIENTS = 20  # the reset races the reply's write: a few tries make it sure


def test_wait_closed_gives_up_after_its_time_limit_while_the_client_reads_nothing() -> None:
    async def main() -> None:
        async with _linked() as (link, _client):  # the client reads nothing
            # Far more than the socket buffers hold: the transport keeps the rest queued,
            # and a closing transport stays open until it has written it all.
            link.write(b"x" * 20_000_000)
            assert link.write_buffer_size() > 0
            link.close()
            started = time.monotonic()
            await asyncio.wait_for(link.wait_closed(timeout_s=0.3), TIMEOUT)
            waited = time.monotonic() - started
            assert 0.25 <= waited < 5.0, waited
            assert not link._lost  # given up on, not closed
            # Settled for good: a second wait does not wait again.
            started = time.monotonic()
            await asyncio.wait_for(link.wait_closed(timeout_s=10.0), TIMEOUT)
            assert time.monotonic() - started < 1.0

    asyncio.run(main())


def test_wait_closed_ends_as_soon_as_the_connection_closes() -> None:
    async def main() -> None:
        async with _linked() as (link, _client):
            link.close()
            started = time.monotonic()
            await asyncio.wait_for(link.wait_closed(timeout_s=30.0), TIMEOUT)
            assert time.monotonic() - started < 5.0
            assert link._lost
            await link.wait_closed(timeout_s=30.0)  # closed: returns at once

    asyncio.run(main())


NETWORKS = ["127.0.0.0/8", "10.1.0.0/16", "2001:db8::/32"]
ADDRESSES = [
    ("127.0.0.1", True),
    ("127.9.9.9", True),
    ("10.1.200.3", True),
    ("10.2.0.1", False),
    ("192.0.2.7", False),
    ("2001:db8::1", True),
    ("2001:db9::1", False),
    ("::ffff:10.1.0.9", True),  # an IPv4 client on a dual-stack socket
    ("::ffff:192.0.2.7", False),
    ("", False),  # no peer address (a closed socket): never relays
    ("not-an-address", False),
]


def test_may_relay_gives_the_policys_answer_every_time(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, _store: QueueStore) -> None:
        policy = RelayPolicy(rx.config.receiver.networks)
        for _ in range(3):  # the first answer, then the remembered ones
            for ip, allowed in ADDRESSES:
                assert policy.client_allowed(ip) is allowed, ip
                assert rx.may_relay(ip) is allowed, ip

    run(tmp_path, body, allow_networks=NETWORKS)


def test_a_client_that_resets_after_the_final_dot_ends_its_session_quietly(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """Reset (SO_LINGER 0) with the message's 250 still to write: on uvloop, a write to
    the reset transport raised RuntimeError, which escaped the session as a task's
    "exception was never retrieved" at ERROR.  A lost client is a normal end."""

    async def body(rx: SmtpReceiver, _store: QueueStore) -> None:
        for _ in range(CLIENTS):
            raw = await Raw.connect(rx.port)
            await raw.start(rcpt="d@ok.test")
            sock = raw.writer.get_extra_info("socket")
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            await raw.send(b"Subject: x\r\n\r\nbody\r\n.\r\nQUIT\r\n")
            raw.writer.transport.abort()  # an RST, at once
        await asyncio.sleep(0.5)  # the sessions' ends
        gc.collect()  # a failed task's error is logged when it is collected

    with caplog.at_level(logging.WARNING):
        run(tmp_path, body, on_uvloop=True)
        gc.collect()
    errors = [r.getMessage() for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == []
