"""SMTP replies: parsing, rendering, and what a reply means for a recipient.

Pure: no I/O, no clock.  The transport reads reply lines off the wire and hands them here;
what comes back is a value (``Reply``) and, for a given stage of the dialogue, a decision
(``Verdict``) the delivery code acts on.

References: RFC 5321 section 4.2 (reply syntax and codes), RFC 2034 (enhanced status codes in
SMTP replies), RFC 3463 (enhanced status code structure and meaning).
"""

from __future__ import annotations

import enum
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Final

from zoneq.errors import ProtocolError

__all__ = [
    "DAMAGED_BODY",
    "INSUFFICIENT_STORAGE",
    "LOCAL_ERROR",
    "Category",
    "EnhancedStatus",
    "Reply",
    "Stage",
    "Verdict",
    "categorize",
    "classify",
    "classify_connection_failure",
    "parse_reply",
    "reply_from_text",
]

# RFC 3463 section 2: status-code = class "." subject "." detail, class is 2, 4 or 5, subject
# and detail are 1*3digit, "Each numeric sub-code ... MUST be expressed without leading zero
# digits" (so "0" is allowed, "00" and "01" are not).  [0-9] rather than \d: \d would also
# match non-ASCII digits.
_SUBCODE: Final = r"(0|[1-9][0-9]{0,2})"
_ENHANCED: Final = re.compile(rf"([245])\.{_SUBCODE}\.{_SUBCODE}")


@dataclass(frozen=True, slots=True)
class EnhancedStatus:
    """An RFC 3463 enhanced status code such as 5.1.1 (class.subject.detail)."""

    klass: int
    subject: int
    detail: int

    def __post_init__(self) -> None:
        if self.klass not in (2, 4, 5):
            raise ValueError(f"enhanced status class must be 2, 4 or 5, not {self.klass}")
        if not 0 <= self.subject <= 999 or not 0 <= self.detail <= 999:
            raise ValueError(
                f"enhanced status sub-codes must be 0-999, not {self.subject}.{self.detail}"
            )

    @classmethod
    def parse(cls, text: str) -> EnhancedStatus | None:
        """Parse exactly one status code (``"5.1.1"``); None if ``text`` is anything else.

        No surrounding whitespace is accepted: RFC 3463 section 2 allows none within the
        code, and callers split the code off the reply text themselves.
        """
        match = _ENHANCED.fullmatch(text)
        if match is None:
            return None
        klass, subject, detail = (int(group) for group in match.groups())
        return cls(klass, subject, detail)

    def __str__(self) -> str:
        return f"{self.klass}.{self.subject}.{self.detail}"


