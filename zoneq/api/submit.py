"""Submission: a message from JSON fields, or a raw RFC 5322 message streamed in.

Either way the answer is 201 only once the message is durable (the store's synced commit);
a local fault is 503 with nothing stored, so the client's retry cannot make a duplicate.
The raw upload is read and written chunk by chunk (``zoneq.queue.intake``): a 100 MB
message never sits in memory.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from aiohttp import web

from zoneq.api.context import context
from zoneq.api.mime import build
from zoneq.api.models import Queued, Submission
from zoneq.protocol.ids import format_id
from zoneq.queue.intake import Envelope, Receipt

READ_SIZE = 65_536


def _source(request: web.Request, how: str) -> dict[str, str]:
    return {"client": request.remote or "", "protocol": how}


def _created(receipt: Receipt) -> web.Response:
    body = Queued(
        id=format_id(receipt.msg_id),
        size=receipt.size,
        recipients=list(receipt.recipients),
        zones=list(receipt.zones),
    )
    location = f"/api/v1/messages/{body.id}"
    return web.json_response(body.model_dump(), status=201, headers={"Location": location})


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def submit_json(request: web.Request) -> web.Response:
    ctx = context(request)
    submission = Submission.model_validate_json(await request.read())
    hostname = ctx.config.server.resolved_hostname()
    data, envelope = build(submission, hostname=hostname, now_ms=ctx.clock())
    receipt = await ctx.intake.receive(
        _once(data), envelope, source=_source(request, "http"), size_hint=len(data)
    )
    return _created(receipt)


async def submit_raw(request: web.Request) -> web.Response:
    """``POST /api/v1/messages/raw?from=a@x&to=b@y&to=c@z``; without ``to``, the envelope
    comes from the header fields (``sendmail -t``, Bcc removed)."""
    ctx = context(request)
    recipients = tuple(request.query.getall("to", []))
    envelope = None
    if recipients or "from" in request.query:
        envelope = Envelope(request.query.get("from", ""), recipients)
    receipt = await ctx.intake.receive(
        request.content.iter_chunked(READ_SIZE),
        envelope,
        source=_source(request, "http-raw"),
        size_hint=request.content_length or 0,
    )
    return _created(receipt)
