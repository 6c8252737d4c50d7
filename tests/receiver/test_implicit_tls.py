"""Implicit TLS on the receiver (``receiver.tls_listen``, RFC 8314 section 3.3).

The receiver runs on a real queue (``harness.py``) with a second listener that speaks TLS
from the first byte; the clients are aiosmtplib (``use_tls``), swaks
(``--tls-on-connect``) and raw sockets.  The certificate is made by openssl for this test
session (``conftest.py``) and the clients verify it.  Clients connect from 127.0.0.2, which
is outside ``allow_networks``, so they may relay only once authenticated.  The last tests
run a real ``zoneq serve`` (on uvloop) with the listener, delivering to smtp-sink.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import aiosmtplib
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.receiver.conftest import HOSTNAME, TlsFiles
from tests.receiver.harness import (
    MESSAGE,
    Raw,
    make_config,
    nothing_left,
    queued_id,
    run,
    split_received,
    stored_body,
    swaks,
)
from tests.receiver.test_tls_auth import CLIENT, PASSWORD, USER, client_context, tls_options
from tests.reliability.bed import WORKERS, Bed, mail_bed
from tests.support.serve import free_port, start_serve
from tests.support.testbed import missing
from zoneq.config import check_config
from zoneq.receiver import SmtpReceiver
from zoneq.storage.store import QueueStore

LISTEN_TLS = {"tls_listen": "127.0.0.1:0"}
PLAIN = base64.b64encode(f"\0{USER}\0{PASSWORD}".encode()).decode()


def implicit_options(files: TlsFiles, **extra: Any) -> dict[str, Any]:
    """The STARTTLS tests' receiver, plus an implicit-TLS listener on a free port."""
    return tls_options(files, **LISTEN_TLS, **extra)


async def closed(raw: Raw, timeout: float) -> bool:
    """Whether the server closes ``raw``'s connection within ``timeout`` without a word.  A
    reset counts: a server that closes with our bytes unread in its buffer sends RST."""
    try:
        return await asyncio.wait_for(raw.reader.read(1), timeout) == b""
    except ConnectionResetError:
        return True


async def tls_raw(port: int, files: TlsFiles, source: str = CLIENT) -> Raw:
    """A raw client that does the TLS handshake as soon as it is connected."""
    reader, writer = await asyncio.open_connection(
        "127.0.0.1",
        port,
        ssl=client_context(files),
        server_hostname=HOSTNAME,
        local_addr=(source, 0),
    )
    return Raw(reader, writer)


def implicit_tls_client(port: int, files: TlsFiles, source: str) -> aiosmtplib.SMTP:
    """aiosmtplib for the implicit-TLS port (``use_tls``: the handshake before the
    greeting), verifying the test certificate, connecting from ``source``."""
    return aiosmtplib.SMTP(
        hostname="127.0.0.1",
        port=port,
        use_tls=True,
        tls_context=client_context(files),
        source_address=(source, 0),
        local_hostname="client.test",
        timeout=30,
    )


async def ehlo_under_tls_from_the_start(smtp: aiosmtplib.SMTP) -> None:
    """EHLO on a connection under implicit TLS, and what it must offer there."""
    await smtp.ehlo()
    # RFC 3207: STARTTLS is not offered on a connection already under TLS; AUTH is
    # offered at once (RFC 4954 asks only for TLS, not for STARTTLS).
    assert not smtp.supports_extension("starttls")
    assert smtp.server_auth_methods == ["plain", "login"]


def received_protocol(store: QueueStore, msg_id: int) -> str:
    """The protocol keyword of our Received field ("with ESMTPSA id ...")."""
    received, _ = split_received(stored_body(store, msg_id))
    words = received.decode().split()
    return words[words.index("with") + 1]


# --- a real client over the implicit-TLS port ---------------------------------------------


