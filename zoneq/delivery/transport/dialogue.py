"""Setting a session up with aiosmtplib: connect, greeting, EHLO (or HELO), STARTTLS.

This is the only module that imports aiosmtplib, and its exceptions become ``Abort`` values
here.  aiosmtplib does the connection (with ``source_address`` for IP pools), the greeting,
EHLO with extension parsing, the HELO fallback and STARTTLS.  Once the session is set up its
transport is handed to a :class:`~zoneq.delivery.transport.channel.Channel`, which carries the
mail transactions (``channel.py`` says why: PIPELINING).  The aiosmtplib client is dropped
then, without closing: the transport is the channel's.

TLS (RFC 3207): OPPORTUNISTIC uses STARTTLS when offered and does not verify the certificate
(as most MTAs do: with no way to know which name the certificate should carry, verifying would
only turn mail away from servers whose certificates are self-signed or name another host, and
plaintext is the alternative anyway).  If STARTTLS is refused or the handshake fails, the
session is started again on a new connection in plaintext, and ``tls_fallback`` says why.
REQUIRED verifies the certificate (unless told otherwise) and never sends MAIL in plaintext: no
STARTTLS, a refusal or a failed handshake ends the session with 4.7.4 (security feature not
supported) or 4.7.5 (cryptographic failure), RFC 3463 section 3.8, as NEXT_HOST: the fault is
this host's, and RFC 5321 section 5.1 has the client try each MX host in order; another may
offer TLS.  When none does, the walk (``attempt.py``) defers the recipients with the last
host's 4.7.x reason.

Smarthosts (issue 5) add two things.  ``implicit_tls``: TLS from the first byte (port 465,
RFC 8314 section 3.3), done by aiosmtplib's ``use_tls``; no STARTTLS then.  ``auth``: AUTH
(RFC 4954) with aiosmtplib's ``login``, which picks a mechanism the server offers, once the
session is under TLS; credentials never go in plaintext unless the policy is NONE (the
operator said so).  A relay that refuses the credentials, or that cannot take them, DEFERs:
the fault is in our configuration, not in the mail, which must wait rather than bounce.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
from dataclasses import dataclass, field
from typing import cast

import aiosmtplib

from zoneq.delivery.transport.abort import (
    BAD_CONNECTION,
    NO_ANSWER,
    NO_AUTH,
    NO_TLS,
    TLS_FAILED,
    Abort,
    lost,
)
from zoneq.delivery.transport.cache import Connection
from zoneq.delivery.transport.channel import Channel
from zoneq.delivery.transport.options import Timeouts, TlsPolicy
from zoneq.errors import ProtocolError
from zoneq.protocol.replies import EnhancedStatus, Reply, Stage, Verdict, classify, reply_from_text


@dataclass(frozen=True, slots=True)
class Destination:
    """Where and how to open a session."""

    host: str
    port: int
    helo_name: str
    source_address: str | None
    tls_policy: TlsPolicy
    tls_verify: bool | None
    tls_server_name: str
    tls_context: ssl.SSLContext | None
    timeouts: Timeouts
    implicit_tls: bool = False
    auth: tuple[str, str] | None = field(default=None, repr=False)


@dataclass
class Seen:
    """What setting the session up has learnt so far, for the result even if it fails (a
    host that answered is alive, whatever it said: see ``attempt.py``)."""

    peer: str | None = None
    local: str | None = None
    tls: bool = False
    tls_fallback: str | None = None
    extensions: dict[str, str] = field(default_factory=dict)


def _to_reply(code: int, message: str, stage: Stage) -> Reply:
    """aiosmtplib's (code, text) as a Reply; a garbled reply counts as no reply."""
    try:
        return reply_from_text(code, message)
    except ProtocolError as exc:
        raise lost(stage, f"unusable reply: {exc}") from None


