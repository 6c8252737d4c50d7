"""The server side of SMTP as a sans-IO state machine (RFC 5321), for zoneq's receiver.

Theory of operation
-------------------
``ServerConnection`` owns no socket and reads no clock.  The driver (the asyncio server
around it) does three things in a loop: it feeds bytes as they arrive to ``receive``, acts
on the events that come back, and writes out ``data_to_send()``.  Like h11, the machine is
"bytes in, events and bytes out":

* Bytes are buffered and cut into lines; only CRLF ends a line (RFC 5321 section 2.3.8).
  A bare CR or LF never ends anything, which is what defeats SMTP smuggling.  A command
  line may be ``max_command_line`` octets (512, section 4.5.3.1.4), more for MAIL and RCPT
  by what their parameters may add (``_EXTENDED``: RFC 1870, 3461, 6152, 6531).
* Each command line is parsed (``smtp_commands``) and checked against the state table
  ``_ALLOWED`` (RFC 5321 section 4.1.4 ordering).  Faults of the peer never raise: they
  become replies (``CommandError`` carries the reply to send).
* Every 4xx/5xx reply counts as an error; the one that reaches ``max_errors`` is followed
  by 421 4.7.0 and the session closes (Postfix's ``smtpd_hard_error_limit``): otherwise a
  client could hold a session for ever with bad commands, or harvest addresses with
  refused RCPTs.  A message accepted (250 at the final dot) starts the count again, so a
  bulk session with a refused recipient now and then is never cut off.  One exception:
  the 452 for a recipient past ``max_recipients`` is not an error, for as many again as
  the limit (Postfix's ``smtpd_recipient_overshoot_limit``).  RFC 5321 section 4.5.3.1.10
  has the client send those recipients later, in another transaction; a client pipelining
  a long list would otherwise reach the limit and lose with the 421 every recipient
  already accepted, on every retry.  That 452 is given before any lookup, so it tells a
  harvester nothing; past the allowance each counts again, so a client cannot send RCPTs
  for ever (clients send at most their own recipient limit per transaction, Postfix's 50).
* Commands the machine can answer alone (EHLO, NOOP, RSET, ...) are answered at once.
  Commands that need the driver's judgement (``MailFrom``, ``RcptTo``, ``DataStart``,
  ``DataEnd``, ``AuthRequest``, ``AuthResponse``) become events with ``needs_decision``;
  the machine then stops reading input until the driver calls ``accept`` or ``reject``
  (or ``challenge`` for AUTH).  Commands pipelined behind it (RFC 2920) wait in the buffer,
  so replies always go out in command order.  ``accept``/``reject`` return the events that
  resuming the buffered input produced.  Deciding when nothing is pending raises
  ``DecisionError``: that is a bug in the driver, not the peer.
* DATA (RFC 5321 section 4.1.1.4) is streamed: body bytes come out as ``DataChunk``
  events, dot-unstuffed (section 4.5.2), CRLF kept, never accumulated (the machine holds
  at most the two bytes that might begin the end marker, plus one trailing CR).  Chunk
  boundaries carry no meaning.  The end is exactly CRLF "." CRLF.

Choices about bad message data (the decision is made at the final dot, as Postfix's
``smtpd_forbid_bare_newline`` does, so the client is still in step with us):

* A bare CR or LF anywhere in DATA (the 2023 smuggling sequences ``<LF>.<LF>``,
  ``<LF>.<CR><LF>``, ``<CR>.<CR>``, ``<CR><LF>.<LF>``) does not end the message; the
  message is refused after the real final dot with 554 5.6.0 (RFC 3463 section 3.7,
  "other media error": the registry has no code specific to bare newlines).
* A NUL octet anywhere in DATA is refused the same way, 554 5.6.0 after the real final
  dot.  NUL is not message text without BINARYMIME (RFC 5322 section 3.5 ``text`` and
  RFC 2045 sections 2.7-2.8 exclude it; RFC 3030, not offered here), and the NUL variants
  of the smuggling research (``<CR><LF>NUL.<CR><LF>``, ``<CR><LF>.NUL<CR><LF>``: some
  servers drop NULs or end a line at one) would otherwise be stored and passed on.
* A text line over ``max_text_line`` octets, CRLF included (RFC 5321 section 4.5.3.1.6),
  is refused after the final dot with 500 5.5.2 "Line too long" (section 4.5.3.1.10 lists
  500 for it).
* More than ``max_message_size`` octets (after unstuffing) is refused after the final dot
  with 552 5.3.4 (RFC 1870 section 6.3).
* The first fault found decides the reply; from that byte on no ``DataChunk`` is emitted
  and the rest is only scanned for the end.  The event is ``DataEnd(rejected=reply)``,
  already answered: the driver must discard what it received for the message.

STARTTLS (RFC 3207): the machine answers 220, emits ``StartTLS``, discards whatever was
pipelined behind the command (section 4.2 and the 2011 command-injection bugs), and ignores
input until the driver calls ``tls_established()``; the session is then back to its
initial state and the client must send EHLO again.

AUTH (RFC 4954) is left to the driver: ``AuthRequest(mechanism, initial)`` with the initial
response base64-decoded; the driver answers ``accept`` (235), ``reject`` (535, ...) or
``challenge(data)`` (334), after which the client's next line arrives as ``AuthResponse``.
That line may be ``SASL_RESPONSE_LIMIT`` octets, not 512 (the AUTH command line itself
stays at 512: RFC 4954 section 4 has the client drop the initial response rather than
exceed it).  A line the machine refuses there (too long: 500 5.5.6; a bare CR/LF, NUL or
invalid UTF-8, which cannot be base64: 501 5.5.2) fails the AUTH command (RFC 4954
section 4), so the client's next line is read as a command again, never as a response.
MAIL's ``AUTH=`` parameter (RFC 4954 section 5) is accepted once EHLO advertised AUTH; it
adds 500 octets to the MAIL line limit when present.
"""

