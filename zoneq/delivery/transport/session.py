"""The SMTP client session: one host, one message, a result per recipient.

Theory of operation
-------------------
:func:`deliver` takes a kept connection to the destination or opens one (``dialogue.py``:
connect, EHLO, STARTTLS as the policy says), then runs mail transactions
(``transaction.py``) until every recipient is settled, and keeps the connection for the next
message or says QUIT.  Whatever the remote host does, the outcome is a value, a
:class:`~zoneq.delivery.results.TransactionResult` holding one
:class:`~zoneq.delivery.results.RecipientResult` per recipient; replies are judged by
:func:`~zoneq.protocol.replies.classify`.  Internally an ``Abort`` unwinds the session when it
cannot go on; every recipient not settled by then gets the verdict it carries.

The package's parts:

* ``dialogue.py``: the session set up with aiosmtplib (the only module importing it);
* ``channel.py`` and ``replies.py``: the connection afterwards, with a reply reader of our own
  that keeps every reply of a pipelined group (RFC 2920);
* ``pipeline.py``: a group of commands written at once (or one by one) and their replies
  matched in order;
* ``transaction.py``: MAIL, RCPT..., DATA and what each reply settles; ``data.py``: the body,
  the final dot and its reply (RFC 1047 possible duplicates);
* ``cache.py``: kept connections; ``ledger.py``: the outcome of each recipient.

Timeouts are RFC 5321 section 4.5.3.2's, per reply (:class:`Timeouts`), pipelined or not:
a server that needs two minutes to scan a message would otherwise be timed out after it has
the message, and the retry would deliver a second copy.

A 452 to a RCPT after at least one recipient was accepted means "too many recipients" (RFC 5321
section 4.5.3.1.10, which has a 552 there treated alike): the transaction goes on with those
accepted, and the rest are sent in a new transaction on the same connection, reading the body
again from ``body()``.

Connection reuse: with a :class:`ConnectionCache`, a session that ended cleanly (its last
transaction answered, nothing open, no stray reply waiting: ``Channel.quiet``) is kept
instead of QUIT, and the next message to the same destination (host, port, source address,
TLS policy and name, HELO name, implicit TLS, AUTH user) starts with MAIL on it, as
Postfix's connection cache does: no TCP handshake, greeting, EHLO or TLS handshake per
message.  A session whose last transaction is still open (every recipient refused, or DATA
refused) says RSET first, and is kept if that is answered 250.  A kept connection the server
closed while it was idle shows at the first MAIL (lost, or a 421): the session then opens a
fresh connection and goes on as if new, so an idle timeout never sends recipients to the next
MX host.  Under the core's connection limits a connection is kept under the job's *slot*,
and the next job on that slot takes it first (``cache.py``).
"""

from __future__ import annotations

import ssl
from collections.abc import Sequence

from zoneq.delivery.results import TransactionResult
from zoneq.delivery.transport.abort import (
    BAD_RCPT_SYNTAX,
    BAD_SENDER_SYNTAX,
    NO_UTF8,
    TOO_BIG,
    Abort,
)
from zoneq.delivery.transport.cache import CacheKey, Connection, ConnectionCache
from zoneq.delivery.transport.channel import ChannelClosed, ChannelTimeout
from zoneq.delivery.transport.commands import RSET, check_arguments, has_control
from zoneq.delivery.transport.dialogue import Destination, Seen, open_session
from zoneq.delivery.transport.ledger import Ledger
from zoneq.delivery.transport.options import (
    RFC5321_TIMEOUTS,
    BodySource,
    MailOptions,
    Recipient,
    Timeouts,
    TlsPolicy,
)
from zoneq.delivery.transport.transaction import Envelope, transaction
from zoneq.protocol.encoder import DEFAULT_MAX_LINE_LENGTH
from zoneq.protocol.replies import Stage, Verdict