@dataclass(frozen=True, slots=True)
class Reply:
    """One complete SMTP reply.

    ``lines`` holds the text of each line without the reply code, without the separator
    after it, and without the enhanced status code (kept separately in ``enhanced``), so
    ``Reply(550, ("User unknown",), EnhancedStatus(5, 1, 1))`` is ``550 5.1.1 User unknown``.
    A reply with no text has ``lines == ("",)``.

    The constructor checks the invariants, raising ``ValueError``: the code is 100-599,
    there is at least one line, no line contains CR or LF (they would let text inject a
    line into ``to_wire`` output), and the enhanced code's class equals the reply code's
    first digit (RFC 3463 section 2).
    """

    code: int
    lines: tuple[str, ...]
    enhanced: EnhancedStatus | None = None

    def __post_init__(self) -> None:
        if not 100 <= self.code <= 599:
            raise ValueError(f"reply code must be 100-599, not {self.code}")
        if not self.lines:
            raise ValueError('a reply has at least one line (use ("",) for no text)')
        for line in self.lines:
            if "\r" in line or "\n" in line:
                raise ValueError(f"reply line contains CR or LF: {line!r}")
        if self.enhanced is not None and self.enhanced.klass != self.code // 100:
            raise ValueError(
                f"enhanced status {self.enhanced} does not match the class of reply {self.code}"
            )

    @property
    def text(self) -> str:
        """The text of all lines joined with newlines (codes not included)."""
        return "\n".join(self.lines)

    @property
    def is_positive(self) -> bool:
        """2yz, "positive completion" (RFC 5321 section 4.2.1).

        3yz (positive intermediate, e.g. 354) is deliberately not included: it means "go on",
        not "done", and whether it is expected depends on the stage (see ``classify``).
        """
        return self.code // 100 == 2

    @property
    def is_transient(self) -> bool:
        """4yz, "transient negative completion" (RFC 5321 section 4.2.1)."""
        return self.code // 100 == 4

    @property
    def is_permanent(self) -> bool:
        """5yz, "permanent negative completion" (RFC 5321 section 4.2.1)."""
        return self.code // 100 == 5

    def __str__(self) -> str:
        """One line, ``550 5.1.1 User unknown``, for logs and DSN Diagnostic-Code fields.

        Lines are joined with single spaces, and empty lines are dropped so that the form
        never has doubled or trailing blanks.
        """
        parts = [str(self.code)]
        if self.enhanced is not None:
            parts.append(str(self.enhanced))
        parts.extend(line.strip() for line in self.lines if line.strip())
        return " ".join(parts)

    def to_wire(self) -> bytes:
        """Render as sent by a server: ``CODE-`` on every line but the last, ``CODE `` on it.

        The enhanced code is repeated at the start of every line's text, as RFC 2034
        section 4 requires for multi-line replies.  UTF-8 is used for the text; zoneq's own
        replies are ASCII (RFC 5321 section 4.2), other text is only ever echoed.

        ``parse_reply`` on the resulting lines gives back an equal ``Reply`` for every reply
        that ``parse_reply`` itself could produce.  The only replies that do not round-trip
        are hand-built ones with ``enhanced=None`` whose first line starts with a
        class-matching status code and a space: on the wire the two are indistinguishable.
        """
        out: list[str] = []
        last = len(self.lines) - 1
        for index, line in enumerate(self.lines):
            separator = " " if index == last else "-"
            if self.enhanced is None:
                body = line
            else:
                # "250 2.0.0" rather than "250 2.0.0 " when there is no text.
                body = f"{self.enhanced} {line}" if line else str(self.enhanced)
            if index == last and not body:
                # RFC 5321 section 4.2: Reply-code [ SP textstring ] CRLF -- no text, no SP.
                out.append(f"{self.code}\r\n")
            else:
                out.append(f"{self.code}{separator}{body}\r\n")
        return "".join(out).encode("utf-8")


def _split_enhanced(text: str, code: int) -> tuple[EnhancedStatus | None, str]:
    """Split a leading enhanced status code off one line of reply text.

    RFC 2034 section 4: the status code comes first in the text, followed by a space (or
    nothing, when the text is only the code).  Exactly one space is removed so that the
    rest of the text is kept byte for byte.  A code whose class differs from the reply
    code's first digit is not split off: RFC 3463 section 2 gives the class the same
    meaning as the reply's first digit (2 success, 4 transient, 5 permanent), so a
    mismatch is a confused server and the basic code, which decides what happens, wins.
    The ignored code stays in the text so logs still show it.
    """
    token, space, rest = text.partition(" ")
    status = EnhancedStatus.parse(token)
    if status is None or status.klass != code // 100:
        return None, text
    return status, rest if space else ""


def _build(code: int, texts: Sequence[str]) -> Reply:
    """Make a ``Reply`` from the reply code and per-line texts, extracting the enhanced code.

    The enhanced code is taken from the first line only (RFC 2034 section 4 puts the same
    code on every line).  On later lines, a leading copy of that same code is removed; a
    different code there is left in the text rather than guessed about.
    """
    enhanced, first = _split_enhanced(texts[0], code)
    lines = [first]
    for text in texts[1:]:
        again, rest = _split_enhanced(text, code)
        lines.append(rest if enhanced is not None and again == enhanced else text)
    return Reply(code, tuple(lines), enhanced)


def _check_code(code: int) -> None:
    # RFC 5321 section 4.2 allows first digits 2-5 only; 1yz is accepted here too so that
    # ``classify`` can treat it as the protocol error it is (RFC 5321 section 4.2.1:
    # out-of-range codes are fatal to the transaction) instead of failing the parse.
    # The second digit is not checked: the first digit decides what the client does.
    if not 100 <= code <= 599:
        raise ProtocolError(f"reply code {code} is out of range (100-599)")