@pytest.mark.parametrize("on_uvloop", [False, True], ids=["asyncio", "uvloop"])
@pytest.mark.parametrize(
    ("source", "login", "protocol"),
    [
        (CLIENT, True, "ESMTPSA"),  # outside allow_networks: relays once authenticated
        ("127.0.0.1", False, "ESMTPS"),  # allowlisted: relays without AUTH
    ],
)
def test_aiosmtplib_sends_over_implicit_tls(
    tmp_path: Path,
    tls_files: TlsFiles,
    source: str,
    login: bool,
    protocol: str,
    *,
    on_uvloop: bool,
) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        assert rx.tls_port != rx.port
        smtp = implicit_tls_client(rx.tls_port, tls_files, source)
        await smtp.connect()
        try:
            await ehlo_under_tls_from_the_start(smtp)
            starttls = await smtp.execute_command(b"STARTTLS")
            assert (starttls.code, starttls.message[:5]) == (503, "5.5.1")
            if login:
                assert (await smtp.auth_plain(USER, PASSWORD)).code == 235
            errors, reply = await smtp.sendmail("c@d.test", ["a@b.test"], MESSAGE)
            assert errors == {}
        finally:
            await smtp.quit()
        msg_id = queued_id(f"250 {reply}")  # sendmail returns the text of the 250
        source_record = store.message(msg_id).source
        assert source_record["tls"] in ("TLSv1.2", "TLSv1.3")
        assert source_record["client"] == source
        assert source_record.get("auth") == (USER if login else None)
        assert received_protocol(store, msg_id) == protocol  # RFC 3848
        _, rest = split_received(stored_body(store, msg_id))
        assert rest.replace(b"\r\n", b"\n") == MESSAGE.replace(b"\r\n", b"\n")

    run(tmp_path, body, on_uvloop=on_uvloop, **implicit_options(tls_files))


def test_the_plain_listener_still_offers_starttls(tmp_path: Path, tls_files: TlsFiles) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.connect(rx.port, source=CLIENT)
        assert (await raw.reply()).startswith("220 ")
        ehlo = await raw.cmd("EHLO client.test")
        assert "STARTTLS" in ehlo and "AUTH" not in ehlo
        await raw.cmd("QUIT")
        await raw.close()

    run(tmp_path, body, **implicit_options(tls_files))


@pytest.mark.parametrize("mechanism", ["PLAIN", "LOGIN"])
def test_swaks_tls_on_connect_and_auth(tmp_path: Path, tls_files: TlsFiles, mechanism: str) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        auth = ("--auth", mechanism, "--auth-user", USER, "--auth-password", PASSWORD)
        options = ("--local-interface", CLIENT, "--tls-on-connect", *auth)
        status, text = await swaks(rx.tls_port, *options)
        if status != 0 and "TLS not available" in text:
            missing("swaks has no TLS support (Debian: libnet-ssleay-perl)")
        assert status == 0, text
        assert "235 2.7.0" in text
        assert "STARTTLS" not in text  # neither offered nor tried
        [line] = [x for x in text.splitlines() if "queued as" in x]
        msg_id = queued_id(line.split("<~", 1)[1].strip())
        source = store.message(msg_id).source
        assert source["auth"] == USER and source["tls"] in ("TLSv1.2", "TLSv1.3")
        assert received_protocol(store, msg_id) == "ESMTPSA"

    run(tmp_path, body, **implicit_options(tls_files))


# --- clients that never get through the handshake ------------------------------------------


