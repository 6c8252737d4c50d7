"""The message body, the final dot, and the reply that settles the transaction.

The body streams from its chunks through :class:`~zoneq.protocol.encoder.DotStuffer` onto the
connection, so the message is never held whole: memory is bounded by ``WRITE_SIZE`` plus one
chunk.  Small pieces are gathered up to ``WRITE_SIZE`` before a write, and the last piece goes
out in the same write as the terminator, so a message of one small chunk costs one write (a
system call and, on the wire, one packet where it fits).  After each write the transport's
flow control is awaited (RFC 5321 section 4.5.3.2.5: each block must make progress within the
data block timeout).

The reply to the final dot may take ten minutes (RFC 5321 section 4.5.3.2.6): the server may be
scanning the message.  A connection lost or timed out there, or a 421, leaves the message
possibly taken (RFC 1047): those recipients are DEFER and flagged ``possible_duplicate``, never
NEXT_HOST, so that the retry waits instead of sending a copy at once.
"""

from __future__ import annotations

from collections.abc import AsyncGenerator, AsyncIterable, Iterable
from typing import Final

from zoneq.delivery.transport.abort import BAD_CONNECTION, LOCAL_ERROR, Abort, lost
from zoneq.delivery.transport.channel import Channel, ChannelClosed, ChannelTimeout
from zoneq.delivery.transport.ledger import Ledger
from zoneq.delivery.transport.options import BodySource, Timeouts
from zoneq.errors import NotFound, ZoneqError
from zoneq.protocol.encoder import DotStuffer
from zoneq.protocol.replies import DAMAGED_BODY, Reply, Stage, Verdict

WRITE_SIZE: Final = 64 * 1024  # gather encoded pieces up to this much before a write


async def body_chunks(
    source: AsyncIterable[bytes] | Iterable[bytes],
) -> AsyncGenerator[bytes, None]:
    """A body source's chunks, whether it gives them synchronously or not."""
    if isinstance(source, AsyncIterable):
        async for chunk in source:
            yield chunk
    else:
        for chunk in source:
            yield chunk


class BodySizeMismatch(ZoneqError):
    """The stored body did not add up to the message's size: a chunk was torn or lost."""


def body_damaged(exc: BaseException) -> bool:
    """Whether reading a body failed because the stored message is damaged (a chunk the
    core no longer has, or chunks that do not add up to the size), not for a passing
    fault (the core's storage unavailable, the connection to it lost)."""
    return isinstance(exc, (BodySizeMismatch, NotFound))


async def exact_size(
    source: AsyncIterable[bytes] | Iterable[bytes], size: int
) -> AsyncGenerator[bytes, None]:
    """``source``'s chunks, raising ``BodySizeMismatch`` instead of ending when they do not
    add up to ``size`` (the stored octets, before dot-stuffing: ``MessageMeta.size``).

    The raise comes before the source's end is seen by :func:`send_body`, so the final dot
    is never sent: a damaged body is deferred as a local error (and the core quarantines
    the message), never delivered cut short with a 250.  One addition per chunk.
    """
    total = 0
    async for chunk in body_chunks(source):
        total += len(chunk)
        if total > size:
            raise BodySizeMismatch(f"the stored body is over its size of {size} octets")
        yield chunk
    if total != size:
        raise BodySizeMismatch(f"the stored body is {total} octets, not {size}")


async def send_body(
    channel: Channel,
    ledger: Ledger,
    accepted: list[int],
    *,
    body: BodySource,
    timeouts: Timeouts,
    max_line_length: int,
) -> None:
    """Send the body and the final dot (after a 354); settle ``accepted`` by the final reply.

    Raises Abort when the connection cannot be used further: a local fault reading the body
    (DEFER, no dot sent), a stalled write, or no usable final reply (after settling
    ``accepted`` as possible duplicates).
    """
    stuffer = DotStuffer(max_line_length)
    pending = bytearray()
    chunks = body_chunks(body())
    try:
        while True:
            try:
                chunk = await anext(chunks)
            except StopAsyncIteration:
                break
            except Exception as exc:
                # The body source failed (a local fault).  Closing without the final dot
                # makes the server discard the message (RFC 5321 section 4.1.1.4).
                raise Abort(
                    Stage.DATA,
                    Verdict.DEFER,
                    status=DAMAGED_BODY if body_damaged(exc) else LOCAL_ERROR,
                    detail=f"reading the message body failed: {type(exc).__name__}: {exc}",
                ) from None
            pending += stuffer.feed(chunk)
            if len(pending) >= WRITE_SIZE:
                await _write(channel, bytes(pending), timeouts.data_block)
                pending.clear()
    finally:
        await chunks.aclose()
    pending += stuffer.finish()
    try:
        channel.write(bytes(pending))
    except ChannelClosed as exc:
        raise lost(Stage.DATA, str(exc)) from None
    await end_of_data(channel, ledger, accepted, timeouts.data_end)


async def _write(channel: Channel, data: bytes, timeout: float) -> None:
    try:
        channel.write(data)
        await channel.drain(timeout)
    except ChannelTimeout:
        raise lost(Stage.DATA, f"sending the message stalled for {timeout:g} s") from None
    except ChannelClosed as exc:
        raise lost(Stage.DATA, str(exc)) from None


async def end_of_data(
    channel: Channel, ledger: Ledger, accepted: list[int], timeout: float
) -> None:
    """Settle ``accepted`` by the reply to the final dot (already written)."""
    reply: Reply | None = None
    try:
        reply = await channel.read(timeout)
        detail = ""
    except ChannelTimeout:
        detail = f"no reply to the end of data within {timeout:g} s"
    except ChannelClosed as exc:
        detail = f"no usable reply to the end of data: {exc}"
    if reply is not None and reply.code != 421:
        ledger.settle_by_reply(accepted, Stage.END_OF_DATA, reply)
        return
    # RFC 1047: the message may have been taken.  DEFER rather than the NEXT_HOST that
    # classify() gives, so that the retry waits instead of sending a copy at once.
    for index in accepted:
        ledger.settle(
            index,
            Verdict.DEFER,
            Stage.END_OF_DATA,
            reply=reply,
            status=BAD_CONNECTION if reply is None else None,
            detail=detail or "421 after the end of data",
            possible_duplicate=True,
        )
    raise lost(Stage.END_OF_DATA, "not sent: no usable reply to the previous transaction")