async def open_session(dest: Destination, seen: Seen) -> Connection:
    """Connect, EHLO and STARTTLS as the policy says; a Connection ready for MAIL."""
    smtp = await _connect(dest, seen)
    try:
        seen.extensions = await _hello(smtp, dest)
        seen.tls = dest.implicit_tls
        if dest.tls_policy is not TlsPolicy.NONE and not dest.implicit_tls:
            required = dest.tls_policy is TlsPolicy.REQUIRED
            if "STARTTLS" in seen.extensions:
                failure = await _starttls(smtp, dest)
                if failure is None:
                    # RFC 3207 section 4.2: forget what was learnt before TLS, ask again.
                    seen.tls = True
                    seen.extensions = await _hello(smtp, dest)
                elif required:
                    reply, status, detail = failure
                    await _quit_if_refused(smtp, dest, reply)
                    raise Abort(
                        Stage.STARTTLS, Verdict.NEXT_HOST, reply=reply, status=status, detail=detail
                    )
                else:
                    # RFC 3207 section 4.1 leaves it to the client whether to go on without
                    # TLS.  A new connection: after a failed handshake the old one is in no
                    # known state.
                    seen.tls_fallback = failure[2]
                    await _quit_if_refused(smtp, dest, failure[0])
                    smtp.close()
                    smtp = await _connect(dest, seen)
                    seen.extensions = await _hello(smtp, dest)
            elif required:
                await _quit(smtp, dest)
                raise Abort(
                    Stage.STARTTLS,
                    Verdict.NEXT_HOST,
                    status=NO_TLS,
                    detail="TLS is required, but STARTTLS was not offered by the host",
                )
        if dest.auth is not None:
            try:
                await _login(smtp, dest, seen)
            except Abort as abort:
                if abort.status is not BAD_CONNECTION:  # refused in step: see ``_login``
                    await _quit(smtp, dest)
                raise
        transport = smtp.transport
        if transport is None or transport.is_closing():
            raise lost(Stage.EHLO, "connection closed")
    except BaseException:
        smtp.close()
        raise
    return Connection(
        # A stream transport (aiosmtplib connects with create_connection), though not
        # always an asyncio.Transport subclass: uvloop's, on the worker's loop, are not.
        channel=Channel(cast(asyncio.Transport, transport)),
        extensions=seen.extensions,
        peer=seen.peer,
        local=seen.local,
        tls=seen.tls,
        tls_fallback=seen.tls_fallback,
    )


async def _connect(dest: Destination, seen: Seen) -> aiosmtplib.SMTP:
    smtp = aiosmtplib.SMTP(
        hostname=dest.host,
        port=dest.port,
        local_hostname=dest.helo_name,
        source_address=(dest.source_address, 0) if dest.source_address else None,
        timeout=dest.timeouts.greeting,
        start_tls=False,  # decided here, after EHLO, by the policy
        use_tls=dest.implicit_tls,
        tls_context=_tls_context(dest) if dest.implicit_tls else None,
    )
    try:
        await smtp.connect()
    except aiosmtplib.SMTPConnectResponseError as exc:
        # RFC 5321 section 3.1: e.g. a 554 greeting, or 421 for too many connections; the
        # host refuses the session.  It answered, so it is alive (``Seen``): a host busy or
        # refusing us is no reason for other domains' mail to skip it.  aiosmtplib has
        # closed the transport by now, so the address dialled stands for the peer.
        seen.peer = dest.host
        reply = _to_reply(exc.code, exc.message, Stage.GREETING)
        raise Abort(Stage.GREETING, classify(reply, Stage.GREETING), reply=reply) from None
    except (aiosmtplib.SMTPException, ssl.SSLError, OSError) as exc:
        # With implicit TLS the handshake is part of connecting; a certificate that does
        # not verify is then a cryptographic failure (X.7.5), as after STARTTLS, not "no
        # answer" (RFC 3463 sections 3.5 and 3.8).
        crypto = dest.implicit_tls and _caused_by_ssl(exc)
        raise Abort(
            Stage.CONNECT,
            Verdict.NEXT_HOST,
            status=TLS_FAILED if crypto else NO_ANSWER,
            detail=f"{type(exc).__name__}: {exc}",
        ) from None
    peer = smtp.get_transport_info("peername")
    local = smtp.get_transport_info("sockname")
    seen.peer = str(peer[0]) if peer else None
    seen.local = str(local[0]) if local else None
    return smtp


def _caused_by_ssl(exc: BaseException) -> bool:
    """Whether ``exc`` is, or was raised from, an ``ssl.SSLError`` (aiosmtplib wraps it)."""
    seen: BaseException | None = exc
    for _ in range(8):  # a chain is short; bounded against a cycle
        if seen is None:
            return False
        if isinstance(seen, ssl.SSLError):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