def test_plaintext_and_silent_clients_are_dropped_and_a_good_session_goes_on(
    tmp_path: Path, tls_files: TlsFiles, caplog: pytest.LogCaptureFixture
) -> None:
    """A plaintext client on the TLS port is closed at once; one that never sends a
    ClientHello is closed at the handshake time limit (here the 2 s idle timeout); a TLS
    session open all the while delivers its message after both."""

    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        good = await tls_raw(rx.tls_port, tls_files)
        assert (await good.reply()).startswith("220 ")
        assert (await good.cmd("EHLO client.test")).startswith("250-")
        assert (await good.cmd(f"AUTH PLAIN {PLAIN}")).startswith("235 ")

        silent = await Raw.connect(rx.tls_port, source=CLIENT)
        started = time.monotonic()
        plain = await Raw.connect(rx.tls_port, source=CLIENT)
        await plain.send(b"EHLO client.test\r\n")
        assert await closed(plain, 10)  # at once, not a word in plaintext
        await plain.close()

        assert (await good.cmd("MAIL FROM:<c@d.test>")).startswith("250 ")
        assert (await good.cmd("RCPT TO:<a@b.test>")).startswith("250 ")
        assert (await good.cmd("DATA")).startswith("354 ")
        await good.send(MESSAGE + b".\r\n")
        msg_id = queued_id(await good.reply())
        assert store.message(msg_id).source["tls"] in ("TLSv1.2", "TLSv1.3")

        assert await closed(silent, 10)
        waited = time.monotonic() - started
        assert 1.5 <= waited < 8, waited  # the limit, not at once, not never
        await silent.close()
        await good.cmd("QUIT")
        await good.close()

    with caplog.at_level(logging.INFO):
        run(tmp_path, body, **implicit_options(tls_files, idle_timeout="2s"))
    failed = [r for r in caplog.records if "TLS handshake failed" in r.getMessage()]
    assert len(failed) == 2, caplog.text
    assert all(r.levelno == logging.INFO and r.exc_info is None for r in failed)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_close_cancels_handshakes_and_says_421_inside_tls(
    tmp_path: Path, tls_files: TlsFiles
) -> None:
    """SIGTERM's path: a session on the TLS port gets 421 4.3.2 (inside TLS), a connection
    still before its handshake is closed at once, not at the 60 s handshake limit."""

    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        session = await tls_raw(rx.tls_port, tls_files)
        assert (await session.reply()).startswith("220 ")
        silent = await Raw.connect(rx.tls_port, source=CLIENT)
        await asyncio.sleep(0.2)  # accepted, handshake pending
        started = time.monotonic()
        await rx.close()
        assert time.monotonic() - started < 5
        assert (await session.reply()).startswith("421 4.3.2")
        assert await closed(silent, 5)
        await session.close()
        await silent.close()
        with pytest.raises(OSError):
            await Raw.connect(rx.tls_port)  # no longer listening
        await nothing_left(store)

    run(tmp_path, body, **implicit_options(tls_files, idle_timeout="5m"))


def test_connections_per_client_counted_on_both_listeners(
    tmp_path: Path, tls_files: TlsFiles
) -> None:
    """The limit is per client address across both ports; the 421 on the TLS port comes
    inside TLS, where the client can read it."""

    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        first = await Raw.connect(rx.port, source=CLIENT)
        assert (await first.reply()).startswith("220 ")
        second = await tls_raw(rx.tls_port, tls_files)
        assert (await second.reply()).startswith("421 4.7.0")
        assert await second.reply() == ""
        await second.close()
        await first.cmd("QUIT")
        await first.close()
        for _ in range(100):  # the release lands once the first session's task ends
            third = await tls_raw(rx.tls_port, tls_files)
            greeting = await third.reply()
            await third.close()
            if greeting.startswith("220 "):
                break
            await asyncio.sleep(0.05)
        assert greeting.startswith("220 "), greeting

    run(tmp_path, body, **implicit_options(tls_files, max_connections_per_client=1))


