"""What one SMTP delivery attempt came to: a value per recipient, plus facts about the connection.

The transport (``zoneq.delivery.transport``) never raises for what a remote server does or
fails to do; it returns a ``TransactionResult``.  The zone worker turns each
``RecipientResult`` into a queue update (done, retry, bounce, or try the next MX host).
"""

from __future__ import annotations

from dataclasses import dataclass

from zoneq.protocol.replies import EnhancedStatus, Reply, Stage, Verdict

__all__ = ["RecipientResult", "TransactionResult"]


@dataclass(frozen=True, slots=True)
class RecipientResult:
    """The outcome for one recipient.

    ``reply`` is what the server said about this recipient (its RCPT reply when refused there,
    otherwise the reply that settled the transaction: MAIL, DATA or end of data), or None when
    there was no usable reply (connection refused, lost, timed out, garbled) or when zoneq
    decided on its own (TLS required but unavailable, SMTPUTF8 or SIZE not accommodated).

    ``status`` is the RFC 3463 enhanced status code for a DSN: the reply's own when it has one,
    otherwise the one zoneq chose for its own decision (4.4.x for connection trouble, 4.7.x for
    TLS, ...); None when the reply had none and zoneq had nothing to add.

    ``possible_duplicate``: the whole message was sent (final dot included) but no final reply
    arrived, or the reply was 421.  The server may have taken the message anyway (RFC 1047), so
    a retry may deliver a second copy.  Such recipients are always DEFER, never NEXT_HOST: a
    retry after the normal back-off, not an immediate resend to another MX host.

    ``transaction`` counts MAIL transactions on the connection from 0; it is above 0 for
    recipients sent again after a 452 "too many recipients" (RFC 5321 section 4.5.3.1.10).
    """

    address: str
    verdict: Verdict
    stage: Stage
    reply: Reply | None = None
    status: EnhancedStatus | None = None
    detail: str = ""
    possible_duplicate: bool = False
    transaction: int = 0

    def __str__(self) -> str:
        """One line for logs: address, verdict, stage and the reply or the detail."""
        why = str(self.reply) if self.reply is not None else self.detail
        if self.reply is None and self.status is not None:
            why = f"{self.status} {why}"
        flag = " (possible duplicate)" if self.possible_duplicate else ""
        return f"<{self.address}> {self.verdict} at {self.stage}: {why}{flag}"


@dataclass(frozen=True, slots=True)
class TransactionResult:
    """The outcome of one connection to one host: a ``RecipientResult`` per recipient.

    ``recipients`` is in the order the recipients were given, one entry each.
    ``peer`` and ``local`` are the IP addresses of the two ends of the connection (None if it
    was never made).  ``tls`` is True if the message went over TLS.  ``tls_fallback`` says why
    an opportunistic STARTTLS failed and the session was redone in plaintext (None otherwise).
    ``extensions`` holds the EHLO keywords of the session that carried the mail, upper case
    (e.g. the caller sends a "relayed" DSN itself when DSN was not offered, RFC 3461
    section 4).  ``transactions`` is how many MAIL transactions were started.
    """

    host: str
    port: int
    recipients: tuple[RecipientResult, ...]
    peer: str | None = None
    local: str | None = None
    tls: bool = False
    tls_fallback: str | None = None
    extensions: frozenset[str] = frozenset()
    transactions: int = 0

    @property
    def possible_duplicate(self) -> bool:
        """True if any recipient may have received the message although no 250 came back."""
        return any(result.possible_duplicate for result in self.recipients)

    def by_address(self) -> dict[str, RecipientResult]:
        """The results keyed by address (for a recipient given twice, the last one wins)."""
        return {result.address: result for result in self.recipients}
