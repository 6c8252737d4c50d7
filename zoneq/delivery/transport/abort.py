"""Why a session cannot go on: ``Abort``, and the RFC 3463 codes for zoneq's own decisions.

An ``Abort`` unwinds the session (dialogue, transaction or body) when it cannot go on; it never
leaves the transport package: every recipient not settled by then gets the verdict it carries
(usually NEXT_HOST: the caller tries the next MX host, then defers).
"""

from __future__ import annotations

from typing import Final

from zoneq.protocol.replies import EnhancedStatus, Reply, Stage, Verdict

# Status codes for zoneq's own decisions (RFC 3463).
NO_ANSWER: Final = EnhancedStatus(4, 4, 1)  # X.4.1 no answer from host
OUT_OF_STEP: Final = EnhancedStatus(4, 5, 0)  # X.5.0 other protocol status (a stray reply)
BAD_CONNECTION: Final = EnhancedStatus(4, 4, 2)  # X.4.2 bad connection
LOCAL_ERROR: Final = EnhancedStatus(4, 3, 0)  # X.3.0 other mail system status
NO_TLS: Final = EnhancedStatus(4, 7, 4)  # X.7.4 security features not supported
TLS_FAILED: Final = EnhancedStatus(4, 7, 5)  # X.7.5 cryptographic failure
NO_AUTH: Final = EnhancedStatus(4, 7, 0)  # X.7.0 other security status (AUTH not possible)
TOO_BIG: Final = EnhancedStatus(5, 3, 4)  # X.3.4 message too big for system
NO_UTF8: Final = EnhancedStatus(5, 6, 7)  # X.6.7 non-ASCII addresses not permitted (RFC 6531)
BAD_RCPT_SYNTAX: Final = EnhancedStatus(5, 1, 3)  # X.1.3 bad destination mailbox syntax
BAD_SENDER_SYNTAX: Final = EnhancedStatus(5, 1, 7)  # X.1.7 bad sender's mailbox syntax


class Abort(Exception):
    """The session cannot go on; every recipient not yet settled gets this outcome (never
    DONE: see below)."""

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
        if verdict is Verdict.DONE:
            # An Abort ends the session before a 2yz to the final dot, and only that reply
            # delivers (RFC 5321 section 4.1.1.4): whatever reply led here, nothing this
            # Abort settles was delivered.  Trouble with this host, then, never "done".
            verdict = Verdict.NEXT_HOST
        if status is None and reply is not None and reply.is_positive:
            # The reply's own 2.x.x would read as success in a delay notice (RFC 3463).
            status = OUT_OF_STEP
        self.stage = stage
        self.verdict = verdict
        self.reply = reply
        self.status = status
        self.detail = detail


def lost(stage: Stage, exc: BaseException | str) -> Abort:
    """No usable reply at ``stage``: trouble with this host (RFC 5321 section 5.1)."""
    detail = exc if isinstance(exc, str) else f"{type(exc).__name__}: {exc}"
    return Abort(stage, Verdict.NEXT_HOST, status=BAD_CONNECTION, detail=detail)
