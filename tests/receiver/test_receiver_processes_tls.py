"""Implicit TLS (``receiver.tls_listen``, RFC 8314 section 3.3) with ``receiver.processes``.

A real ``zoneq serve`` with two receiver processes: the core binds both listening sockets
and the supervisor hands both to every receiver process (a restarted one too), with the
text of the config the core loaded; each process loads the certificate files itself.  The
parts are real: smtp-sink as the MX and dnsmasq as DNS (``tests/reliability/bed.py``), the
queue on disk, the self-signed certificate of ``conftest.py`` (which the clients verify),
aiosmtplib with ``use_tls`` and a raw TLS client, SIGKILL and SIGSTOP by PID.  Only
127.0.0.1 is allowed to relay, so the TLS client (from 127.0.0.2) relays because it
authenticated; each test stops what it started, by PID.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import signal
import socket
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import aiosmtplib
import pytest

from tests.receiver.conftest import HOSTNAME, TlsFiles, _self_signed
from tests.receiver.harness import Raw
from tests.receiver.processes import ReceiverServe, owner_of, start_receiver_serve
from tests.receiver.test_implicit_tls import (
    PLAIN,
    ehlo_under_tls_from_the_start,
    implicit_tls_client,
    tls_raw,
)
from tests.receiver.test_processes import wait_until
from tests.receiver.test_tls_auth import CLIENT, PASSWORD, USER, USERS, client_context
from tests.reliability.bed import WORKERS, Bed, mail_bed
from tests.support.serve import free_port, smtp_port
from tests.support.smtpsink import SinkMessage

pytestmark = pytest.mark.integration

RECEIVERS = 2
DELIVERY_TIMEOUT = 30.0


@dataclass
class Run:
    bed: Bed
    serve: ReceiverServe
    port: int  # receiver.listen
    tls_port: int  # receiver.tls_listen


@contextlib.contextmanager
def serving(directory: Path, files: TlsFiles) -> Iterator[Run]:
    """``zoneq serve`` with ``RECEIVERS`` receiver processes, all connected to the core,
    listening on a plain port and an implicit-TLS port of 127.0.0.1."""
    tls_port = free_port()
    receiver = {
        "processes": str(RECEIVERS),
        "tls_listen": f'"127.0.0.1:{tls_port}"',
        "tls_cert": f'"{files.cert}"',
        "tls_key": f'"{files.key}"',
        "allow_networks": '["127.0.0.1/32"]',
        "auth_users": f'{{ {USER} = "{USERS[USER]}" }}',
    }
    with mail_bed(directory) as bed:
        config = bed.config(receiver=receiver)
        serve = start_receiver_serve(config, directory / "serve.log")
        try:
            serve.wait_ready(WORKERS + RECEIVERS)
            assert len(serve.receivers()) == RECEIVERS
            yield Run(bed, serve, smtp_port(config), tls_port)
        finally:
            serve.cleanup()


def subject(n: str) -> bytes:
    return f"From: c@src.test\r\nTo: b@ok.test\r\nSubject: {n}\r\n\r\nbody {n}\r\n".encode()


async def send_over_implicit_tls(port: int, files: TlsFiles, name: str) -> str:
    """One message from 127.0.0.2 over implicit TLS, authenticated; the 250's text."""
    smtp = implicit_tls_client(port, files, CLIENT)
    await smtp.connect()
    try:
        await ehlo_under_tls_from_the_start(smtp)
        assert (await smtp.auth_plain(USER, PASSWORD)).code == 235
        errors, reply = await smtp.sendmail("c@src.test", ["b@ok.test"], subject(name))
        assert errors == {}
    finally:
        await smtp.quit()
    return reply


async def send_plain(port: int, name: str) -> str:
    """One message from 127.0.0.1 on ``listen``, no TLS; the 250's text."""
    smtp = aiosmtplib.SMTP(hostname="127.0.0.1", port=port, start_tls=False, timeout=30)
    await smtp.connect()
    try:
        errors, reply = await smtp.sendmail("c@src.test", ["b@ok.test"], subject(name))
        assert errors == {}
    finally:
        await smtp.quit()
    return reply


def by_subject(messages: list[SinkMessage]) -> dict[str, bytes]:
    found = {}
    for message in messages:
        for line in message.content.split(b"\n"):
            if line.startswith(b"Subject: "):
                found[line[len(b"Subject: ") :].decode()] = message.content
    return found