from __future__ import annotations

import base64
import binascii
import enum
import functools
from typing import Final

from zoneq.protocol.replies import EnhancedStatus, Reply
from zoneq.protocol.smtp_commands import (
    CommandError,
    bad_arguments,
    parse_mail,
    parse_rcpt,
    split_command,
    syntax_error,
)

__all__ = [
    "AUTH_MECHANISMS",
    "SASL_RESPONSE_LIMIT",
    "AuthRequest",
    "AuthResponse",
    "DataChunk",
    "DataEnd",
    "DataStart",
    "DecisionError",
    "Event",
    "Hello",
    "MailFrom",
    "Quit",
    "RcptTo",
    "Reset",
    "ServerConnection",
    "StartTLS",
    "State",
]

from zoneq.protocol.smtp_events import (
    AuthRequest,
    AuthResponse,
    DataChunk,
    DataEnd,
    DataStart,
    Event,
    Hello,
    MailFrom,
    Quit,
    RcptTo,
    Reset,
    StartTLS,
)

_CRLF: Final = b"\r\n"
_END_MARK: Final = b".\r\n"  # at the start of a line: the end of DATA (RFC 5321 4.1.1.4)
_FAST_WINDOW: Final = 16_384  # octets of whole lines the DATA fast path takes at a time
AUTH_MECHANISMS: Final = ("PLAIN", "LOGIN")
# RFC 4954 section 4: a server MUST take SASL responses as long as its mechanisms' largest
# encoded one, and names 12288 octets as enough for nearly all (Postfix's
# smtpd_sasl_response_limit is the same).  PLAIN's three parts of up to 255 octets
# (RFC 4616 section 2) are 1,024 in base64: 512 would refuse valid credentials.
SASL_RESPONSE_LIMIT: Final = 12_288


def _r(code: int, text: str, klass: int, subject: int, detail: int) -> Reply:
    return Reply(code, (text,), EnhancedStatus(klass, subject, detail))


# Replies, with RFC 3463 codes (RFC 2034 puts them on every reply but greeting and EHLO).
OK: Final = _r(250, "OK", 2, 0, 0)
SENDER_OK: Final = _r(250, "Sender OK", 2, 1, 0)
RECIPIENT_OK: Final = _r(250, "Recipient OK", 2, 1, 5)
START_INPUT: Final = Reply(354, ("End data with <CR><LF>.<CR><LF>",))
QUEUED: Final = _r(250, "OK queued", 2, 0, 0)
AUTH_OK: Final = _r(235, "Authentication successful", 2, 7, 0)
BYE: Final = _r(221, "Bye", 2, 0, 0)
BAD_SEQUENCE_HELLO: Final = _r(503, "Send EHLO/HELO first", 5, 5, 1)
LINE_TOO_LONG: Final = syntax_error("Line too long")
BARE_NEWLINE_IN_COMMAND: Final = syntax_error("Bare CR or LF not allowed")
NUL_IN_COMMAND: Final = syntax_error("NUL octet not allowed")
TOO_MANY_RECIPIENTS: Final = _r(452, "Too many recipients", 4, 5, 3)
MESSAGE_TOO_BIG: Final = _r(552, "Message size exceeds fixed maximum message size", 5, 3, 4)
BARE_NEWLINE_IN_DATA: Final = _r(554, "Bare CR or LF not allowed in message data", 5, 6, 0)
NUL_IN_DATA: Final = _r(554, "NUL octet not allowed in message data", 5, 6, 0)
# RFC 4954 section 6: 500 5.5.6 for a SASL response longer than the server takes; 501 5.5.2
# (section 4) for one that is not base64.
AUTH_LINE_TOO_LONG: Final = _r(500, "Authentication Exchange line is too long", 5, 5, 6)
INVALID_BASE64: Final = _r(501, "Invalid base64 data", 5, 5, 2)
TEXT_LINE_TOO_LONG: Final = syntax_error("Line too long")


