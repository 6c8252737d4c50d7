"""The SMTP client transaction: one connection to one host, one message, a result per recipient.

Theory of operation
-------------------
:func:`deliver` opens a connection, says EHLO, upgrades to TLS when the policy says so, and
runs MAIL, RCPT..., DATA, the body and the end of data.  Whatever the remote host does, the
outcome is a value, a :class:`~zoneq.delivery.results.TransactionResult` holding one
:class:`~zoneq.delivery.results.RecipientResult` per recipient; replies are judged by
:func:`~zoneq.protocol.replies.classify`.  Internally an ``_Abort`` unwinds the session when it
cannot go on; it never leaves this module, and every recipient not settled by then gets the
verdict it carries (usually NEXT_HOST: the caller tries the next MX host, then defers).

This is the only module that imports aiosmtplib, and its exceptions become values here.
aiosmtplib does the connection (with ``source_address`` for IP pools), EHLO with extension
parsing, HELO fallback, STARTTLS, and single commands (``SMTP.execute_command``).  It does not
send the body: ``SMTP.data()`` wants the whole message as one ``bytes`` and would normalise it
itself.  The body is instead streamed through :class:`~zoneq.protocol.encoder.DotStuffer` onto
the connection, so the message is never held whole.  What this relies on inside aiosmtplib
(5.1.x), all on ``SMTP.protocol`` (an ``SMTPProtocol``):

* ``write(bytes)`` puts bytes on the transport (raising ``SMTPServerDisconnected`` once the
  connection is gone);
* ``_drain_helper()`` is the stdlib flow-control hook that ``StreamWriter.drain()`` awaits
  (aiosmtplib copies the stdlib's ``FlowControlMixin`` for exactly this use): it returns at
  once unless the transport's buffer is above its high-water mark, then waits for
  ``resume_writing``.  Awaiting it after each chunk bounds what is buffered;
* ``read_response(timeout=...)`` reads one complete reply.  It marks a reply as awaited before
  its first ``await``, and the protocol discards bytes that arrive while no reply is awaited.
  So the final dot is written and ``read_response`` called with no ``await`` in between: a fast
  server's 250 cannot slip through that gap.

Timeouts are RFC 5321 section 4.5.3.2's, per step (:class:`Timeouts`), not aiosmtplib's 60 s
for everything: a server that needs two minutes to scan a message would otherwise be timed out
after it has the message, and the retry would deliver a second copy.  A connection lost or timed
out after the final dot is such a case (RFC 1047): those recipients are DEFER and flagged
``possible_duplicate``, and are never handed on to the next MX host at once.  A 421 reply after
the dot is treated the same way.

TLS (RFC 3207): OPPORTUNISTIC uses STARTTLS when offered and does not verify the certificate
(as most MTAs do: with no way to know which name the certificate should carry, verifying would
only turn mail away from servers whose certificates are self-signed or name another host, and
plaintext is the alternative anyway).  If STARTTLS is refused or the handshake fails, the
session is started again on a new connection in plaintext, and ``tls_fallback`` says why.
REQUIRED verifies the certificate (unless told otherwise) and never sends MAIL in plaintext: no
STARTTLS, a refusal or a failed handshake makes every recipient DEFER with 4.7.4 (security
feature not supported) or 4.7.5 (cryptographic failure), RFC 3463 section 3.8.

A 452 to a RCPT after at least one recipient was accepted means "too many recipients" (RFC 5321
section 4.5.3.1.10): the transaction goes on with those accepted, and the rest are sent in a
new transaction on the same connection, reading the body again from ``body()``.

PIPELINING (RFC 2920) is not used: one command, one reply, each with its own timeout, keeps
the mapping from replies to recipients obvious.  It costs round trips, not correctness.

Connection reuse: with a :class:`ConnectionCache`, a session that ended cleanly (its last
transaction answered, nothing open) is kept instead of QUIT, and the next message to the same
destination (host, port, source address, TLS policy and name, HELO name) starts with MAIL on
it, as Postfix's connection cache does: no TCP handshake, greeting, EHLO or TLS handshake per
message.  A kept connection the server closed while it was idle shows at the first MAIL (lost,
or a 421): the session then opens a fresh connection and goes on as if new, so an idle
timeout never sends recipients to the next MX host.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import ssl
from collections.abc import AsyncGenerator, AsyncIterable, Iterable, Sequence
from typing import Final

import aiosmtplib
from aiosmtplib.protocol import SMTPProtocol

from zoneq.delivery.results import RecipientResult, TransactionResult
from zoneq.delivery.transport.cache import Connection, ConnectionCache
from zoneq.delivery.transport.options import (
    RFC5321_TIMEOUTS,
    BodySource,
    MailOptions,
    Recipient,
    Timeouts,
    TlsPolicy,
)
from zoneq.errors import ProtocolError
from zoneq.protocol.dsn import Notify
from zoneq.protocol.encoder import DEFAULT_MAX_LINE_LENGTH, DotStuffer
from zoneq.protocol.replies import (
    EnhancedStatus,
    Reply,
    Stage,
    Verdict,
    classify,
    reply_from_text,
)

# Status codes for zoneq's own decisions (RFC 3463).
_NO_ANSWER: Final = EnhancedStatus(4, 4, 1)  # X.4.1 no answer from host
_BAD_CONNECTION: Final = EnhancedStatus(4, 4, 2)  # X.4.2 bad connection
_LOCAL_ERROR: Final = EnhancedStatus(4, 3, 0)  # X.3.0 other mail system status
_NO_TLS: Final = EnhancedStatus(4, 7, 4)  # X.7.4 security features not supported
_TLS_FAILED: Final = EnhancedStatus(4, 7, 5)  # X.7.5 cryptographic failure
_TOO_BIG: Final = EnhancedStatus(5, 3, 4)  # X.3.4 message too big for system
_NO_UTF8: Final = EnhancedStatus(5, 6, 7)  # X.6.7 non-ASCII addresses not permitted (RFC 6531)
_BAD_RCPT_SYNTAX: Final = EnhancedStatus(5, 1, 3)  # X.1.3 bad destination mailbox syntax
_BAD_SENDER_SYNTAX: Final = EnhancedStatus(5, 1, 7)  # X.1.7 bad sender's mailbox syntax

# Control characters in a command argument would let it inject a command (RFC 5321 section
# 2.3.8 forbids them in commands); aiosmtplib refuses them too, with an exception.
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f]")
# ENVID and ORCPT are xtext (RFC 3461 section 4); a HELO name has no spaces.
_PRINTABLE: Final = re.compile(r"[\x21-\x7e]+")
_ORCPT: Final = re.compile(r"[A-Za-z0-9-]+;[\x21-\x7e]+")


class _Abort(Exception):
    """The session cannot go on; every recipient not yet settled gets this outcome."""

    def __init__(
        self,
        stage: Stage,
        verdict: Verdict,
        *,
        reply: Reply | None = None,
        status: EnhancedStatus | None = None,
        detail: str = "",
    ) -> None:
        super().__init__(detail or str(reply))
        self.stage = stage
        self.verdict = verdict
        self.reply = reply
        self.status = status
        self.detail = detail


def _lost(stage: Stage, exc: BaseException | str) -> _Abort:
    """No usable reply at ``stage``: trouble with this host (RFC 5321 section 5.1)."""
    detail = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    return _Abort(stage, Verdict.NEXT_HOST, status=_BAD_CONNECTION, detail=detail)


def _to_reply(code: int, message: str, stage: Stage) -> Reply:
    """aiosmtplib's (code, text) as a Reply; a garbled reply counts as no reply."""
    try:
        return reply_from_text(code, message)
    except ProtocolError as exc:
        raise _lost(stage, f"unusable reply: {exc}") from None