async def _hello(smtp: aiosmtplib.SMTP, dest: Destination) -> dict[str, str]:
    if not smtp.is_connected:
        raise lost(Stage.EHLO, "connection closed")
    try:
        try:
            await smtp.ehlo(hostname=dest.helo_name, timeout=dest.timeouts.ehlo)
        except aiosmtplib.SMTPHeloError as exc:
            reply = _to_reply(exc.code, exc.message, Stage.EHLO)
            # RFC 5321 section 3.2: a server that does not know EHLO answers 5yz; then HELO.
            if not reply.is_permanent or not smtp.is_connected:
                raise Abort(Stage.EHLO, classify(reply, Stage.EHLO), reply=reply) from None
            await smtp.helo(hostname=dest.helo_name, timeout=dest.timeouts.ehlo)
    except aiosmtplib.SMTPHeloError as exc:
        reply = _to_reply(exc.code, exc.message, Stage.EHLO)
        raise Abort(Stage.EHLO, classify(reply, Stage.EHLO), reply=reply) from None
    except (aiosmtplib.SMTPException, OSError) as exc:
        raise lost(Stage.EHLO, exc) from None
    return {key.upper(): value for key, value in smtp.esmtp_extensions.items()}


async def _quit_if_refused(smtp: aiosmtplib.SMTP, dest: Destination, reply: Reply | None) -> None:
    """QUIT after a STARTTLS refusal (a reply read in step: ``_starttls`` gives one only
    then), not after a failed handshake, where the connection is in no known state."""
    if reply is not None:
        await _quit(smtp, dest)


async def _quit(smtp: aiosmtplib.SMTP, dest: Destination) -> None:
    """Say QUIT on a session ended by our own refusal (no TLS, credentials not taken) with
    every reply read in step.  RFC 5321 section 4.1.1.10: the client MUST NOT close the
    connection before it has sent QUIT, and SHOULD wait for the reply; a server counts a
    bare close as a lost session.  Whatever happens here, the outcome is already decided."""
    if not smtp.is_connected:
        return
    with contextlib.suppress(aiosmtplib.SMTPException, OSError):  # the caller closes anyway
        await smtp.quit(timeout=dest.timeouts.quit)


async def _login(smtp: aiosmtplib.SMTP, dest: Destination, seen: Seen) -> None:
    """AUTH with the relay's credentials (RFC 4954), only under TLS unless the policy is NONE."""
    assert dest.auth is not None
    if not seen.tls and dest.tls_policy is not TlsPolicy.NONE:
        raise Abort(
            Stage.AUTH,
            Verdict.DEFER,
            status=NO_TLS,
            detail="credentials are not sent without TLS, and the session has none",
        )
    user, password = dest.auth
    try:
        await smtp.login(user, password, timeout=dest.timeouts.ehlo)
    except aiosmtplib.SMTPResponseException as exc:
        try:
            reply: Reply | None = reply_from_text(exc.code, exc.message)
        except ProtocolError:
            reply = None
        if reply is None or reply.code == 421:
            raise lost(Stage.AUTH, f"AUTH failed: {exc}") from None
        raise Abort(Stage.AUTH, Verdict.DEFER, reply=reply, detail="AUTH refused") from None
    except aiosmtplib.SMTPException as exc:  # e.g. no mechanism in common, AUTH not offered
        raise Abort(
            Stage.AUTH, Verdict.DEFER, status=NO_AUTH, detail=f"AUTH not possible: {exc}"
        ) from None
    except OSError as exc:
        raise lost(Stage.AUTH, exc) from None


def _tls_context(dest: Destination) -> ssl.SSLContext:
    if dest.tls_context is not None:
        return dest.tls_context
    verify = dest.tls_verify
    if verify is None:
        verify = dest.tls_policy is TlsPolicy.REQUIRED
    if verify:
        return ssl.create_default_context()
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    return context


async def _starttls(
    smtp: aiosmtplib.SMTP, dest: Destination
) -> tuple[Reply | None, EnhancedStatus, str] | None:
    """Upgrade to TLS; None on success, else (reply, status, why) for the fallback."""
    if not smtp.is_connected:
        raise lost(Stage.STARTTLS, "connection closed")
    try:
        await smtp.starttls(
            server_hostname=dest.tls_server_name,
            tls_context=_tls_context(dest),
            timeout=dest.timeouts.starttls,
        )
    except aiosmtplib.SMTPResponseException as exc:
        # A reply other than 220 (aiosmtplib uses code -1 for a garbled one).
        try:
            reply: Reply | None = reply_from_text(exc.code, exc.message)
        except ProtocolError:
            reply = None
        if reply is not None and reply.code == 421:  # RFC 5321 section 3.8: closing
            raise Abort(Stage.STARTTLS, Verdict.NEXT_HOST, reply=reply) from None
        return reply, NO_TLS, f"STARTTLS refused: {reply or exc}"
    except (aiosmtplib.SMTPException, ssl.SSLError, OSError) as exc:
        # aiosmtplib lets ssl.SSLError through and closes only on its own errors.
        smtp.close()
        return None, TLS_FAILED, f"TLS handshake failed: {type(exc).__name__}: {exc}"
    return None