class DecisionError(RuntimeError):
    """The driver misused the machine (decided twice, or with a reply of the wrong kind)."""


class State(enum.Enum):
    """Where the session is (RFC 5321 section 4.1.4 ordering)."""

    INITIAL = "initial"  # no EHLO/HELO yet (also after STARTTLS)
    READY = "ready"  # greeted, no mail transaction
    MAIL = "mail"  # MAIL accepted, no recipient yet
    RCPT = "rcpt"  # at least one recipient accepted
    DATA = "data"  # receiving message text
    AUTH = "auth"  # 334 sent, waiting for the client's SASL line
    TLS = "tls"  # 220 to STARTTLS sent, waiting for the handshake
    CLOSED = "closed"  # QUIT answered, or a 421 sent


_IN_TRANSACTION: Final = frozenset({State.MAIL, State.RCPT})
_NEED_MAIL: Final = _r(503, "Need MAIL command", 5, 5, 1)
_NEED_RCPT: Final = _r(503, "Need RCPT command", 5, 5, 1)
_NESTED_MAIL: Final = _r(503, "Sender already specified", 5, 5, 1)

# Octets that parameters may add to a command line beyond the 512 of RFC 5321 section
# 4.5.3.1.4 ("... may be increased by ... extensions"): MAIL SIZE= 26 (RFC 1870 section 3),
# BODY= 15 (RFC 6152 section 2), SMTPUTF8 10 (RFC 6531 section 3.1), ENVID= and RET= 100
# (RFC 3461 section 4); RCPT NOTIFY= and ORCPT= 500 (RFC 3461 section 4).  Keyed by the
# verb and its space, as the line starts.
_EXTENDED: Final = {b"MAIL ": 26 + 15 + 10 + 100, b"RCPT ": 500}
# MAIL's AUTH= adds 500 more (RFC 4954 section 5) when the line has it within the limit
# above, so that a line cut anywhere is judged the same as the whole line.
_AUTH_PARAMETER: Final = b" AUTH="
_AUTH_EXTRA: Final = 500