async def _chunks(source: AsyncIterable[bytes] | Iterable[bytes]) -> AsyncGenerator[bytes, None]:
    if isinstance(source, AsyncIterable):
        async for chunk in source:
            yield chunk
    else:
        for chunk in source:
            yield chunk


class _Session:
    """One call of :func:`deliver`: the connection and what has been settled so far."""

    def __init__(
        self,
        *,
        host: str,
        port: int,
        helo_name: str,
        sender: str,
        recipients: Sequence[Recipient],
        body: BodySource,
        source_address: str | None,
        tls: TlsPolicy,
        tls_verify: bool | None,
        tls_server_name: str | None,
        tls_context: ssl.SSLContext | None,
        timeouts: Timeouts,
        options: MailOptions,
        max_line_length: int,
        cache: ConnectionCache | None = None,
    ) -> None:
        self.cache = cache
        self.kept: Connection | None = None  # the cached connection this session runs on
        self.host = host
        self.port = port
        self.helo_name = helo_name
        self.sender = sender
        self.recipients = recipients
        self.body = body
        self.source_address = source_address
        self.tls_policy = tls
        self.tls_verify = tls_verify
        self.tls_server_name = tls_server_name or host
        self.tls_context = tls_context
        self.timeouts = timeouts
        self.options = options
        self.max_line_length = max_line_length

        self.smtp: aiosmtplib.SMTP | None = None
        self.results: list[RecipientResult | None] = [None] * len(recipients)
        self.extensions: dict[str, str] = {}
        self.peer: str | None = None
        self.local: str | None = None
        self.tls = False
        self.tls_fallback: str | None = None
        self.transactions = 0
        self.in_transaction = False  # MAIL accepted, end of data not yet answered

    # --- settling --------------------------------------------------------------------------

    def _settle(
        self,
        index: int,
        verdict: Verdict,
        stage: Stage,
        *,
        reply: Reply | None = None,
        status: EnhancedStatus | None = None,
        detail: str = "",
        possible_duplicate: bool = False,
    ) -> None:
        if status is None and reply is not None:
            status = reply.enhanced
        self.results[index] = RecipientResult(
            address=self.recipients[index].address,
            verdict=verdict,
            stage=stage,
            reply=reply,
            status=status,
            detail=detail,
            possible_duplicate=possible_duplicate,
            transaction=max(self.transactions - 1, 0),
        )

    def _settle_by_reply(self, indices: Iterable[int], stage: Stage, reply: Reply) -> None:
        verdict = classify(reply, stage)
        for index in indices:
            self._settle(index, verdict, stage, reply=reply)

    def _settle_rest(self, abort: _Abort) -> None:
        for index, result in enumerate(self.results):
            if result is None:
                self._settle(
                    index,
                    abort.verdict,
                    abort.stage,
                    reply=abort.reply,
                    status=abort.status,
                    detail=abort.detail,
                )

    def _result(self) -> TransactionResult:
        settled = tuple(result for result in self.results if result is not None)
        if len(settled) != len(self.results):  # pragma: no cover - every path settles all
            raise AssertionError("a recipient was left without an outcome")
        return TransactionResult(
            host=self.host,
            port=self.port,
            recipients=settled,
            peer=self.peer,
            local=self.local,
            tls=self.tls,
            tls_fallback=self.tls_fallback,
            extensions=frozenset(self.extensions),
            transactions=self.transactions,
        )

    # --- the session -----------------------------------------------------------------------

    async def run(self) -> TransactionResult:
        todo = self._check_syntax()
        kept = False
        try:
            if todo:
                reused = self._adopt()
                if not reused:
                    await self._open()
                ready = self._check_features(todo)
                # Each extra transaction settles at least one recipient, so this ends.
                while ready:
                    try:
                        ready = await self._transaction(ready)
                    except _Abort as abort:
                        if not (reused and self._died_idle(abort)):
                            raise
                        # The kept connection was closed while idle: start afresh, once.
                        reused = False
                        ready = await self._reopen(ready)
                    reused = False
                kept = self._keep()
                if not kept:
                    await self._quit()
        except _Abort as abort:
            self._settle_rest(abort)
        finally:
            if not kept:
                self._close()
        return self._result()

    # --- reuse ----------------------------------------------------------------------------

    def _key(self) -> tuple[str, int, str | None, str, str, str]:
        return (
            self.host,
            self.port,
            self.source_address,
            self.tls_policy.value,
            self.tls_server_name,
            self.helo_name,
        )

    def _adopt(self) -> bool:
        """Start on a cached connection to this destination, if one is waiting."""
        if self.cache is None:
            return False
        kept = self.cache.take(self._key())
        if kept is None:
            return False
        self.kept = kept
        self.smtp = kept.smtp
        self.extensions = dict(kept.extensions)
        self.peer, self.local = kept.peer, kept.local
        self.tls, self.tls_fallback = kept.tls, kept.tls_fallback
        return True

    def _died_idle(self, abort: _Abort) -> bool:
        """Did the first MAIL on a kept connection find it closed (lost, or a 421)?"""
        if self.transactions != 1 or abort.stage is not Stage.MAIL:
            return False
        return abort.reply is None or abort.reply.code == 421

    async def _reopen(self, ready: list[int]) -> list[int]:
        for index in ready:
            self.results[index] = None  # a 421 at MAIL settled them: that was the idle close
        self._close()
        self.kept = None
        self.transactions = 0
        self.in_transaction = False
        await self._open()
        return self._check_features(ready)

    def _keep(self) -> bool:
        """Hand a cleanly ended connection to the cache instead of saying QUIT."""
        if self.cache is None or self.smtp is None or not self.smtp.is_connected:
            return False
        if self.in_transaction:
            return False
        kept = self.kept or Connection(
            smtp=self.smtp,
            extensions=dict(self.extensions),
            peer=self.peer,
            local=self.local,
            tls=self.tls,
            tls_fallback=self.tls_fallback,
            opened=self.cache.now(),
        )
        kept.messages += 1
        return self.cache.put(self._key(), kept)

    def _check_syntax(self) -> list[int]:
        """Settle recipients whose address cannot be put in a command; return the others."""
        if _CONTROL.search(self.sender):
            for index in range(len(self.recipients)):
                self._settle(
                    index,
                    Verdict.BOUNCE,
                    Stage.MAIL,
                    status=_BAD_SENDER_SYNTAX,
                    detail="sender address contains control characters",
                )
            return []
        todo = []
        for index, recipient in enumerate(self.recipients):
            if not recipient.address or _CONTROL.search(recipient.address):
                self._settle(
                    index,
                    Verdict.BOUNCE,
                    Stage.RCPT,
                    status=_BAD_RCPT_SYNTAX,
                    detail="recipient address is empty or contains control characters",
                )
            else:
                todo.append(index)
        return todo

    def _check_features(self, todo: list[int]) -> list[int]:
        """Settle what this server cannot take (SMTPUTF8, SIZE); return the others."""
        if "SMTPUTF8" not in self.extensions:
            # RFC 6531 section 3.4: without SMTPUTF8 the message cannot go to this server, or,
            # when only some recipient addresses need it, to those recipients.
            needs_all = self.options.smtputf8 or not self.sender.isascii()
            refused = [i for i in todo if needs_all or not self.recipients[i].address.isascii()]
            for index in refused:
                self._settle(
                    index,
                    Verdict.BOUNCE,
                    Stage.MAIL,
                    status=_NO_UTF8,
                    detail="SMTPUTF8 is required, but was not offered by the host",
                )
            refused_set = set(refused)
            todo = [i for i in todo if i not in refused_set]
        limit = self._size_limit()
        if todo and self.options.size is not None and limit and self.options.size > limit:
            for index in todo:
                self._settle(
                    index,
                    Verdict.BOUNCE,
                    Stage.MAIL,
                    status=_TOO_BIG,
                    detail=f"message size {self.options.size} exceeds the host's limit {limit}",
                )
            return []
        return todo

    def _size_limit(self) -> int:
        """The SIZE the server announced (RFC 1870 section 4); 0 for none or no limit."""
        value = self.extensions.get("SIZE", "").strip()
        return int(value) if value.isdigit() else 0

    # --- connection, greeting, EHLO, STARTTLS ----------------------------------------------

    async def _open(self) -> None:
        await self._connect()
        await self._hello()
        if self.tls_policy is TlsPolicy.NONE:
            return
        required = self.tls_policy is TlsPolicy.REQUIRED
        if "STARTTLS" not in self.extensions:
            if required:
                raise _Abort(
                    Stage.STARTTLS,
                    Verdict.DEFER,
                    status=_NO_TLS,
                    detail="TLS is required, but STARTTLS was not offered by the host",
                )
            return
        failure = await self._starttls()
        if failure is None:
            # RFC 3207 section 4.2: forget what was learnt before TLS, ask again.
            await self._hello()
            return
        reply, status, detail = failure
        if required:
            raise _Abort(Stage.STARTTLS, Verdict.DEFER, reply=reply, status=status, detail=detail)
        # RFC 3207 section 4.1 leaves it to the client whether to go on without TLS.  A new
        # connection, because after a failed handshake the old one is in no known state.
        self.tls_fallback = detail
        self._close()
        await self._connect()
        await self._hello()

    async def _connect(self) -> None:
        smtp = aiosmtplib.SMTP(
            hostname=self.host,
            port=self.port,
            local_hostname=self.helo_name,
            source_address=(self.source_address, 0) if self.source_address else None,
            timeout=self.timeouts.greeting,
            start_tls=False,  # decided here, after EHLO, by the policy
        )
        try:
            await smtp.connect()
        except aiosmtplib.SMTPConnectResponseError as exc:
            # RFC 5321 section 3.1: e.g. a 554 greeting; the host refuses the session.
            reply = _to_reply(exc.code, exc.message, Stage.GREETING)
            raise _Abort(Stage.GREETING, classify(reply, Stage.GREETING), reply=reply) from None
        except (aiosmtplib.SMTPException, OSError) as exc:
            raise _Abort(
                Stage.CONNECT,
                Verdict.NEXT_HOST,
                status=_NO_ANSWER,
                detail=f"{type(exc).__name__}: {exc}",
            ) from None
        self.smtp = smtp
        peer = smtp.get_transport_info("peername")
        local = smtp.get_transport_info("sockname")
        self.peer = str(peer[0]) if peer else None
        self.local = str(local[0]) if local else None

    def _connected(self, stage: Stage) -> aiosmtplib.SMTP:
        if self.smtp is None or not self.smtp.is_connected:
            raise _lost(stage, "connection closed")
        return self.smtp

    async def _hello(self) -> None:
        smtp = self._connected(Stage.EHLO)
        try:
            try:
                await smtp.ehlo(hostname=self.helo_name, timeout=self.timeouts.ehlo)
            except aiosmtplib.SMTPHeloError as exc:
                reply = _to_reply(exc.code, exc.message, Stage.EHLO)
                # RFC 5321 section 3.2: a server that does not know EHLO answers 5yz; then HELO.
                if not reply.is_permanent or not smtp.is_connected:
                    raise _Abort(Stage.EHLO, classify(reply, Stage.EHLO), reply=reply) from None
                await smtp.helo(hostname=self.helo_name, timeout=self.timeouts.ehlo)
        except aiosmtplib.SMTPHeloError as exc:
            reply = _to_reply(exc.code, exc.message, Stage.EHLO)
            raise _Abort(Stage.EHLO, classify(reply, Stage.EHLO), reply=reply) from None
        except (aiosmtplib.SMTPException, OSError) as exc:
            raise _lost(Stage.EHLO, exc) from None
        self.extensions = {key.upper(): value for key, value in smtp.esmtp_extensions.items()}

    def _make_tls_context(self) -> ssl.SSLContext:
        if self.tls_context is not None:
            return self.tls_context
        verify = self.tls_verify
        if verify is None:
            verify = self.tls_policy is TlsPolicy.REQUIRED
        if verify:
            return ssl.create_default_context()
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        return context

    async def _starttls(self) -> tuple[Reply | None, EnhancedStatus, str] | None:
        """Upgrade to TLS; None on success, else (reply, status, why) for the fallback."""
        smtp = self._connected(Stage.STARTTLS)
        try:
            await smtp.starttls(
                server_hostname=self.tls_server_name,
                tls_context=self._make_tls_context(),
                timeout=self.timeouts.starttls,
            )
        except aiosmtplib.SMTPResponseException as exc:
            # A reply other than 220 (aiosmtplib uses code -1 for a garbled one).
            try:
                reply: Reply | None = reply_from_text(exc.code, exc.message)
            except ProtocolError:
                reply = None
            if reply is not None and reply.code == 421:  # RFC 5321 section 3.8: closing
                raise _Abort(Stage.STARTTLS, Verdict.NEXT_HOST, reply=reply) from None
            return reply, _NO_TLS, f"STARTTLS refused: {reply or exc}"
        except (aiosmtplib.SMTPException, ssl.SSLError, OSError) as exc:
            # aiosmtplib lets ssl.SSLError through and closes only on its own errors.
            self._close()
            return None, _TLS_FAILED, f"TLS handshake failed: {type(exc).__name__}: {exc}"
        self.tls = True
        return None

    # --- one mail transaction --------------------------------------------------------------

    async def _command(self, stage: Stage, timeout: float, *args: bytes) -> Reply:
        smtp = self._connected(stage)
        try:
            # aiosmtplib closes the connection itself after a timeout or a 421.
            response = await smtp.execute_command(*args, timeout=timeout)
        except aiosmtplib.SMTPTimeoutError:
            raise _lost(stage, f"no reply within {timeout:g} s") from None
        except (aiosmtplib.SMTPException, OSError) as exc:
            raise _lost(stage, exc) from None
        return _to_reply(response.code, response.message, stage)

    def _address(self, address: str) -> bytes:
        return b"<" + address.encode("utf-8") + b">"

    def _mail_args(self, utf8: bool) -> list[bytes]:
        options, ext = self.options, self.extensions
        args = [b"MAIL", b"FROM:" + self._address(self.sender)]
        if options.size is not None and "SIZE" in ext:
            args.append(b"SIZE=%d" % options.size)
        if options.eight_bit and "8BITMIME" in ext:
            args.append(b"BODY=8BITMIME")
        if utf8:
            args.append(b"SMTPUTF8")
        if "DSN" in ext:
            if options.ret is not None:
                args.append(b"RET=" + options.ret.value.encode("ascii"))
            if options.envid is not None:
                args.append(b"ENVID=" + options.envid.encode("ascii"))
        return args

    def _rcpt_args(self, recipient: Recipient) -> list[bytes]:
        args = [b"RCPT", b"TO:" + self._address(recipient.address)]
        if "DSN" in self.extensions:
            if recipient.notify:
                # A fixed order, so the command is the same whatever the set's order.
                words = [n.value for n in Notify if n in recipient.notify]
                args.append(b"NOTIFY=" + ",".join(words).encode("ascii"))
            if recipient.orcpt is not None:
                args.append(b"ORCPT=" + recipient.orcpt.encode("ascii"))
        return args

    async def _transaction(self, todo: list[int]) -> list[int]:
        """Run one MAIL transaction for ``todo``; return those to send in another (452)."""
        timeouts = self.timeouts
        if self.in_transaction:
            # RFC 5321 section 4.1.1.5: a transaction that did not end with the reply to the
            # end of data (DATA refused) is still open; RSET clears it.  After the reply to
            # the end of data the state is already clear (section 4.1.1.4): no RSET then.
            reply = await self._command(Stage.RSET, timeouts.rset, b"RSET")
            if not reply.is_positive:
                raise _Abort(Stage.RSET, classify(reply, Stage.RSET), reply=reply)
            self.in_transaction = False
        self.transactions += 1
        utf8 = "SMTPUTF8" in self.extensions and (
            self.options.smtputf8
            or not self.sender.isascii()
            or not all(self.recipients[i].address.isascii() for i in todo)
        )
        reply = await self._command(Stage.MAIL, timeouts.mail, *self._mail_args(utf8))
        if not reply.is_positive:
            self._settle_by_reply(todo, Stage.MAIL, reply)
            if reply.code == 421:
                raise _Abort(Stage.MAIL, Verdict.NEXT_HOST, reply=reply)
            return []
        self.in_transaction = True

        accepted: list[int] = []
        later: list[int] = []
        for position, index in enumerate(todo):
            args = self._rcpt_args(self.recipients[index])
            reply = await self._command(Stage.RCPT, timeouts.rcpt, *args)
            if reply.is_positive:
                accepted.append(index)
            elif reply.code == 452 and accepted:
                # RFC 5321 section 4.5.3.1.10: the server's recipient limit.  Deliver to those
                # accepted, then send the rest in a new transaction.
                later = todo[position:]
                break
            else:
                self._settle_by_reply([index], Stage.RCPT, reply)
                if reply.code == 421:
                    raise _Abort(Stage.RCPT, Verdict.NEXT_HOST, reply=reply)
        if not accepted:
            return []  # no DATA without a recipient (RFC 5321 section 3.3); QUIT ends it

        reply = await self._command(Stage.DATA, timeouts.data_init, b"DATA")
        if reply.code != 354:
            self._settle_by_reply(accepted, Stage.DATA, reply)
            if reply.code == 421:
                raise _Abort(Stage.DATA, Verdict.NEXT_HOST, reply=reply)
            return later
        await self._send_body(accepted)
        return later

    # --- the body and the end of data ------------------------------------------------------

    async def _send_body(self, accepted: list[int]) -> None:
        """Stream the body, the final dot, and settle ``accepted`` by the final reply."""
        smtp = self._connected(Stage.DATA)
        protocol = smtp.protocol
        if protocol is None:  # pragma: no cover - _connected checked it
            raise _lost(Stage.DATA, "connection closed")
        stuffer = DotStuffer(self.max_line_length)
        chunks = _chunks(self.body())
        try:
            while True:
                try:
                    chunk = await anext(chunks)
                except StopAsyncIteration:
                    break
                except Exception as exc:
                    # The body source failed (a local fault).  Closing without the final dot
                    # makes the server discard the message (RFC 5321 section 4.1.1.4).
                    raise _Abort(
                        Stage.DATA,
                        Verdict.DEFER,
                        status=_LOCAL_ERROR,
                        detail=f"reading the message body failed: {type(exc).__name__}: {exc}",
                    ) from None
                wire = stuffer.feed(chunk)
                if wire:
                    await self._write(protocol, wire)
        finally:
            await chunks.aclose()

        # No await between writing the dot and read_response(): see the module docstring.
        try:
            protocol.write(stuffer.finish())
        except (aiosmtplib.SMTPException, OSError) as exc:
            raise _lost(Stage.DATA, exc) from None
        try:
            response = await protocol.read_response(timeout=self.timeouts.data_end)
            reply: Reply | None = reply_from_text(response.code, response.message)
            detail = ""
        except aiosmtplib.SMTPTimeoutError:
            reply, detail = None, f"no reply to the end of data within {self.timeouts.data_end:g} s"
        except (aiosmtplib.SMTPException, OSError, ProtocolError) as exc:
            reply, detail = None, f"no usable reply to the end of data: {exc}"

        if reply is not None and reply.code != 421:
            self._settle_by_reply(accepted, Stage.END_OF_DATA, reply)
            self.in_transaction = False
            return
        # RFC 1047: the message may have been taken.  DEFER rather than the NEXT_HOST that
        # classify() gives, so that the retry waits instead of sending a copy at once.
        for index in accepted:
            self._settle(
                index,
                Verdict.DEFER,
                Stage.END_OF_DATA,
                reply=reply,
                status=_BAD_CONNECTION if reply is None else None,
                detail=detail or "421 after the end of data",
                possible_duplicate=True,
            )
        raise _lost(Stage.END_OF_DATA, "not sent: no usable reply to the previous transaction")

    async def _write(self, protocol: SMTPProtocol, wire: bytes) -> None:
        try:
            protocol.write(wire)
            # RFC 5321 section 4.5.3.2.5: each block must go out within the data timeout.
            await asyncio.wait_for(protocol._drain_helper(), self.timeouts.data_block)
        except TimeoutError:
            raise _lost(
                Stage.DATA, f"sending the message stalled for {self.timeouts.data_block:g} s"
            ) from None
        except (aiosmtplib.SMTPException, OSError) as exc:
            raise _lost(Stage.DATA, exc) from None

    # --- the end ---------------------------------------------------------------------------

    async def _quit(self) -> None:
        """Say QUIT; the outcome is already settled, so nothing here changes it."""
        if self.smtp is None or not self.smtp.is_connected:
            return
        # RFC 5321 section 4.1.1.10: the transactions are over either way.
        with contextlib.suppress(aiosmtplib.SMTPException, OSError):
            await self.smtp.execute_command(b"QUIT", timeout=self.timeouts.quit)

    def _close(self) -> None:
        if self.smtp is not None:
            self.smtp.close()
            self.smtp = None


