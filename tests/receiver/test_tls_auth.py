"""STARTTLS and AUTH on the real receiver, with smtplib, swaks and a raw client.

The receiver allowlists only 127.0.0.1; the clients here connect from 127.0.0.2, so they
may relay only once authenticated.  The certificate is made by openssl for this test
session (``conftest.py``) and the clients verify it, so the one served is the configured.
"""

from __future__ import annotations

import asyncio
import base64
import logging
import smtplib
import ssl
import time
from typing import Any

import pytest

from tests.receiver.conftest import HOSTNAME, TlsFiles
from tests.receiver.harness import (
    MESSAGE,
    Raw,
    nothing_left,
    queued_id,
    run,
    split_received,
    stored_body,
    swaks,
)
from tests.support.testbed import missing
from zoneq.receiver import SmtpReceiver
from zoneq.receiver.auth import FAILURE_DELAY_S
from zoneq.receiver.passwords import hash_password
from zoneq.storage.store import QueueStore

CLIENT = "127.0.0.2"  # outside allow_networks below
USER, PASSWORD = "alice", "correct horse battery staple"
USERS = {USER: hash_password(PASSWORD), "bob": hash_password("another one")}
PLAIN = base64.b64encode(f"\0{USER}\0{PASSWORD}".encode()).decode()


def tls_options(files: TlsFiles, **extra: Any) -> dict[str, Any]:
    return {
        "tls_cert": str(files.cert),
        "tls_key": str(files.key),
        "auth_users": USERS,
        "allow_networks": ["127.0.0.1/32"],
        **extra,
    }


def client_context(files: TlsFiles) -> ssl.SSLContext:
    return ssl.create_default_context(cafile=str(files.cert))


def _smtplib_send(port: int, files: TlsFiles, mechanism: str, password: str) -> dict[str, Any]:
    """One session with smtplib from 127.0.0.2: what it saw at each step."""
    seen: dict[str, Any] = {}
    with smtplib.SMTP("127.0.0.1", port, source_address=(CLIENT, 0), timeout=30) as smtp:
        smtp.ehlo("client.test")
        seen["plain_features"] = dict(smtp.esmtp_features)
        seen["auth_before_tls"] = smtp.docmd("AUTH", "PLAIN " + PLAIN)
        smtp.starttls(context=client_context(files))
        smtp.ehlo("client.test")
        seen["tls_features"] = dict(smtp.esmtp_features)
        smtp.mail("c@d.test")
        seen["rcpt_before_auth"] = smtp.rcpt("a@b.test")
        smtp.rset()
        smtp.user, smtp.password = USER, password
        method = smtp.auth_plain if mechanism == "PLAIN" else smtp.auth_login
        try:
            seen["auth"] = smtp.auth(mechanism, method, initial_response_ok=mechanism == "PLAIN")
        except smtplib.SMTPAuthenticationError as exc:
            seen["auth"] = (exc.smtp_code, exc.smtp_error)
            return seen
        smtp.mail("c@d.test")
        seen["rcpt"] = smtp.rcpt("a@b.test")
        seen["data"] = smtp.data(MESSAGE)
    return seen


@pytest.mark.parametrize("mechanism", ["PLAIN", "LOGIN"])
def test_starttls_then_auth_lets_an_outside_client_relay(
    tmp_path: Any, tls_files: TlsFiles, mechanism: str
) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        seen = await asyncio.to_thread(_smtplib_send, rx.port, tls_files, mechanism, PASSWORD)
        assert "starttls" in seen["plain_features"]
        assert "auth" not in seen["plain_features"]  # RFC 4954 4: offered only after TLS
        assert seen["auth_before_tls"][0] == 538
        assert seen["auth_before_tls"][1].startswith(b"5.7.11")
        assert "starttls" not in seen["tls_features"]
        assert seen["tls_features"]["auth"].split() == ["PLAIN", "LOGIN"]
        code, text = seen["rcpt_before_auth"]
        assert (code, text[:5]) == (554, b"5.7.1")  # not allowlisted, not yet authenticated
        assert seen["auth"][0] == 235
        assert seen["rcpt"][0] == 250
        code, text = seen["data"]
        msg_id = queued_id(f"{code} {text.decode()}")
        meta = store.message(msg_id)
        assert meta.source["auth"] == USER
        assert meta.source["tls"] in ("TLSv1.2", "TLSv1.3")
        assert meta.source["client"] == CLIENT
        received, rest = split_received(stored_body(store, msg_id))
        assert rest.replace(b"\r\n", b"\n") == MESSAGE.replace(b"\r\n", b"\n")
        assert " with ESMTPSA id " in " ".join(received.decode().split())

    run(tmp_path, body, **tls_options(tls_files))