class ServerConnection:
    """One SMTP session seen from the server.  See the module docstring."""

    def __init__(
        self,
        hostname: str,
        *,
        max_message_size: int,
        max_recipients: int = 1000,
        max_command_line: int = 512,
        max_text_line: int = 1000,
        max_errors: int = 20,
        auth_offered: bool = False,
        tls_offered: bool = False,
        tls_active: bool = False,
    ) -> None:
        if max_command_line < 8 or max_text_line < 3 or max_message_size < 0 or max_errors < 1:
            raise ValueError("limits too small")
        self.hostname = hostname
        self.max_message_size = max_message_size
        self.max_recipients = max_recipients
        self.max_command_line = max_command_line  # RFC 5321 4.5.3.1.4: 512 with CRLF
        self.max_text_line = max_text_line  # RFC 5321 4.5.3.1.6: 1000 with CRLF
        self.max_errors = max_errors  # error replies before 421 (smtpd_hard_error_limit)
        self.errors = 0  # error replies since the session began or last accepted a message
        self.auth_offered = auth_offered
        self.tls_offered = tls_offered
        self.tls_active = tls_active
        self.authenticated = False
        self.state = State.INITIAL
        self.pending: Event | None = None
        self._esmtp = False
        self._smtputf8 = False
        self._recipients = 0
        self._overshoot = 0  # 452s past max_recipients in this transaction
        self._buffer = bytearray()
        self._out = bytearray()
        self._discarding = False  # inside an over-long command line
        # DATA
        self._chunk = bytearray()
        self._line_start = True
        self._line_len = 0
        self._data_size = 0
        self._fault: Reply | None = None
        self._careful = 0  # octets the careful path takes before the fast path is tried again

    # --- driver API ---------------------------------------------------------------------

    def greeting(self) -> bytes:
        """The 220 banner (RFC 5321 section 4.3.1; RFC 2034: no enhanced code here)."""
        return _greeting(self.hostname)

    def data_to_send(self) -> bytes:
        """Replies produced so far, in order; the buffer is emptied."""
        out = bytes(self._out)
        self._out.clear()
        return out

    @property
    def closed(self) -> bool:
        """True once QUIT was answered or a 421 was sent: close after sending."""
        return self.state is State.CLOSED

    def receive(self, data: bytes) -> list[Event]:
        """Feed bytes from the peer; returns the events they produce, in order.

        While a decision is pending the bytes are only buffered (the driver should stop
        reading until it decides, to bound the buffer).  After STARTTLS (until
        ``tls_established``) and after the session closed, input is discarded.
        """
        if self.state in (State.TLS, State.CLOSED):
            return []
        self._buffer += data
        return self._process()

    def accept(self, reply: Reply | None = None) -> list[Event]:
        """Accept the pending event, answering ``reply`` or the default for it."""
        event = self._peek_pending()
        default = START_INPUT if isinstance(event, DataStart) else None
        if reply is None:
            reply = default or _DEFAULT_ACCEPT[type(event)]
        expected = 354 if isinstance(event, DataStart) else None
        if (expected is not None and reply.code != expected) or (
            expected is None and not reply.is_positive
        ):
            raise DecisionError(f"cannot accept {event!r} with {reply}")
        self.pending = None
        if isinstance(event, MailFrom):
            self.state = State.MAIL
            self._smtputf8 = event.smtputf8
        elif isinstance(event, RcptTo):
            self._recipients += 1
            self.state = State.RCPT
        elif isinstance(event, DataStart):
            self._start_data()
        elif isinstance(event, AuthRequest | AuthResponse):
            self.authenticated = True
            self.state = State.READY
        elif isinstance(event, DataEnd):
            self.errors = 0  # mail delivered: the error limit is for sessions that deliver none
        self._send(reply)
        return self._process()

    def reject(self, reply: Reply) -> list[Event]:
        """Refuse the pending event with a 4yz or 5yz ``reply``.  A 421 closes the session
        (RFC 5321 section 3.8)."""
        event = self._peek_pending()
        if reply.code < 400:
            raise DecisionError(f"cannot reject {event!r} with {reply}")
        self.pending = None
        if isinstance(event, AuthRequest | AuthResponse):
            self.state = State.READY
        self._send(reply)
        return self._process()

    def challenge(self, data: bytes) -> list[Event]:
        """Answer a pending AUTH event with 334 and ``data`` (base64-encoded here)."""
        if not isinstance(self.pending, AuthRequest | AuthResponse):
            raise DecisionError(f"no AUTH exchange pending (pending: {self.pending!r})")
        self.pending = None
        self.state = State.AUTH
        # RFC 4954 section 4: continue-req = "334" SP [base64] CRLF.  The space stays even
        # for an empty challenge (PLAIN without an initial response), which Reply.to_wire
        # would drop as RFC 5321 section 4.2 has it for replies without text.
        self._out += b"334 " + base64.b64encode(data) + _CRLF
        return self._process()

    def tls_established(self) -> list[Event]:
        """The TLS handshake after STARTTLS succeeded: back to the initial state
        (RFC 3207 section 4.2); the client must send EHLO again."""
        if self.state is not State.TLS:
            raise DecisionError("tls_established() without STARTTLS")
        self.tls_active = True
        self.state = State.INITIAL
        self._esmtp = False
        self._reset_transaction()
        return []

    # --- internals ----------------------------------------------------------------------

    def _peek_pending(self) -> Event:
        event = self.pending
        if event is None:
            raise DecisionError("no decision is pending")
        return event

    def _send(self, reply: Reply, *, counted: bool = True) -> None:
        self._out += _wire(reply)
        if reply.code < 400 or not counted:
            return
        if reply.code == 421:
            self.state = State.CLOSED
            return
        self.errors += 1
        if self.errors >= self.max_errors:
            # RFC 5321 section 3.8: a server may close with 421 when it must, naming itself
            # (section 4.2.3: "421 <domain> Service not available"); Postfix says "421 4.7.0
            # host Error: too many errors" at its smtpd_hard_error_limit.
            self._out += _wire(
                _r(421, f"{self.hostname} Too many errors, closing connection", 4, 7, 0)
            )
            self.state = State.CLOSED

    def _decide(self, event: Event, events: list[Event]) -> None:
        events.append(event)
        self.pending = event

    def _reset_transaction(self) -> None:
        self._smtputf8 = False
        self._recipients = 0
        self._overshoot = 0
        if self.state in (State.MAIL, State.RCPT, State.DATA):
            self.state = State.READY

    def _process(self) -> list[Event]:
        events: list[Event] = []
        while self.pending is None and self.state not in (State.TLS, State.CLOSED):
            if self.state is State.DATA:
                if not self._data_step(events):
                    break
                continue
            line = self._next_line()
            if line is None:
                break
            try:
                self._line(line, events)
            except CommandError as error:
                self._send(error.reply)
        self._flush_chunk(events)
        return events

    def _next_line(self) -> str | None:
        """The next complete command line, or None when more input is needed.

        Over-long lines are answered 500 5.5.2 and skipped up to the next CRLF (RFC 5321
        section 4.5.3.1.4; MAIL and RCPT may be longer, ``_EXTENDED``); lines with a bare
        CR/LF, NUL or invalid UTF-8 are answered 500 5.5.2 here too.  Each of those replies
        may reach the error limit and close the session: then nothing more is read.
        """
        buf = self._buffer
        while self.state is not State.CLOSED:
            end = buf.find(_CRLF)
            if self._discarding:
                if end < 0:
                    del buf[: len(buf) - 1 if buf.endswith(b"\r") else len(buf)]
                    return None
                del buf[: end + 2]
                self._discarding = False
                continue
            if end < 0:
                if len(buf) >= self.max_command_line and len(buf) >= self._line_limit(buf):
                    # Answered at once, the rest of the line discarded as it comes.
                    self._refuse_line(LINE_TOO_LONG, AUTH_LINE_TOO_LONG)
                    self._discarding = True
                    continue
                return None
            raw = bytes(buf[:end])
            del buf[: end + 2]
            # The plain limit first: the verb is looked at only for a line longer than it.
            if end + 2 > self.max_command_line and end + 2 > self._line_limit(raw):
                self._refuse_line(LINE_TOO_LONG, AUTH_LINE_TOO_LONG)
                continue
            if b"\r" in raw or b"\n" in raw:
                self._refuse_line(BARE_NEWLINE_IN_COMMAND, INVALID_BASE64)
                continue
            if b"\0" in raw:
                self._refuse_line(NUL_IN_COMMAND, INVALID_BASE64)
                continue
            try:
                return raw.decode("utf-8")
            except UnicodeDecodeError:
                self._refuse_line(syntax_error("Invalid UTF-8 in command"), INVALID_BASE64)
        return None

    def _refuse_line(self, reply: Reply, in_auth: Reply) -> None:
        """Answer a line refused before parsing: ``reply``, or ``in_auth`` for a SASL
        response.  RFC 4954 section 4: a response the server cannot take fails the AUTH
        command, so the exchange ends here and the next line is a command again (were it
        read as a response, the client's MAIL would get a 5xx and its mail would bounce)."""
        if self.state is State.AUTH:
            self.state = State.READY
            reply = in_auth
        self._send(reply)

    def _line_limit(self, line: bytes | bytearray) -> int:
        """The longest command line (CRLF included) allowed for ``line``'s verb."""
        if self.state is State.AUTH:
            return max(self.max_command_line, SASL_RESPONSE_LIMIT)  # a SASL response
        verb = bytes(line[:5]).upper()
        limit = self.max_command_line + _EXTENDED.get(verb, 0)
        if (
            verb == b"MAIL "
            and self._auth_parameter_allowed()
            and bytes(line[:limit]).upper().find(_AUTH_PARAMETER) >= 0
        ):
            limit += _AUTH_EXTRA
        return limit

    def _auth_parameter_allowed(self) -> bool:
        """Whether MAIL may carry AUTH= (RFC 4954 section 5): where EHLO advertised AUTH.
        Elsewhere AUTH= is an unknown parameter (555), and its line gets no extra room."""
        return self._esmtp and self.auth_offered and self.tls_active

    def _line(self, line: str, events: list[Event]) -> None:
        if self.state is State.AUTH:
            self._auth_line(line, events)
            return
        verb, arg = split_command(line)
        handler = _HANDLERS.get(verb)
        if handler is None:
            raise CommandError(syntax_error("Syntax error, command unrecognized"))
        handler(self, arg, events)

    # Command handlers: each checks the sequence (RFC 5321 4.1.4) then acts.

    def _hello(self, verb: str, arg: str, events: list[Event]) -> None:
        domain = arg.strip(" ")
        if not domain or " " in domain:
            raise CommandError(bad_arguments(f"Syntax: {verb} hostname"))
        self._reset_transaction()  # RFC 5321 4.1.4: EHLO/HELO imply RSET
        self.state = State.READY
        self._esmtp = verb == "EHLO"
        events.append(Hello(verb, domain))
        if verb == "HELO":
            self._send(Reply(250, (self.hostname,)))
            return
        self._out += _ehlo_reply(
            self.hostname,
            self.max_message_size,
            starttls=self.tls_offered and not self.tls_active,
            auth=self._auth_parameter_allowed(),  # ``_esmtp`` is True here: EHLO
        )

    def _ehlo(self, arg: str, events: list[Event]) -> None:
        self._hello("EHLO", arg, events)

    def _helo(self, arg: str, events: list[Event]) -> None:
        self._hello("HELO", arg, events)

    def _mail(self, arg: str, events: list[Event]) -> None:
        if self.state is State.INITIAL:
            raise CommandError(BAD_SEQUENCE_HELLO)
        if self.state in _IN_TRANSACTION:
            raise CommandError(_NESTED_MAIL)
        # RFC 4954 section 5: AUTH= is a MAIL parameter where EHLO advertised AUTH.
        auth = self._auth_parameter_allowed()
        cmd = parse_mail(arg, esmtp=self._esmtp, max_size=self.max_message_size, auth=auth)
        event = MailFrom(cmd.sender, cmd.size, cmd.body, cmd.smtputf8, cmd.ret, cmd.envid)
        self._decide(event, events)

    def _rcpt(self, arg: str, events: list[Event]) -> None:
        if self.state not in _IN_TRANSACTION:
            raise CommandError(BAD_SEQUENCE_HELLO if self.state is State.INITIAL else _NEED_MAIL)
        cmd = parse_rcpt(arg, esmtp=self._esmtp, smtputf8=self._smtputf8)
        if self._recipients >= self.max_recipients:
            # RFC 5321 4.5.3.1.10: the client sends the rest later.  Not an error up to as
            # many again as the limit (see the module docstring): counting it would cut off
            # a long pipelined list; beyond, it counts, so RCPTs cannot go on for ever.
            self._overshoot += 1
            self._send(TOO_MANY_RECIPIENTS, counted=self._overshoot > self.max_recipients)
            return
        self._decide(RcptTo(cmd.recipient, cmd.notify, cmd.orcpt, cmd.route), events)

    def _data(self, arg: str, events: list[Event]) -> None:
        _no_argument("DATA", arg)
        if self.state is State.INITIAL:
            raise CommandError(BAD_SEQUENCE_HELLO)
        if self.state is State.READY:
            raise CommandError(_NEED_MAIL)
        if self.state is not State.RCPT:
            raise CommandError(_NEED_RCPT)  # RFC 5321 3.3: no valid recipients
        self._decide(DataStart(), events)

    def _rset(self, arg: str, events: list[Event]) -> None:
        _no_argument("RSET", arg)
        self._reset_transaction()  # RFC 5321 4.1.1.5; the greeting state stays
        events.append(Reset())
        self._send(OK)

    def _noop(self, arg: str, events: list[Event]) -> None:
        self._send(OK)  # RFC 5321 4.1.1.9: a parameter is allowed and ignored

    def _quit(self, arg: str, events: list[Event]) -> None:
        _no_argument("QUIT", arg)
        self._send(BYE)
        self.state = State.CLOSED
        self._buffer.clear()
        events.append(Quit())

    def _vrfy(self, arg: str, events: list[Event]) -> None:
        if not arg.strip(" "):
            raise CommandError(bad_arguments("Syntax: VRFY address"))
        # RFC 5321 3.5.3: 252 when the address is not verified but mail will be tried.
        self._send(_r(252, "Cannot VRFY user, but will accept message", 2, 0, 0))

    def _expn(self, arg: str, events: list[Event]) -> None:
        self._send(_r(502, "EXPN not implemented", 5, 5, 1))

    def _help(self, arg: str, events: list[Event]) -> None:
        self._send(_r(214, "See RFC 5321", 2, 0, 0))

    def _starttls(self, arg: str, events: list[Event]) -> None:
        _no_argument("STARTTLS", arg)
        if not self.tls_offered:
            raise CommandError(_r(502, "STARTTLS not available", 5, 5, 1))
        if self.tls_active:
            raise CommandError(_r(503, "TLS already active", 5, 5, 1))
        if self.state is State.INITIAL:
            raise CommandError(BAD_SEQUENCE_HELLO)
        self._send(_r(220, "Ready to start TLS", 2, 0, 0))
        self._reset_transaction()
        self.state = State.TLS
        # RFC 3207 4.2: nothing pipelined in plain text may survive into the TLS session.
        self._buffer.clear()
        events.append(StartTLS())

    def _auth(self, arg: str, events: list[Event]) -> None:
        if not self.auth_offered:
            raise CommandError(_r(502, "AUTH not available", 5, 5, 1))
        if not self.tls_active:
            raise CommandError(_r(538, "Encryption required for AUTH", 5, 7, 11))  # 4954 6
        if self.state is State.INITIAL:
            raise CommandError(BAD_SEQUENCE_HELLO)
        if self.authenticated or self.state is not State.READY:
            # RFC 4954 section 4: not after a successful AUTH, not during a transaction.
            raise CommandError(_r(503, "AUTH not allowed now", 5, 5, 1))
        mechanism, _, initial = arg.strip(" ").partition(" ")
        mechanism = mechanism.upper()
        if not mechanism or " " in initial:
            raise CommandError(bad_arguments("Syntax: AUTH mechanism [initial-response]"))
        if mechanism not in AUTH_MECHANISMS:
            raise CommandError(_r(504, "Unrecognized authentication type", 5, 5, 4))
        data = None
        if initial:
            # RFC 4954 section 4: "=" is an empty initial response.
            data = b"" if initial == "=" else _b64(initial)
        self._decide(AuthRequest(mechanism, data), events)

    def _auth_line(self, line: str, events: list[Event]) -> None:
        self.state = State.READY  # this step of the exchange is over, whatever comes
        if line == "*":
            raise CommandError(_r(501, "Authentication cancelled", 5, 0, 0))  # RFC 4954 4
        self._decide(AuthResponse(_b64(line)), events)

    # DATA

    def _start_data(self) -> None:
        self.state = State.DATA
        self._line_start = True
        self._line_len = 0
        self._data_size = 0
        self._fault = None
        self._careful = 0

    def _data_step(self, events: list[Event]) -> bool:
        """Consume some buffered DATA bytes; False when more input is needed."""
        buf = self._buffer
        if (
            self._line_start
            and self._fault is None
            and self._careful <= 0
            and self._clean_lines(events)
        ):
            return True
        before = len(buf)
        progress = self._careful_step(events)
        self._careful -= before - len(buf)
        return progress

    def _careful_step(self, events: list[Event]) -> bool:
        """The line-by-line path: each fault found at the octet where it is."""
        buf = self._buffer
        if self._line_start:
            return self._data_line_start(events)
        end = buf.find(_CRLF)
        if end >= 0:
            self._content(bytes(buf[:end]))
            self._deliver(_CRLF)
            del buf[: end + 2]
            self._line_start = True
            self._line_len = 0
            return True
        # Part of a line: hand it on, keeping a trailing CR that may start the CRLF.
        take = len(buf) - 1 if buf.endswith(b"\r") else len(buf)
        if take == 0:
            return False
        self._content(bytes(buf[:take]))
        del buf[:take]
        return True

    def _clean_lines(self, events: list[Event]) -> bool:
        """The fast path: every complete line buffered, at once, when nothing in them needs
        the line-by-line path (``_data_line_start`` / ``_content``) to decide a fault.

        Taken only when the lines up to the end marker (or the last CRLF) hold no CR or LF
        outside CRLF pairs and no NUL, no line is longer than the limit even before
        unstuffing, and the size limit is not reached; then unstuffing is one ``replace``,
        made only when a line after the first starts with a dot.  Anything else returns
        False and the same bytes go through the careful path, so faults are found exactly as
        there (the Hypothesis chunking tests and the table of this path's branches compare
        both paths).  After a refusal the careful path takes the whole window
        before this is tried again (``_careful``), so no octet is scanned more than twice.
        """
        buf = self._buffer
        stuffed = False  # a line after the first starts with a dot
        if buf.startswith(_END_MARK):
            stop = 0
        else:
            # The first line after the first to start with a dot: none (the common case)
            # means no end marker here and nothing to unstuff but perhaps the first line.
            dot = buf.find(b"\r\n.", 0, _FAST_WINDOW)
            marker = -1 if dot < 0 else buf.find(b"\r\n.\r\n", dot, _FAST_WINDOW)
            stuffed = 0 <= dot != marker
            stop = marker + 2 if marker >= 0 else buf.rfind(_CRLF, 0, _FAST_WINDOW) + 2
            if stop < 2:
                return False  # no complete line in the window
        region = bytes(buf[:stop])
        lines = region.split(_CRLF)
        # Without its CRLF pairs the text holds a CR or LF only if one was bare.  One split
        # serves the three checks (counting CR, LF and CRLF instead took longer).
        bare = b"".join(lines)
        most = self.max_text_line - 2  # octets of text in a line, its CRLF not counted
        if (
            bare.find(b"\r") >= 0
            or bare.find(b"\n") >= 0
            or bare.find(b"\0") >= 0
            # A line longer than the limit needs a region longer than the limit and a CRLF.
            or (stop > most + 2 and _long_line(region, stop, most))
        ):
            self._careful = stop
            return False
        # RFC 5321 4.5.2, every line but the first (the first is just below).
        text = region.replace(b"\r\n.", _CRLF) if stuffed else region
        if text[:1] == b".":
            text = text[1:]
        if self._data_size + len(text) > self.max_message_size:
            self._careful = stop
            return False
        self._data_size += len(text)
        self._chunk += text
        if buf[stop : stop + 3] == _END_MARK:
            del buf[: stop + 3]
            self._end_data(events)
        else:
            del buf[:stop]
        return True

    def _data_line_start(self, events: list[Event]) -> bool:
        """At the start of a text line: the end marker, a stuffed dot, or plain text."""
        buf = self._buffer
        if buf.startswith(_END_MARK):
            del buf[:3]
            self._end_data(events)
            return True
        if not buf or _END_MARK.startswith(buf):
            return False  # "", "." or ".\r": wait for the next byte
        if buf[0] == ord("."):
            del buf[:1]  # RFC 5321 4.5.2: remove the stuffed dot
        self._line_start = False
        return True

    def _content(self, part: bytes) -> None:
        """Text inside a line (no line end): check for bare CR/LF, NUL and the line limit."""
        if self._fault is not None:
            return
        cut, fault = len(part), None
        bare = [i for i in (part.find(b"\r"), part.find(b"\n")) if i >= 0]
        if bare:
            cut, fault = min(bare), BARE_NEWLINE_IN_DATA
        nul = part.find(b"\0", 0, cut)
        if nul >= 0:
            cut, fault = nul, NUL_IN_DATA
        room = self.max_text_line - 2 - self._line_len
        if room < cut:
            cut, fault = room, TEXT_LINE_TOO_LONG
        self._line_len += cut
        self._deliver(part[:cut])
        if fault is not None and self._fault is None:
            self._fault = fault

    def _deliver(self, data: bytes) -> None:
        if self._fault is not None or not data:
            return
        room = self.max_message_size - self._data_size
        if len(data) > room:
            self._chunk += data[:room]
            self._data_size += room
            self._fault = MESSAGE_TOO_BIG
            return
        self._data_size += len(data)
        self._chunk += data

    def _flush_chunk(self, events: list[Event]) -> None:
        if self._chunk:
            events.append(DataChunk(bytes(self._chunk)))
            self._chunk.clear()

    def _end_data(self, events: list[Event]) -> None:
        self._flush_chunk(events)
        fault = self._fault
        self._fault = None
        self.state = State.READY
        self._reset_transaction()
        if fault is not None:
            events.append(DataEnd(rejected=fault))
            self._send(fault)
        else:
            self._decide(DataEnd(), events)