class _Session:
    """One call of :func:`deliver`: the connection and what has been settled so far."""

    def __init__(
        self, dest: Destination, envelope: Envelope, cache: ConnectionCache | None, slot: int = 0
    ) -> None:
        self.dest = dest
        self.envelope = envelope
        self.cache = cache
        self.slot = slot
        self.ledger = Ledger(envelope.recipients)
        self.link: Connection | None = None
        self.seen = Seen()  # what opening a connection learnt, even if it then failed

    def _result(self) -> TransactionResult:
        facts = self.link or self.seen
        return TransactionResult(
            host=self.dest.host,
            port=self.dest.port,
            recipients=self.ledger.outcomes(),
            peer=facts.peer,
            local=facts.local,
            tls=facts.tls,
            tls_fallback=facts.tls_fallback,
            extensions=frozenset(facts.extensions),
            transactions=self.ledger.transactions,
        )

    async def run(self) -> TransactionResult:
        todo = self._check_syntax()
        kept = False
        try:
            if todo:
                reused = await self._adopt()
                if not reused:
                    self.link = await open_session(self.dest, self.seen)
                ready = self._check_features(todo)
                # Each extra transaction settles at least one recipient, so this ends.
                while ready:
                    link = self.link
                    assert link is not None
                    try:
                        ready = await transaction(link, self.ledger, self.envelope, ready)
                    except Abort as abort:
                        if not (reused and self._died_idle(abort)):
                            raise
                        # The kept connection was closed while idle: start afresh, once.
                        reused = False
                        ready = await self._reopen(ready)
                    reused = False
                kept = await self._keep()
                if not kept:
                    await self._quit()
        except Abort as abort:
            self.ledger.settle_rest(abort)
        finally:
            if not kept:
                self._close()
        return self._result()

    # --- reuse ----------------------------------------------------------------------------

    def _key(self) -> CacheKey:
        dest = self.dest
        return (
            dest.host,
            dest.port,
            dest.source_address,
            dest.tls_policy.value,
            dest.tls_server_name,
            dest.helo_name,
            dest.implicit_tls,
            dest.auth[0] if dest.auth is not None else None,
        )

    async def _adopt(self) -> bool:
        """Start on a cached connection to this destination, if one is waiting (the one
        kept under this job's slot first, ``cache.py``)."""
        if self.cache is None:
            return False
        self.link = await self.cache.adopt(self._key(), self.slot)
        return self.link is not None

    def _died_idle(self, abort: Abort) -> bool:
        """Did the first MAIL on a kept connection find it closed (lost, or a 421)?"""
        if self.ledger.transactions > 1 or abort.stage is not Stage.MAIL:
            return False
        return abort.reply is None or abort.reply.code == 421

    async def _reopen(self, ready: list[int]) -> list[int]:
        self.ledger.forget(ready)  # a 421 at MAIL settled them: that was the idle close
        self._close()
        self.link, self.seen = None, Seen()
        self.ledger.transactions = 0
        self.link = await open_session(self.dest, self.seen)
        return self._check_features(ready)

    async def _keep(self) -> bool:
        """Hand a cleanly ended connection to the cache instead of saying QUIT."""
        link = self.link
        if self.cache is None or link is None or not link.channel.is_open:
            return False
        if link.open_transaction and not await self._reset(link):
            return False
        if not link.messages:
            link.opened = self.cache.now()
        link.messages += 1
        return self.cache.put(self._key(), link, self.slot)

    async def _reset(self, link: Connection) -> bool:
        """RSET an open transaction (RFC 5321 section 4.1.1.5) so the connection can be kept."""
        try:
            link.channel.write(RSET)
            reply = await link.channel.read(self.envelope.timeouts.rset)
        except (ChannelClosed, ChannelTimeout):
            return False
        link.open_transaction = not reply.is_positive
        return reply.is_positive

    # --- checks before anything is sent ----------------------------------------------------

    def _check_syntax(self) -> list[int]:
        """Settle recipients whose address cannot be put in a command; return the others."""
        recipients = self.envelope.recipients
        if has_control(self.envelope.sender):
            for index in range(len(recipients)):
                self.ledger.settle(
                    index,
                    Verdict.BOUNCE,
                    Stage.MAIL,
                    status=BAD_SENDER_SYNTAX,
                    detail="sender address contains control characters",
                )
            return []
        todo = []
        for index, recipient in enumerate(recipients):
            if not recipient.address or has_control(recipient.address):
                self.ledger.settle(
                    index,
                    Verdict.BOUNCE,
                    Stage.RCPT,
                    status=BAD_RCPT_SYNTAX,
                    detail="recipient address is empty or contains control characters",
                )
            else:
                todo.append(index)
        return todo

    def _check_features(self, todo: list[int]) -> list[int]:
        """Settle what this server cannot take (SMTPUTF8, SIZE); return the others."""
        assert self.link is not None
        extensions = self.link.extensions
        options, recipients = self.envelope.options, self.envelope.recipients
        if "SMTPUTF8" not in extensions:
            # RFC 6531 section 3.4: without SMTPUTF8 the message cannot go to this server, or,
            # when only some recipient addresses need it, to those recipients.
            needs_all = options.smtputf8 or not self.envelope.sender.isascii()
            refused = [i for i in todo if needs_all or not recipients[i].address.isascii()]
            for index in refused:
                self.ledger.settle(
                    index,
                    Verdict.BOUNCE,
                    Stage.MAIL,
                    status=NO_UTF8,
                    detail="SMTPUTF8 is required, but was not offered by the host",
                )
            refused_set = set(refused)
            todo = [i for i in todo if i not in refused_set]
        # RFC 1870 section 4: the SIZE the server announced; 0 for none or no limit.
        value = extensions.get("SIZE", "").strip()
        limit = int(value) if value.isdigit() else 0
        if todo and options.size is not None and limit and options.size > limit:
            for index in todo:
                self.ledger.settle(
                    index,
                    Verdict.BOUNCE,
                    Stage.MAIL,
                    status=TOO_BIG,
                    detail=f"message size {options.size} exceeds the host's limit {limit}",
                )
            return []
        return todo

    # --- the end ---------------------------------------------------------------------------

    async def _quit(self) -> None:
        """Say QUIT; the outcome is already settled, so nothing here changes it."""
        if self.link is not None and self.link.channel.is_open:
            # RFC 5321 section 4.1.1.10: the transactions are over either way.
            await self.link.channel.quit(self.envelope.timeouts.quit)

    def _close(self) -> None:
        if self.link is not None:  # kept for the result's facts
            self.link.channel.abort()


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
    implicit_tls: bool = False,
    auth: tuple[str, str] | None = None,
    slot: int = 0,
) -> TransactionResult:
    """Deliver one message to ``recipients`` through the server at ``host``:``port``.

    ``sender`` is the envelope sender, "" for the null reverse-path.  ``body`` opens the
    message body (see :data:`BodySource`); line endings, dot-stuffing and long lines are taken
    care of on the way out (``max_line_length``: see :class:`DotStuffer`).  ``source_address``
    binds the local end (IP pools).  ``tls_verify`` None means: verify the certificate for
    REQUIRED, not for OPPORTUNISTIC; ``tls_server_name`` is the name sent (SNI) and checked
    (default ``host``); ``tls_context`` replaces both.  ``cache``: take a kept connection to
    this destination if there is one, and keep this one afterwards (see the module docstring).
    ``implicit_tls``: TLS from the first byte (port 465) instead of STARTTLS; ``auth``: (user,
    password) for AUTH once under TLS (smarthosts, ``dialogue.py``).  ``slot``: the core's
    connection slot of the job (``cache.py``); the connection is kept under it.

    Returns a result per recipient, in order; never raises for anything the remote host does.
    Raises ValueError for arguments that cannot be sent (a HELO name with spaces, an ENVID
    that is not xtext, NOTIFY=NEVER combined with another keyword).
    """
    rcpts = [r if isinstance(r, Recipient) else Recipient(r) for r in recipients]
    options = options or MailOptions()
    check_arguments(helo_name, rcpts, options)
    dest = Destination(
        host=host,
        port=port,
        helo_name=helo_name,
        source_address=source_address,
        tls_policy=tls,
        tls_verify=tls_verify,
        tls_server_name=tls_server_name or host,
        tls_context=tls_context,
        timeouts=timeouts,
        implicit_tls=implicit_tls,
        auth=auth,
    )
    envelope = Envelope(
        sender=sender,
        recipients=rcpts,
        options=options,
        body=body,
        timeouts=timeouts,
        max_line_length=max_line_length,
    )
    return await _Session(dest, envelope, cache, slot).run()
