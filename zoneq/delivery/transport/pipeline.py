"""A group of commands and their replies, matched in order: pipelined or one by one.

RFC 2920 section 3.1: with PIPELINING the client may send a group of commands without waiting
for each reply; the server answers each, in order.  RSET, MAIL and RCPT may be anywhere in a
group, DATA only last.  So a mail transaction is one group, ``[RSET] MAIL RCPT... DATA``,
written with one write, and its replies are read one at a time, each with its own command's
timeout (RFC 5321 section 4.5.3.2), as if the commands had been sent one by one.  Without
PIPELINING at the server, each command is written only when its reply is asked for, so the
same code runs a command-by-command dialogue.

Since the replies come in the order of the commands, the n-th reply read belongs to the n-th
command, which is how replies are matched to recipients.  When the caller has seen enough (say,
MAIL was refused), :meth:`CommandGroup.drain` reads the replies still owed for commands already
sent, so the next command's reply is not mistaken for one of them; commands not yet sent (one
by one) are simply never sent.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from zoneq.delivery.transport.abort import lost
from zoneq.delivery.transport.channel import Channel, ChannelClosed, ChannelTimeout
from zoneq.protocol.replies import Reply, Stage


@dataclass(frozen=True, slots=True)
class Command:
    stage: Stage
    line: bytes  # CRLF included
    timeout: float  # for its reply


class CommandGroup:
    """Commands to send on ``channel``, all at once (``pipelined``) or one at a time."""

    def __init__(self, channel: Channel, commands: Sequence[Command], *, pipelined: bool) -> None:
        self._channel = channel
        self._commands = commands
        self.pipelined = pipelined
        self._sent = 0
        self._answered = 0

    def send(self) -> None:
        """Write the whole group, if pipelining; one write, so one packet where it fits."""
        if self.pipelined and self._commands:
            self._write(b"".join(command.line for command in self._commands))
            self._sent = len(self._commands)

    async def reply(self) -> Reply:
        """The reply to the next command (sent now, if one by one)."""
        command = self._commands[self._answered]
        if self._sent == self._answered:
            self._write(command.line)
            self._sent += 1
        self._answered += 1
        try:
            return await self._channel.read(command.timeout)
        except (ChannelClosed, ChannelTimeout) as exc:
            raise lost(command.stage, str(exc)) from None

    def skip(self) -> None:
        """Leave the next command unsent (one by one only: pipelined, it has gone)."""
        if self._sent > self._answered:
            raise RuntimeError("skip(): the command was already sent")
        self._sent += 1
        self._answered += 1

    @property
    def owed(self) -> int:
        """Replies still to come for commands already sent."""
        return self._sent - self._answered

    async def drain(self) -> list[Reply]:
        """Read the replies still owed, so that the next command's reply is its own."""
        return [await self.reply() for _ in range(self.owed)]

    def _write(self, data: bytes) -> None:
        try:
            self._channel.write(data)
        except ChannelClosed as exc:
            raise lost(self._commands[self._answered].stage, str(exc)) from None