def _long_line(data: bytes, stop: int, most: int) -> bool:
    """Whether a line of ``data[:stop]`` holds more than ``most`` octets, when every line
    there ends in CRLF and no other CR is there.  From a line's start, the last CR within
    ``most`` octets (``rfind``: memrchr) ends every line that starts before it, all short
    enough; none means the line starting there is too long.  So the walk takes a step per
    ``most`` octets or so, not one per line."""
    start = 0
    while start < stop:
        end = data.rfind(b"\r", start, min(start + most + 1, stop))
        if end < 0:
            return True
        start = end + 2  # past its CRLF: the next line's start
    return False


@functools.lru_cache(maxsize=64)
def _ehlo_reply(hostname: str, max_size: int, *, starttls: bool, auth: bool) -> bytes:
    """The EHLO reply on the wire: the same few for every session, so built once each."""
    lines = [
        hostname,
        "PIPELINING",  # RFC 2920
        f"SIZE {max_size}",  # RFC 1870
        "8BITMIME",  # RFC 6152
        "ENHANCEDSTATUSCODES",  # RFC 2034
        "SMTPUTF8",  # RFC 6531
        "DSN",  # RFC 3461
    ]
    if starttls:
        lines.append("STARTTLS")  # RFC 3207
    if auth:
        lines.append("AUTH " + " ".join(AUTH_MECHANISMS))  # RFC 4954
    return Reply(250, tuple(lines)).to_wire()