def test_silent_connections_to_the_tls_port_are_bounded_per_client(
    tmp_path: Path, tls_files: TlsFiles
) -> None:
    """A client that connects to the implicit-TLS port and never says its ClientHello is
    not yet counted as a session; its handshakes in progress are bounded by the same limit
    per address, past which a connection is closed at once.  Another address still gets
    its TLS session meanwhile."""

    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        silent = []
        for _ in range(10):
            reader, writer = await asyncio.open_connection(
                "127.0.0.1", rx.tls_port, local_addr=(CLIENT, 0)
            )
            silent.append(Raw(reader, writer))

        async def open_after_a_while(raw: Raw) -> bool:
            try:
                return not await closed(raw, 2.0)
            except TimeoutError:
                return True  # the server still waits for its ClientHello

        still_open = await asyncio.gather(*(open_after_a_while(raw) for raw in silent))
        assert still_open.count(True) == 3, still_open
        other = await tls_raw(rx.tls_port, tls_files, source="127.0.0.1")
        assert (await other.reply()).startswith("220 ")
        await other.cmd("QUIT")
        await other.close()
        for raw in silent:
            await raw.close()

    run(
        tmp_path,
        body,
        **implicit_options(tls_files, max_connections_per_client=3, idle_timeout="20s"),
    )


# --- configuration ------------------------------------------------------------------------

BASE = "[zones.default]\n[zones.bounces]\n[receiver]\n"


def problems(tmp_path: Path, receiver: str) -> list[str]:
    path = tmp_path / "zones.toml"
    path.write_text(BASE + receiver)
    return check_config(path)


@pytest.mark.parametrize(
    ("case", "words"),
    [
        ("no certificate", "set tls_cert and tls_key"),
        ("same address as listen", "same address as listen"),
        ("wildcard takes the port too", "same address as listen"),
        ("not an address", "host:port"),
    ],
)
def test_each_tls_listen_problem_names_the_key(
    tmp_path: Path, tls_files: TlsFiles, case: str, words: str
) -> None:
    tls = f'tls_cert = "{tls_files.cert}"\ntls_key = "{tls_files.key}"\n'
    text = {
        "no certificate": 'tls_listen = "127.0.0.1:4650"\n',
        "same address as listen": tls
        + 'listen = "127.0.0.1:2525"\ntls_listen = "127.0.0.1:2525"\n',
        "wildcard takes the port too": tls + 'listen = "0.0.0.0:25"\ntls_listen = "127.0.0.1:25"\n',
        "not an address": tls + 'tls_listen = "465"\n',
    }[case]
    found = problems(tmp_path, text)
    assert len(found) == 1, found
    assert found[0].startswith("receiver.tls_listen"), found
    assert words in found[0], found


def test_a_valid_tls_listen_loads_and_the_default_has_none(
    tmp_path: Path, tls_files: TlsFiles
) -> None:
    config = make_config(**implicit_options(tls_files))
    assert config.receiver.tls_listen_address == ("127.0.0.1", 0)
    assert make_config().receiver.tls_listen is None
    text = f'tls_cert = "{tls_files.cert}"\ntls_key = "{tls_files.key}"\n'
    assert problems(tmp_path, text + 'listen = "127.0.0.1:25"\ntls_listen = "[::1]:25"\n') == []


@pytest.mark.parametrize("processes", [0, 1, 2])
def test_receiver_processes_take_tls_listen_but_not_on_the_listen_address(
    tmp_path: Path, tls_files: TlsFiles, processes: int
) -> None:
    """Receiver processes are handed the implicit-TLS socket too (``supervisor.py``), so the
    number of them changes nothing: a port of its own loads, ``listen``'s port does not."""
    text = f'processes = {processes}\ntls_cert = "{tls_files.cert}"\ntls_key = "{tls_files.key}"\n'
    text += 'listen = "127.0.0.1:2525"\n'
    assert problems(tmp_path, text + 'tls_listen = "127.0.0.1:4650"\n') == []
    [clash] = problems(tmp_path, text + 'tls_listen = "127.0.0.1:2525"\n')
    assert clash.startswith("receiver.tls_listen") and "same address as listen" in clash, clash


