"""One mail transaction: MAIL, RCPT..., DATA as one pipelined group, then the body.

Theory of operation
-------------------
With PIPELINING at the server (RFC 2920), ``[RSET] MAIL RCPT... DATA`` goes out in one write
and the replies are read in order, each matched to its command (``pipeline.py``); without it,
the same commands go one at a time.  Either way each reply settles what it answers:

* RSET (sent first when the previous transaction is still open): anything but 2yz ends the
  session.
* MAIL refused: every recipient is settled by that reply.  Pipelined, the RCPT and DATA
  replies still owed are read and ignored (they are 503s from a sound server).
* Each RCPT: 2yz accepts the recipient into this transaction; 452 after one was accepted is
  the server's recipient limit (RFC 5321 section 4.5.3.1.10), and so is 552 (the same
  section: a client SHOULD treat it as 452): that recipient goes into a new transaction at
  once; anything else settles the recipient by its reply (452 or 552 with none accepted:
  DEFER).  Pipelined, a 250 after a 452 still counts: the server took that recipient, and
  sending it again would be a duplicate.  One by one, after the first such 452 the rest are
  not sent but go to the next transaction straight away, as a server at its limit would
  refuse them anyway.
* No recipient accepted: no message is sent (RFC 5321 section 3.3).  A server that answers
  DATA with 354 anyway (RFC 2920 section 3.1 says it must refuse) gets the bare terminator, so
  that nothing is delivered and the dialogue stays in step, as Postfix does.
* DATA refused after recipients were accepted: those are settled by the DATA reply.
* Any other reply to DATA (a 2yz, a 1yz, a 3yz but 354): the server and we are out of step
  (RFC 5321 sections 4.1.1.4 and 4.3.2: 354 is DATA's only success), and no message went.
  Every recipient still unsettled is deferred with that reply and 4.5.0 (a 2.0.0 would
  read as success in a delay notice), never taken as delivered, and the session ends
  without reuse: what the server makes of the next line is anybody's guess.
* 354: the body and the final dot (``data.py``), whose reply settles the accepted recipients.

A 421 to any command means the server is closing (RFC 5321 section 3.8): the recipients not
yet settled go to the next host.  The transaction stays "open" from MAIL's 250 until the
reply to the final dot; an open transaction is cleared by RSET before the next one (RFC 5321
section 4.1.1.5).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from zoneq.delivery.transport.abort import OUT_OF_STEP, Abort
from zoneq.delivery.transport.cache import Connection
from zoneq.delivery.transport.commands import DATA, END_OF_DATA_ALONE, RSET, mail_line, rcpt_line
from zoneq.delivery.transport.data import end_of_data, send_body
from zoneq.delivery.transport.ledger import Ledger
from zoneq.delivery.transport.options import BodySource, MailOptions, Recipient, Timeouts
from zoneq.delivery.transport.pipeline import Command, CommandGroup
from zoneq.protocol.replies import Reply, Stage, Verdict, classify


@dataclass(frozen=True, slots=True)
class Envelope:
    """What a session sends, the same for each of its transactions."""

    sender: str
    recipients: Sequence[Recipient]
    options: MailOptions
    body: BodySource
    timeouts: Timeouts
    max_line_length: int


# RCPT replies that mean "too many recipients" once one was accepted (RFC 5321 section
# 4.5.3.1.10: 452, and 552 from servers that still send it, to be treated as 452).
_RECIPIENT_LIMIT = frozenset({452, 552})


def _closing(stage: Stage, reply: Reply) -> None:
    if reply.code == 421:  # RFC 5321 section 3.8: the server is closing the connection
        raise Abort(stage, Verdict.NEXT_HOST, reply=reply)


def _out_of_step(reply: Reply) -> None:
    """End the session after a reply to DATA that is neither 354 nor a refusal (4yz, 5yz).

    The server answered something else than what we sent (RFC 5321 section 4.3.2 lists
    only 354, 4yz and 5yz), so the connection must not carry another command, let alone
    another message.  The Abort defers every recipient not yet settled: the accepted ones
    (no body went) and those waiting for a later transaction alike.
    """
    if reply.code // 100 not in (4, 5):
        detail = f"reply to DATA out of step: {reply}"
        raise Abort(Stage.DATA, Verdict.DEFER, reply=reply, status=OUT_OF_STEP, detail=detail)


def _commands(link: Connection, envelope: Envelope, todo: list[int]) -> list[Command]:
    timeouts, ext = envelope.timeouts, link.extensions
    utf8 = "SMTPUTF8" in ext and (
        envelope.options.smtputf8
        or not envelope.sender.isascii()
        or not all(envelope.recipients[i].address.isascii() for i in todo)
    )
    commands = []
    if link.open_transaction:
        # RFC 5321 section 4.1.1.5: a transaction that did not end with the reply to the end
        # of data (DATA refused) is still open; RSET clears it.  After the reply to the end of
        # data the state is already clear (section 4.1.1.4): no RSET then.
        commands.append(Command(Stage.RSET, RSET, timeouts.rset))
    mail = mail_line(envelope.sender, envelope.options, ext, utf8)
    commands.append(Command(Stage.MAIL, mail, timeouts.mail))
    for index in todo:
        rcpt = rcpt_line(envelope.recipients[index], ext)
        commands.append(Command(Stage.RCPT, rcpt, timeouts.rcpt))
    commands.append(Command(Stage.DATA, DATA, timeouts.data_init))
    return commands


async def transaction(
    link: Connection, ledger: Ledger, envelope: Envelope, todo: list[int]
) -> list[int]:
    """Run one MAIL transaction for ``todo``; return those to send in another (452)."""
    if not link.channel.quiet:
        # A reply nobody asked for is waiting (``Channel.quiet``): every reply would be
        # read one step late, so this connection carries no more mail.
        raise Abort(
            Stage.MAIL, Verdict.NEXT_HOST, status=OUT_OF_STEP, detail="a stray reply is waiting"
        )
    group = CommandGroup(
        link.channel,
        _commands(link, envelope, todo),
        pipelined="PIPELINING" in link.extensions,
    )
    group.send()
    if link.open_transaction:
        reply = await group.reply()
        if not reply.is_positive:
            raise Abort(Stage.RSET, classify(reply, Stage.RSET), reply=reply)
        link.open_transaction = False
    ledger.transactions += 1

    reply = await group.reply()
    if not reply.is_positive:
        ledger.settle_by_reply(todo, Stage.MAIL, reply)
        _closing(Stage.MAIL, reply)
        await _abandon(link, group, envelope.timeouts.data_end)
        return []
    link.open_transaction = True

    accepted: list[int] = []
    later: list[int] = []
    for index in todo:
        if later and not group.pipelined:
            group.skip()  # past the server's limit: straight to the next transaction
            later.append(index)
            continue
        reply = await group.reply()
        if reply.is_positive:
            accepted.append(index)
        elif reply.code in _RECIPIENT_LIMIT and accepted:
            later.append(index)  # RFC 5321 section 4.5.3.1.10: the recipient limit
        else:
            ledger.settle_by_reply([index], Stage.RCPT, reply)
            _closing(Stage.RCPT, reply)
    if not accepted:
        # No DATA without a recipient (RFC 5321 section 3.3): one by one, it is not sent.
        if not group.pipelined:
            group.skip()
        await _abandon(link, group, envelope.timeouts.data_end)
        return later

    reply = await group.reply()
    if reply.code != 354:
        _out_of_step(reply)
        ledger.settle_by_reply(accepted, Stage.DATA, reply)
        _closing(Stage.DATA, reply)
        return later
    await send_body(
        link.channel,
        ledger,
        accepted,
        body=envelope.body,
        timeouts=envelope.timeouts,
        max_line_length=envelope.max_line_length,
    )
    link.open_transaction = False
    return later


async def _abandon(link: Connection, group: CommandGroup, timeout: float) -> None:
    """Read the replies still owed; a 354 to DATA gets the bare terminator (no message)."""
    replies = await group.drain()
    if replies and replies[-1].code == 354:
        try:
            link.channel.write(END_OF_DATA_ALONE)
        except ConnectionError:
            raise Abort(Stage.DATA, Verdict.NEXT_HOST, detail="connection closed") from None
        probe = Ledger(())  # nobody to settle: the reply only keeps the dialogue in step
        await end_of_data(link.channel, probe, [], timeout)