def parse_reply(lines: Sequence[bytes]) -> Reply:
    """Parse one complete reply from its lines as read off the wire.

    Each element is one line, with or without its trailing CRLF (a bare LF is tolerated
    too, being the transport's business).  RFC 5321 section 4.2.1: every line but the
    last is ``CODE-text``, the last is ``CODE text`` or just ``CODE``, and all lines carry
    the same code.  The enhanced status code is taken from the first line (RFC 2034).

    Text is decoded as UTF-8 with undecodable bytes replaced: odd bytes in the human
    readable text must not turn a server's 250 into a failure (RFC 5321 section 4.2:
    the client acts on the code, not the text).

    Raises ``ProtocolError`` for: no lines, a line shorter than three characters, a code
    that is not three ASCII digits or is out of range, a fourth character other than ``-``
    or space, codes differing between lines, a final line that is not last, a last line
    that is a continuation (the reply is incomplete), or a CR or LF inside a line.
    """
    if not lines:
        raise ProtocolError("empty reply: no lines")
    codes: list[int] = []
    texts: list[str] = []
    last = len(lines) - 1
    for index, raw in enumerate(lines):
        line = raw.removesuffix(b"\n").removesuffix(b"\r")
        if b"\r" in line or b"\n" in line:
            raise ProtocolError(f"reply line {index + 1} contains a bare CR or LF: {raw!r}")
        head = line[:3]
        # bytes.isdigit() is ASCII-only, unlike str.isdigit().
        if len(head) < 3 or not head.isdigit():
            raise ProtocolError(f"reply line {index + 1} does not start with a code: {raw!r}")
        code = int(head)
        _check_code(code)
        if codes and code != codes[0]:
            raise ProtocolError(f"reply mixes codes {codes[0]} and {code} (line {index + 1})")
        separator = line[3:4]
        if separator == b"-":
            if index == last:
                raise ProtocolError(f"reply is incomplete: line {index + 1} says more follows")
        elif separator in (b" ", b""):
            if index != last:
                raise ProtocolError(f"reply has lines after its final line {index + 1}")
        else:
            raise ProtocolError(
                f"reply line {index + 1}: expected '-' or space after the code: {raw!r}"
            )
        codes.append(code)
        texts.append(line[4:].decode("utf-8", errors="replace"))
    return _build(codes[0], texts)


def reply_from_text(code: int, text: str) -> Reply:
    """Build a ``Reply`` from a code and newline-joined text, as SMTP client libraries give.

    The enhanced code is extracted the same way as in ``parse_reply``.  Raises
    ``ProtocolError`` for an out-of-range code.  The text is a remote server's: a CR in it
    (trailing, or inside as in "554 5.7.1 blocked<CR>using ...") is dropped or made a space,
    as the delivery reader does for the replies after the greeting: the client acts on the
    code (RFC 5321 section 4.2), and refusing the reply would lose it (no HELO after a
    refused EHLO, no block-list rule for a refused greeting).
    """
    _check_code(code)
    texts = [line.rstrip("\r").replace("\r", " ") for line in text.split("\n")]
    return _build(code, texts)


# RFC 5321 section 4.2.2 texts with RFC 3463 section 3.4 (mail system status) codes: what
# zoneq answers when the fault is its own and may clear (4yz, so the client retries).
LOCAL_ERROR: Final = Reply(
    451, ("Requested action aborted: local error in processing",), EnhancedStatus(4, 3, 0)
)
"""451 4.3.0: a local fault (e.g. the queue refused a write)."""

INSUFFICIENT_STORAGE: Final = Reply(
    452, ("Requested action not taken: insufficient system storage",), EnhancedStatus(4, 3, 1)
)
"""452 4.3.1: out of disk or queue space ("mail system full")."""

DAMAGED_BODY: Final = EnhancedStatus(4, 6, 0)
"""X.6.0 other media error, with no remote reply: a worker found the stored message itself
damaged (a chunk missing or short).  The worker reports it and the core, seeing it, checks
and quarantines the message (distinct from 4.3.0 so no other local fault makes it look)."""


class Stage(enum.StrEnum):
    """Where in the SMTP dialogue a reply was received (or the connection failed)."""

    CONNECT = "connect"
    GREETING = "greeting"
    EHLO = "ehlo"
    STARTTLS = "starttls"
    AUTH = "auth"
    MAIL = "mail"
    RCPT = "rcpt"
    DATA = "data"
    END_OF_DATA = "end_of_data"
    RSET = "rset"
    QUIT = "quit"


class Verdict(enum.StrEnum):
    """What the delivery code should do next."""

    DONE = "done"
    """Success for this step: go on with the dialogue, or the recipient is delivered."""
    DEFER = "defer"
    """Temporary failure: retry later according to the retry schedule."""
    BOUNCE = "bounce"
    """Permanent failure: give up and send a DSN."""
    NEXT_HOST = "next_host"
    """Trouble with this host (or connection) as a whole: try the next MX host, then defer."""