HOSTS = st.sampled_from(["127.0.0.1", "127.0.0.2", "0.0.0.0", "[::1]", "[::]"])
PORTS = st.sampled_from([0, 25, 465, 2525])


@settings(max_examples=60, deadline=None)
@given(one=st.tuples(HOSTS, PORTS), other=st.tuples(HOSTS, PORTS))
def test_a_clash_is_symmetric_and_needs_one_port(
    tls_files: TlsFiles, one: tuple[str, int], other: tuple[str, int]
) -> None:
    """Whether ``listen`` and ``tls_listen`` clash does not depend on which is which; two
    different ports, or port 0 (a new port each time), never clash; one address always
    clashes with itself."""

    def clashes(listen: tuple[str, int], tls_listen: tuple[str, int]) -> bool:
        try:
            make_config(
                listen=f"{listen[0]}:{listen[1]}",
                tls_listen=f"{tls_listen[0]}:{tls_listen[1]}",
                tls_cert=str(tls_files.cert),
                tls_key=str(tls_files.key),
            )
        except ValueError as exc:
            assert "tls_listen" in str(exc)
            return True
        return False

    assert clashes(one, other) == clashes(other, one)
    if one[1] != other[1] or one[1] == 0:
        assert not clashes(one, other)
    assert clashes(one, one) == (one[1] != 0)


# --- zoneq serve ----------------------------------------------------------------------------


SWAKS_MAIL = ("--from", "a@src.test", "--to", "b@ok.test", "--header", "Subject: 465")


@contextlib.contextmanager
def serve_config(directory: Path, files: TlsFiles) -> Iterator[tuple[Bed, Path, int]]:
    """A mail bed (smtp-sink, dnsmasq) and a ``zoneq serve`` config for it whose receiver
    also listens for implicit TLS: the bed, the config, the implicit-TLS port."""
    port = free_port()
    receiver = {
        "tls_listen": f'"127.0.0.1:{port}"',
        "tls_cert": f'"{files.cert}"',
        "tls_key": f'"{files.key}"',
    }
    with mail_bed(directory) as bed:
        yield bed, bed.config(receiver=receiver), port


@pytest.mark.integration
def test_zoneq_serve_takes_mail_over_implicit_tls_and_delivers_it(
    tmp_path: Path, tls_files: TlsFiles
) -> None:
    """The whole program (on uvloop): swaks over the implicit-TLS port, smtp-sink gets it."""
    with serve_config(tmp_path, tls_files) as (bed, config, port):
        serve = start_serve(config, tmp_path / "serve.log")
        try:
            serve.wait_ready(WORKERS)
            done = subprocess.run(
                ["swaks", "--server", f"127.0.0.1:{port}", "--tls-on-connect", *SWAKS_MAIL],
                capture_output=True, text=True, timeout=30, check=False,
            )  # fmt: skip
            assert done.returncode == 0, done.stdout + done.stderr
            [message] = bed.sink.messages(1, timeout=30)
        finally:
            serve.cleanup()
    assert f"accepting SMTP with implicit TLS on 127.0.0.1:{port}" in serve.log_text()
    assert b"Subject: 465" in message.content
    assert b" with ESMTPS id" in message.content  # RFC 3848: TLS, no AUTH


@pytest.mark.integration
def test_zoneq_serve_refuses_to_start_when_the_tls_port_is_taken(
    tmp_path: Path, tls_files: TlsFiles
) -> None:
    with (
        serve_config(tmp_path, tls_files) as (_, config, port),
        socket.create_server(("127.0.0.1", port)),  # the port taken
    ):
        serve = start_serve(config, tmp_path / "serve.log")
        try:
            status = serve.process.wait(timeout=120)
        finally:
            serve.cleanup()
    log = serve.log_text()
    assert status == 1, log
    assert f"SMTP receiver (implicit TLS) cannot listen on 127.0.0.1:{port}" in log
    assert "Traceback" not in log