def _wire(reply: Reply) -> bytes:
    """``reply.to_wire()``, remembered: the machine sends the same few replies in every
    session, and rendering one (a Reply's lines joined, its status code formatted) cost
    about 1 us against 0.2 us for the lookup.  A reply that cannot be a key (lines in a
    list, from a careless plugin) is rendered each time."""
    try:
        return _rendered(reply)
    except TypeError:
        return reply.to_wire()


_rendered: Final = functools.lru_cache(maxsize=256)(Reply.to_wire)


@functools.lru_cache(maxsize=64)
def _greeting(hostname: str) -> bytes:
    return Reply(220, (f"{hostname} ESMTP",)).to_wire()


def _no_argument(verb: str, arg: str) -> None:
    if arg.strip(" "):
        raise CommandError(bad_arguments(f"{verb} takes no argument"))


def _b64(text: str) -> bytes:
    try:
        return base64.b64decode(text.encode("ascii"), validate=True)
    except (binascii.Error, UnicodeEncodeError):
        # RFC 4954 section 4: a response that is not base64 is answered 501.
        raise CommandError(INVALID_BASE64) from None


_DEFAULT_ACCEPT: Final[dict[type[Event], Reply]] = {
    MailFrom: SENDER_OK,
    RcptTo: RECIPIENT_OK,
    DataStart: START_INPUT,
    DataEnd: QUEUED,
    AuthRequest: AUTH_OK,
    AuthResponse: AUTH_OK,
}

_HANDLERS: Final = {
    "EHLO": ServerConnection._ehlo,
    "HELO": ServerConnection._helo,
    "MAIL": ServerConnection._mail,
    "RCPT": ServerConnection._rcpt,
    "DATA": ServerConnection._data,
    "RSET": ServerConnection._rset,
    "NOOP": ServerConnection._noop,
    "QUIT": ServerConnection._quit,
    "VRFY": ServerConnection._vrfy,
    "EXPN": ServerConnection._expn,
    "HELP": ServerConnection._help,
    "STARTTLS": ServerConnection._starttls,
    "AUTH": ServerConnection._auth,
}