def test_wrong_password_is_535_after_a_delay_and_the_third_failure_closes(
    tmp_path: Any, tls_files: TlsFiles
) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.connect(rx.port, source=CLIENT)
        await raw.reply()
        await raw.cmd("EHLO client.test")
        assert (await raw.cmd("STARTTLS")).startswith("220 2.0.0")
        await raw.start_tls(client_context(tls_files), HOSTNAME)
        assert "AUTH PLAIN LOGIN" in await raw.cmd("EHLO client.test")
        wrong = base64.b64encode(f"\0{USER}\0guess".encode()).decode()
        started = time.monotonic()
        assert (await raw.cmd(f"AUTH PLAIN {wrong}")).startswith("535 5.7.8")
        assert time.monotonic() - started >= FAILURE_DELAY_S * 0.9
        # An unknown user gets the same answer (LOGIN, challenge by challenge).
        assert await raw.cmd("AUTH LOGIN") == "334 " + base64.b64encode(b"Username:").decode()
        assert (await raw.cmd(base64.b64encode(b"mallory").decode())).startswith("334 ")
        assert (await raw.cmd(base64.b64encode(b"x").decode())).startswith("535 5.7.8")
        # Another user's authorization identity (RFC 4616 authzid) is refused too.
        proxy = base64.b64encode(f"bob\0{USER}\0{PASSWORD}".encode()).decode()
        # RFC 5321 section 4.2.3: a 421 names this host, as the state machine's own do.
        closing = await raw.cmd(f"AUTH PLAIN {proxy}")
        assert closing == f"421 4.7.0 {HOSTNAME} Too many authentication failures, closing"
        assert await raw.reply() == ""  # closed after three failures
        await raw.close()
        await nothing_left(store)

    run(tmp_path, body, **tls_options(tls_files))


async def over_tls(port: int, files: TlsFiles) -> Raw:
    """A session from ``CLIENT`` after STARTTLS and the second EHLO, which offers AUTH."""
    raw = await Raw.connect(port, source=CLIENT)
    await raw.reply()
    await raw.cmd("EHLO client.test")
    assert (await raw.cmd("STARTTLS")).startswith("220 ")
    await raw.start_tls(client_context(files), HOSTNAME)
    assert "AUTH PLAIN LOGIN" in await raw.cmd("EHLO client.test")
    return raw


def test_auth_exchange_cancelled_and_malformed(tmp_path: Any, tls_files: TlsFiles) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await over_tls(rx.port, tls_files)
        assert await raw.cmd("AUTH PLAIN") == "334 "
        assert (await raw.cmd("*")).startswith("501 5.0.0")  # RFC 4954 4: cancelled
        bad = base64.b64encode(b"no-separators").decode()
        assert (await raw.cmd(f"AUTH PLAIN {bad}")).startswith("501 5.5.2")
        assert (await raw.cmd(f"AUTH PLAIN {PLAIN}")).startswith("235 2.7.0")
        assert (await raw.cmd(f"AUTH PLAIN {PLAIN}")).startswith("503 5.5.1")  # once only
        await raw.cmd("QUIT")
        await raw.close()

    run(tmp_path, body, **tls_options(tls_files))


LONG_USER, LONG_PASSWORD = "u" * 200, "p" * 200  # RFC 4616 allows 255 octets each


def test_long_credentials_refused_lines_and_mail_auth_parameter(
    tmp_path: Any, tls_files: TlsFiles
) -> None:
    """RFC 4954 through the real receiver: a line refused inside an exchange ends it (the
    MAIL after it is a command, not a response answered 501); a 538-octet PLAIN response
    after 334 is taken (the limit there is 12288 octets); MAIL's AUTH= is accepted
    before and after AUTH; the message is stored with the session's own AUTH user."""

    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await over_tls(rx.port, tls_files)
        assert (await raw.cmd("AUTH LOGIN")).startswith("334 ")
        await raw.send(b"\xff\xfe\r\n")  # invalid UTF-8 cannot be base64
        assert (await raw.reply()).startswith("501 5.5.2")
        assert (await raw.cmd("MAIL FROM:<c@d.test> AUTH=<>")).startswith("250 2.1.0")
        assert (await raw.cmd("RSET")).startswith("250 ")
        assert await raw.cmd("AUTH PLAIN") == "334 "
        assert (await raw.cmd("A" * 12_300)).startswith("500 5.5.6")
        assert (await raw.cmd("NOOP")).startswith("250 ")
        assert await raw.cmd("AUTH PLAIN") == "334 "
        response = base64.b64encode(f"\0{LONG_USER}\0{LONG_PASSWORD}".encode()).decode()
        assert len(response) + 2 > 512
        assert (await raw.cmd(response)).startswith("235 2.7.0")
        mail = f"MAIL FROM:<c@d.test> AUTH={LONG_USER}+40d.test"
        assert (await raw.cmd(mail)).startswith("250 2.1.0")
        assert (await raw.cmd("RCPT TO:<a@b.test>")).startswith("250 ")  # relay: authed
        assert (await raw.cmd("DATA")).startswith("354 ")
        msg_id = queued_id(await raw.cmd("Subject: hi\r\n\r\nhi\r\n."))
        await raw.quit()
        assert store.message(msg_id).source["auth"] == LONG_USER

    users = {**USERS, LONG_USER: hash_password(LONG_PASSWORD)}
    run(tmp_path, body, **tls_options(tls_files, auth_users=users))