def _check_arguments(helo_name: str, recipients: Sequence[Recipient], options: MailOptions) -> None:
    """Refuse (ValueError) what is a caller's mistake rather than a remote outcome."""
    if not _PRINTABLE.fullmatch(helo_name):
        raise ValueError(f"helo_name must be printable ASCII without spaces: {helo_name!r}")
    if options.envid is not None and not _PRINTABLE.fullmatch(options.envid):
        raise ValueError(f"ENVID must be xtext (RFC 3461 section 4.4): {options.envid!r}")
    if options.size is not None and options.size < 0:
        raise ValueError(f"size must not be negative: {options.size}")
    for recipient in recipients:
        if Notify.NEVER in recipient.notify and len(recipient.notify) > 1:
            raise ValueError("NOTIFY=NEVER cannot be combined (RFC 3461 section 4.1)")
        if recipient.orcpt is not None and not _ORCPT.fullmatch(recipient.orcpt):
            raise ValueError(f"ORCPT must be addr-type;xtext (RFC 3461): {recipient.orcpt!r}")


async def deliver(
    *,
    host: str,
    port: int,
    helo_name: str,
    sender: str,
    recipients: Sequence[str | Recipient],
    body: BodySource,
    source_address: str | None = None,
    tls: TlsPolicy = TlsPolicy.OPPORTUNISTIC,
    tls_verify: bool | None = None,
    tls_server_name: str | None = None,
    tls_context: ssl.SSLContext | None = None,
    timeouts: Timeouts = RFC5321_TIMEOUTS,
    options: MailOptions | None = None,
    max_line_length: int = DEFAULT_MAX_LINE_LENGTH,
    cache: ConnectionCache | None = None,
) -> TransactionResult:
    """Deliver one message to ``recipients`` through the server at ``host``:``port``.

    ``sender`` is the envelope sender, "" for the null reverse-path.  ``body`` opens the
    message body (see :data:`BodySource`); line endings, dot-stuffing and long lines are taken
    care of on the way out (``max_line_length``: see :class:`DotStuffer`).  ``source_address``
    binds the local end (IP pools).  ``tls_verify`` None means: verify the certificate for
    REQUIRED, not for OPPORTUNISTIC; ``tls_server_name`` is the name sent (SNI) and checked
    (default ``host``); ``tls_context`` replaces both.  ``cache``: take a kept connection to
    this destination if there is one, and keep this one afterwards (see the module docstring).

    Returns a result per recipient, in order; never raises for anything the remote host does.
    Raises ValueError for arguments that cannot be sent (a HELO name with spaces, an ENVID or
    ORCPT that is not xtext, NOTIFY=NEVER combined with another keyword).
    """
    rcpts = [r if isinstance(r, Recipient) else Recipient(r) for r in recipients]
    options = options or MailOptions()
    _check_arguments(helo_name, rcpts, options)
    session = _Session(
        host=host,
        port=port,
        helo_name=helo_name,
        sender=sender,
        recipients=rcpts,
        body=body,
        source_address=source_address,
        tls=tls,
        tls_verify=tls_verify,
        tls_server_name=tls_server_name,
        tls_context=tls_context,
        timeouts=timeouts,
        options=options,
        max_line_length=max_line_length,
        cache=cache,
    )
    return await session.run()
