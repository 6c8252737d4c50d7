"""How long a client may take over one request: an idle limit that a trickle cannot dodge.

A time limit per read (RFC 5321 section 4.5.3.2's timeouts, read literally) is met by a
client that sends one byte every few seconds, which can then hold a session, and the
message being received, for ever.  So the limit is per *request*, as Postfix's
``smtpd_per_request_deadline`` has it: from the moment we wait for a command (or for
message text after 354) the client has ``timeout_s`` in all to complete it, however its
bytes are spread.  Message text earns more time as it arrives, ``octets / min_rate``
seconds (Postfix's ``smtpd_min_data_rate``), but never more than ``timeout_s`` ahead: a
large message sent at a reasonable pace always finishes, a trickle does not.

Pure: the caller measures the time and passes it in.
"""

from __future__ import annotations

__all__ = ["RequestDeadline"]


class RequestDeadline:
    """Seconds left for the request in progress (``left``)."""

    def __init__(self, timeout_s: float, min_rate: int) -> None:
        if timeout_s <= 0 or min_rate < 0:
            raise ValueError("timeout must be positive and min_rate not negative")
        self.timeout_s = timeout_s
        self.min_rate = min_rate
        self.left = timeout_s

    def restart(self) -> None:
        """A request was answered: the next one gets the whole timeout."""
        self.left = self.timeout_s

    def spend(self, elapsed_s: float, data_octets: int = 0) -> None:
        """``elapsed_s`` went by waiting for input, which brought ``data_octets`` octets of
        message text (0 for command lines: they earn nothing)."""
        self.left -= elapsed_s
        if data_octets and self.min_rate:
            self.left = min(self.timeout_s, self.left + data_octets / self.min_rate)

    @property
    def expired(self) -> bool:
        return self.left <= 0