@pytest.mark.parametrize("separate", [False, True], ids=["one-packet", "two-writes"])
def test_plaintext_pipelined_after_starttls_is_discarded(
    tmp_path: Any, tls_files: TlsFiles, separate: bool
) -> None:
    """CVE-2011-0411 class: ``STARTTLS\\r\\nRSET\\r\\n`` must not run RSET inside TLS."""

    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.connect(rx.port)
        await raw.reply()
        await raw.cmd("EHLO client.test")
        injected = b"MAIL FROM:<evil@x.test>\r\nRSET\r\n"
        if separate:
            raw.writer.write(b"STARTTLS\r\n")
            raw.writer.write(injected)  # before the 220 arrives
            await raw.writer.drain()
        else:
            await raw.send(b"STARTTLS\r\n" + injected)
        assert (await raw.reply()).startswith("220 2.0.0")
        await raw.start_tls(client_context(tls_files), HOSTNAME)
        # Had MAIL or RSET survived, its 250 would come first; the session is back at the
        # start instead, so MAIL wants EHLO.
        assert (await raw.cmd("MAIL FROM:<c@d.test>")).startswith("503 5.5.1")
        assert (await raw.cmd("EHLO client.test")).startswith("250-")
        assert (await raw.cmd("MAIL FROM:<c@d.test>")).startswith("250 ")
        await raw.cmd("QUIT")
        await raw.close()

    run(tmp_path, body, **tls_options(tls_files))


@pytest.mark.parametrize("sent", [b"this is not a TLS ClientHello\r\n" * 4, b""])
def test_failed_handshake_ends_the_session_with_one_log_line(
    tmp_path: Any, tls_files: TlsFiles, caplog: pytest.LogCaptureFixture, sent: bytes
) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.connect(rx.port)
        await raw.reply()
        await raw.cmd("EHLO client.test")
        assert (await raw.cmd("STARTTLS")).startswith("220")
        if sent:
            await raw.send(sent)
            assert await raw.reply() == ""  # closed, nothing more said
        await raw.close()  # or gone at once, with no text in the exception
        # The receiver goes on serving.
        other = await Raw.connect(rx.port)
        assert (await other.reply()).startswith("220 ")
        await other.cmd("QUIT")
        await other.close()

    with caplog.at_level(logging.INFO):
        run(tmp_path, body, **tls_options(tls_files))
    failed = [r.getMessage() for r in caplog.records if "TLS handshake failed" in r.getMessage()]
    assert len(failed) == 1, caplog.text
    assert not failed[0].endswith("failed: "), failed  # the reason is named
    assert all(r.exc_info is None for r in caplog.records), caplog.text
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR], caplog.text


def test_without_a_certificate_neither_starttls_nor_auth_is_offered(tmp_path: Any) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.connect(rx.port)
        await raw.reply()
        ehlo = await raw.cmd("EHLO client.test")
        assert "STARTTLS" not in ehlo and "AUTH" not in ehlo
        assert (await raw.cmd("STARTTLS")).startswith("502 5.5.1")
        assert (await raw.cmd(f"AUTH PLAIN {PLAIN}")).startswith("502 5.5.1")
        await raw.cmd("QUIT")
        await raw.close()

    run(tmp_path, body)


@pytest.mark.parametrize("mechanism", ["PLAIN", "LOGIN"])
def test_swaks_starttls_and_auth(tmp_path: Any, tls_files: TlsFiles, mechanism: str) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        auth = ("--auth", mechanism, "--auth-user", USER, "--auth-password", PASSWORD)
        status, text = await swaks(rx.port, "--local-interface", CLIENT, "--tls", *auth)
        if status != 0 and "TLS not available" in text:
            missing("swaks has no TLS support (Debian: libnet-ssleay-perl)")
        assert status == 0, text
        assert "235 2.7.0" in text
        [line] = [x for x in text.splitlines() if "queued as" in x]
        msg_id = queued_id(line.split("<~", 1)[1].strip())
        source = store.message(msg_id).source
        assert source["auth"] == USER
        assert PASSWORD not in " ".join(source.values())

    run(tmp_path, body, **tls_options(tls_files))