def received_with(content: bytes) -> bytes:
    """The protocol keyword of zoneq's Received field (RFC 3848: ESMTP, ESMTPS, ESMTPSA)."""
    unfolded = content.replace(b"\n ", b" ").replace(b"\n\t", b" ")
    [field] = [x for x in unfolded.split(b"\n") if x.startswith(b"Received:") and b"zoneq" in x]
    words = field.split()
    return words[words.index(b"with") + 1]


def refused(port: int) -> bool:
    """Nothing listens on 127.0.0.1:``port`` any more."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=2):
            return False
    except ConnectionRefusedError:
        return True


def test_implicit_tls_and_plain_through_receiver_processes_and_sigterm_closes_both(
    tmp_path: Path, tls_files: TlsFiles
) -> None:
    """Both listeners take mail in one run and smtp-sink gets it, with TLS shown in the
    Received field; at SIGTERM a session open on the TLS port is told 421 4.3.2 inside TLS
    and neither port accepts afterwards."""
    with serving(tmp_path, tls_files) as run:
        tls_reply = asyncio.run(send_over_implicit_tls(run.tls_port, tls_files, "465"))
        plain_reply = asyncio.run(send_plain(run.port, "25"))
        assert "queued as" in tls_reply and "queued as" in plain_reply
        delivered = by_subject(run.bed.sink.messages(2, timeout=DELIVERY_TIMEOUT))
        assert received_with(delivered["465"]) == b"ESMTPSA"  # TLS and AUTH
        assert received_with(delivered["25"]) == b"ESMTP"
        assert b"body 465" in delivered["465"]

        async def sigterm_during_a_session() -> tuple[str, float]:
            session = await tls_raw(run.tls_port, tls_files)
            try:
                assert (await session.reply()).startswith("220 ")
                assert (await session.cmd("EHLO client.test")).startswith("250-")
                took = asyncio.create_task(asyncio.to_thread(run.serve.terminate))
                bye = await session.reply()
                return bye, await took
            finally:
                await session.close()

        bye, took = asyncio.run(sigterm_during_a_session())
        assert bye.startswith("421 4.3.2 "), bye
        assert took < 20 and run.serve.process.returncode == 0
        assert refused(run.tls_port) and refused(run.port)
        log = run.serve.log_text()
    assert f"accepting SMTP with implicit TLS on 127.0.0.1:{run.tls_port}" in log
    assert log.count(f"accepting implicit TLS on 127.0.0.1:{run.tls_port}") == RECEIVERS
    assert "Traceback" not in log


def test_a_receiver_killed_is_restarted_with_the_implicit_tls_socket(
    tmp_path: Path, tls_files: TlsFiles
) -> None:
    """SIGKILL one receiver process; once the supervisor has restarted it, SIGKILL the
    other one, so that only restarted processes can take the next TLS session (the second
    restart waits its back-off first; holding the other process with SIGSTOP instead does
    not work: the kernel wakes one waiter of a shared listening socket, and can pick the
    stopped one).  The session lands on a restarted process, gets 250, reaches smtp-sink."""
    with serving(tmp_path, tls_files) as run:
        originals = run.serve.receivers()
        victim, other = originals
        name = run.serve.receiver_names()[victim]
        os.kill(victim, signal.SIGKILL)

        def restarted() -> list[int]:
            return [p for p in run.serve.receivers() if p not in originals]

        wait_until("the supervisor restarts the receiver", lambda: bool(restarted()))
        [fresh] = restarted()
        assert run.serve.receiver_names()[fresh] == name
        os.kill(other, signal.SIGKILL)
        # Bounded: if no process accepted, the handshake would wait for a minute.
        owner, reply = asyncio.run(asyncio.wait_for(_one_tls_message(run, tls_files), 20))
        assert owner is not None and owner not in originals, (owner, originals, fresh)
        assert reply.startswith("250 "), reply
        [message] = run.bed.sink.messages(1, timeout=DELIVERY_TIMEOUT)
        assert received_with(message.content) == b"ESMTPSA"
        wait_until("both receivers are back", lambda: len(restarted()) == RECEIVERS)
        assert run.serve.terminate() < 20
        log = run.serve.log_text()
    assert f"receiver {name} (pid {victim}) exited with -9" in log
    assert f"receiver {name} (pid {fresh}) accepting implicit TLS on" in log


async def _one_tls_message(run: Run, files: TlsFiles) -> tuple[int | None, str]:
    """A session on the TLS port: which receiver process holds it, and the reply to its
    message (AUTH first: 127.0.0.2 may not relay otherwise).  The client starts TLS once
    a receiver has accepted the connection, so that the owner is known by then."""
    reader, writer = await asyncio.open_connection(
        "127.0.0.1", run.tls_port, local_addr=(CLIENT, 0)
    )
    session = Raw(reader, writer)
    try:
        client_port = writer.get_extra_info("sockname")[1]
        owner = None
        for _ in range(200):  # 10 s at most
            owner = owner_of(run.serve.receivers(), run.tls_port, client_port)
            if owner is not None:
                break
            await asyncio.sleep(0.05)
        await session.start_tls(client_context(files), HOSTNAME)
        assert (await session.reply()).startswith("220 ")
        assert (await session.cmd("EHLO client.test")).startswith("250-")
        assert (await session.cmd(f"AUTH PLAIN {PLAIN}")).startswith("235 ")
        assert (await session.cmd("MAIL FROM:<c@src.test>")).startswith("250 ")
        assert (await session.cmd("RCPT TO:<b@ok.test>")).startswith("250 ")
        assert (await session.cmd("DATA")).startswith("354 ")
        await session.send(subject("restarted") + b".\r\n")
        reply = await session.reply()
        await session.cmd("QUIT")
        return owner, reply
    finally:
        await session.close()


def restart_every_receiver(run: Run) -> None:
    """SIGKILL each receiver process (by PID) and wait until the supervisor has restarted
    them all."""
    originals = run.serve.receivers()
    for pid in originals:
        os.kill(pid, signal.SIGKILL)

    def restarted() -> list[int]:
        return [p for p in run.serve.receivers() if p not in originals]

    wait_until("every receiver is back", lambda: len(restarted()) == RECEIVERS)


def test_receivers_restarted_after_tls_left_the_file_serve_the_config_serve_loaded(
    tmp_path: Path, tls_files: TlsFiles
) -> None:
    """The operator removes the TLS lines (and the AUTH users, which need TLS) from
    zones.toml under a running core, and every receiver process is restarted: there is no
    reload, so they still serve implicit TLS and AUTH, as the core loaded them.  A
    restarted receiver used to read the file: it could not serve the TLS socket the core
    still held (a client there had no greeting), and zoneq ran two configs at once."""
    with serving(tmp_path, tls_files) as run:
        config = run.serve.config
        kept = [
            line
            for line in config.read_text().splitlines(keepends=True)
            if not line.startswith(("tls_listen ", "tls_cert ", "tls_key ", "auth_users "))
        ]
        config.write_text("".join(kept))
        restart_every_receiver(run)
        # Bounded: with no receiver serving TLS, the handshake would wait for a minute.
        sending = send_over_implicit_tls(run.tls_port, tls_files, "after the edit")
        assert "queued as" in asyncio.run(asyncio.wait_for(sending, 20))
        assert "queued as" in asyncio.run(send_plain(run.port, "plain after the edit"))
        log = run.serve.log_text()
    assert "configuration error" not in log


def test_receivers_restarted_after_the_certificate_was_renewed_serve_the_new_one(
    tmp_path: Path, tls_files: TlsFiles
) -> None:
    """The config is the text the core loaded, but the certificate and key are files that
    each receiver process reads when it starts: new ones put in place under a running core
    reach the receivers restarted since (a client that trusts only the new certificate
    completes its handshake)."""
    live = TlsFiles(tmp_path / "live.crt", tmp_path / "live.key", tls_files.other_key)
    shutil.copy(tls_files.cert, live.cert)
    shutil.copy(tls_files.key, live.key)
    new_cert, new_key = _self_signed(tmp_path, "renewed")
    renewed = TlsFiles(new_cert, new_key, tls_files.other_key)
    with serving(tmp_path, live) as run:
        shutil.copy(new_key, live.key)
        shutil.copy(new_cert, live.cert)
        restart_every_receiver(run)
        sending = send_over_implicit_tls(run.tls_port, renewed, "renewed")
        assert "queued as" in asyncio.run(asyncio.wait_for(sending, 20))