# Stages that set up or reset the session rather than move a message.  A failure here says
# something about the host, not about any recipient (RFC 5321 section 5.1: try the next
# address).  AUTH and RSET are included although the rule for them is ours: a rejected
# login is a fault of our credentials or their server, and bouncing all mail for it would
# destroy mail over a configuration error; a refused RSET leaves the session in an unknown
# state, so the connection must not be reused.
_SESSION_STAGES: Final = frozenset(
    {Stage.CONNECT, Stage.GREETING, Stage.EHLO, Stage.STARTTLS, Stage.AUTH, Stage.RSET}
)

# Non-2yz codes that are the normal next step at a stage (RFC 5321 section 4.3.2, RFC 4954
# section 4 for 334).  220 at GREETING and STARTTLS is already a 2yz.
_EXPECTED_INTERMEDIATE: Final[dict[Stage, int]] = {Stage.DATA: 354, Stage.AUTH: 334}

# Session stages whose one success is a single code: RFC 5321 sections 3.1 and 4.3.2 (220
# greeting, 250 to EHLO or HELO) and RFC 3207 section 4 (220 to STARTTLS).  Any other 2yz
# there is no success: a second banner read as the EHLO reply, a 250 greeting, a 252 to
# EHLO.  Mail is delivered only by a 2yz to the final dot (RFC 5321 section 4.1.1.4), so
# such a reply is trouble with this host, like any other refusal of the session.
_ONLY_SUCCESS: Final[dict[Stage, int]] = {
    Stage.GREETING: 220,
    Stage.EHLO: 250,
    Stage.STARTTLS: 220,
}

# Stages whose only success is their intermediate reply.  RFC 5321 sections 4.1.1.4 and
# 4.3.2: DATA's one success is 354; a 2yz there means the server took DATA for something
# else (or a pipelined reply went astray), and no message went with it.
_ONLY_INTERMEDIATE: Final = frozenset({Stage.DATA})

# Codes a stage treats as another one.  RFC 5321 section 4.5.3.1.10: a 552 to RCPT ("too
# many recipients", from servers older than that section) SHOULD be treated as the
# temporary 452.
_AS_IF: Final[dict[tuple[Stage, int], int]] = {(Stage.RCPT, 552): 452}


def classify(reply: Reply, stage: Stage) -> Verdict:
    """Decide what a reply at ``stage`` means for the recipient(s) concerned.

    In order:

    * QUIT: always DONE.  The recipients' fate was settled by the reply to the end of
      data (RFC 5321 section 4.1.1.4: a 250 there means the server has taken
      responsibility); how the server answers QUIT changes nothing.
    * 2yz (except at DATA), and 354 at DATA, 334 at AUTH: DONE.  A 2yz to DATA is DEFER:
      the only success there is 354 (RFC 5321 sections 4.1.1.4 and 4.3.2), so the body was
      never sent and the dialogue is out of step.  At GREETING, EHLO and STARTTLS only 220,
      250 and 220 are DONE; another 2yz there is NEXT_HOST (RFC 5321 section 3.1): the
      session was never set up, so nothing was delivered.
    * 552 at RCPT is judged as 452 (RFC 5321 section 4.5.3.1.10): DEFER.
    * 421 at any stage: NEXT_HOST.  RFC 5321 section 3.8: the server is closing the
      channel; this is about the server, not the recipient.
    * Session stages (CONNECT, GREETING, EHLO, STARTTLS, AUTH, RSET): any other code is
      NEXT_HOST.  RFC 5321 sections 3.1 and 5.1: a host that refuses the session
      (including a 554 greeting) has not judged any recipient.
    * 1yz, or a 3yz not expected at the stage: DEFER.  The server and we disagree about
      where the dialogue is (RFC 5321 section 4.2.1 treats such codes as fatal to the
      transaction); nothing was accepted, so not DONE, and nothing permanent was said
      about the recipient, so not BOUNCE.
    * 4yz: DEFER.  5yz: BOUNCE.
    """
    code = _AS_IF.get((stage, reply.code), reply.code)
    klass = code // 100
    if stage is Stage.QUIT or _EXPECTED_INTERMEDIATE.get(stage) == code:
        return Verdict.DONE
    if klass == 2:
        return _positive(code, stage)
    if code == 421 or stage in _SESSION_STAGES:
        return Verdict.NEXT_HOST
    if klass == 4:
        return Verdict.DEFER
    if klass == 5:
        return Verdict.BOUNCE
    return Verdict.DEFER  # 1yz, unexpected 3yz


def _positive(code: int, stage: Stage) -> Verdict:
    """A 2yz at ``stage``: DONE, unless the stage's one success is another code
    (``_ONLY_SUCCESS``: NEXT_HOST) or its intermediate reply (DATA: DEFER)."""
    if _ONLY_SUCCESS.get(stage, code) != code:
        return Verdict.NEXT_HOST
    return Verdict.DEFER if stage in _ONLY_INTERMEDIATE else Verdict.DONE


def classify_connection_failure(stage: Stage) -> Verdict:
    """Verdict when there is no usable reply at ``stage``.

    Covers connection refused, timeouts, TLS handshake failures, the peer closing the
    connection, and replies ``parse_reply`` rejected: all are trouble with this host, so
    NEXT_HOST (RFC 5321 section 5.1).  Also at END_OF_DATA, where the message may in fact
    have been delivered (RFC 1047): a possible duplicate is preferred to a lost message.

    The exception is QUIT: many servers close the connection as soon as (or before) they
    answer QUIT, and the recipients' fate was already settled, so DONE.
    """
    if stage is Stage.QUIT:
        return Verdict.DONE
    return Verdict.NEXT_HOST


class Category(enum.StrEnum):
    """Coarse reason for a reply, for analytics: RFC 3463 section 3's subject classes."""

    OTHER = "other"
    """X.0, section 3.1: other or undefined; also anything not recognised."""
    ADDRESSING = "addressing"
    """X.1, section 3.2: address status (no such user, bad syntax, ...)."""
    MAILBOX = "mailbox"
    """X.2, section 3.3: mailbox status (full, disabled, ...)."""
    MAIL_SYSTEM = "mail_system"
    """X.3, section 3.4: the receiving mail system (full, not accepting mail, ...)."""
    NETWORK = "network"
    """X.4, section 3.5: network and routing (no answer, loop, ...)."""
    PROTOCOL = "protocol"
    """X.5, section 3.6: the mail delivery protocol (syntax, bad sequence, ...)."""
    CONTENT = "content"
    """X.6, section 3.7: message content or media."""
    POLICY = "policy"
    """X.7, section 3.8: security or policy (refused, spam, authentication, ...)."""


_BY_SUBJECT: Final[dict[int, Category]] = {
    0: Category.OTHER,
    1: Category.ADDRESSING,
    2: Category.MAILBOX,
    3: Category.MAIL_SYSTEM,
    4: Category.NETWORK,
    5: Category.PROTOCOL,
    6: Category.CONTENT,
    7: Category.POLICY,
}

# Without an enhanced code, a best guess from the basic code's RFC 5321 section 4.2.2
# meaning.  550 covers "not found, no access, or ... policy" and is filed under addressing
# because "no such user" is by far its most common use.
_BY_CODE: Final[dict[int, Category]] = {
    421: Category.MAIL_SYSTEM,  # service not available, closing channel
    450: Category.MAILBOX,  # mailbox unavailable (busy)
    451: Category.MAIL_SYSTEM,  # local error in processing
    452: Category.MAIL_SYSTEM,  # insufficient system storage
    454: Category.POLICY,  # RFC 4954/3207: temporary authentication or TLS failure
    455: Category.PROTOCOL,  # unable to accommodate parameters
    500: Category.PROTOCOL,  # syntax error, command unrecognised
    501: Category.PROTOCOL,  # syntax error in parameters
    502: Category.PROTOCOL,  # command not implemented
    503: Category.PROTOCOL,  # bad sequence of commands
    504: Category.PROTOCOL,  # parameter not implemented
    530: Category.POLICY,  # RFC 4954: authentication required
    534: Category.POLICY,  # RFC 4954: mechanism too weak
    535: Category.POLICY,  # RFC 4954: credentials invalid
    538: Category.POLICY,  # RFC 4954: encryption required
    550: Category.ADDRESSING,  # mailbox unavailable (not found, no access, policy)
    551: Category.ADDRESSING,  # user not local
    552: Category.MAILBOX,  # exceeded storage allocation
    553: Category.ADDRESSING,  # mailbox name not allowed
    554: Category.POLICY,  # transaction failed / no SMTP service here
    555: Category.PROTOCOL,  # MAIL/RCPT parameters not recognised
}


def categorize(reply: Reply) -> Category:
    """The coarse category of ``reply``: from its enhanced code's subject when it has one
    (subjects above 7 are OTHER), else from the basic code (unlisted codes are OTHER)."""
    if reply.enhanced is not None:
        return _BY_SUBJECT.get(reply.enhanced.subject, Category.OTHER)
    return _BY_CODE.get(reply.code, Category.OTHER)
