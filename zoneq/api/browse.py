"""Reading the queue: counts, a zone page by page, one message, its source."""

from __future__ import annotations

import re
from typing import Final

from aiohttp import web

from zoneq.api.context import context
from zoneq.api.errors import BadRequest
from zoneq.api.models import MessageView, QueueCounts, RecipientPage, RecipientView, ZoneCounts
from zoneq.protocol.ids import format_id, parse_id
from zoneq.storage.base import QueuedRecipient
from zoneq.storage.records import State

MAX_PAGE: Final = 1000
DEFAULT_PAGE: Final = 100
# ASCII digits only: str.isdigit() is true for "²" or "٣", which int() then refuses (or reads).
_DIGITS: Final = re.compile(r"[0-9]{1,7}")


def client_id(text: str, what: str) -> int:
    """A message or event id the client gave (16 hex digits), or ``BadRequest``."""
    try:
        return parse_id(text)
    except ValueError as exc:
        raise BadRequest(f"{what}: {exc}") from None


def message_id(request: web.Request) -> int:
    return client_id(request.match_info["id"], "id")


def recipient_view(queued: QueuedRecipient) -> RecipientView:
    r = queued.recipient
    return RecipientView(
        message_id=format_id(r.msg_id),
        zone=r.zone,
        address=r.address,
        domain=r.domain,
        state=queued.state.value,
        attempts=r.attempts,
        first_attempt_ms=r.first_attempt_ms,
        last_attempt_ms=r.last_attempt_ms,
        next_attempt_ms=r.next_attempt_ms,
        last_reply=r.last_reply,
        hold_reason=r.hold_reason,
        notify=list(r.notify),
        orcpt=r.orcpt,
    )


def _state(request: web.Request) -> State:
    text = request.query.get("state", State.READY.value)
    try:
        return State(text)
    except ValueError:
        raise BadRequest(f"state: {text!r} is not one of {[s.value for s in State]}") from None


def page_limit(request: web.Request) -> int:
    text = request.query.get("limit", str(DEFAULT_PAGE))
    if not _DIGITS.fullmatch(text) or not 1 <= int(text) <= MAX_PAGE:
        raise BadRequest(f"limit: expected 1 to {MAX_PAGE}, got {text!r}")
    return int(text)


async def counts(request: web.Request) -> web.Response:
    """O(1): from the store's counters, whatever the queue's size."""
    ctx = context(request)
    zones = {zone: ZoneCounts.model_validate(c) for zone, c in ctx.admin.counts().items()}
    body = QueueCounts(messages=ctx.store.message_count(), zones=zones)
    return web.json_response(body.model_dump())


async def domains(request: web.Request) -> web.Response:
    """O(1) per domain: recipients of a zone per destination domain in one state."""
    ctx = context(request)
    zone = ctx.admin.check_zone(request.match_info["zone"])
    state = _state(request)
    return web.json_response(ctx.store.domain_counts(zone, state))


async def browse(request: web.Request) -> web.Response:
    ctx = context(request)
    page = ctx.admin.browse(
        request.match_info["zone"],
        _state(request),
        cursor=request.query.get("cursor") or None,
        limit=page_limit(request),
    )
    body = RecipientPage(
        recipients=[recipient_view(q) for q in page.recipients], cursor=page.cursor
    )
    return web.json_response(body.model_dump())


async def show(request: web.Request) -> web.Response:
    ctx = context(request)
    msg_id = message_id(request)
    meta = ctx.store.message(msg_id)
    body = MessageView(
        id=format_id(msg_id),
        sender=meta.sender,
        size=meta.size,
        received_ms=meta.received_ms,
        zones=list(meta.zones),
        recipient_count=meta.recipient_count,
        headers=meta.headers,
        source=meta.source,
        envid=meta.envid,
        ret=meta.ret,
        is_bounce=meta.is_bounce,
        recipients=[recipient_view(q) for q in ctx.store.recipients(msg_id)],
    )
    return web.json_response(body.model_dump())


async def source(request: web.Request) -> web.StreamResponse:
    """The stored message text, streamed a chunk at a time (``message/rfc822``)."""
    ctx = context(request)
    msg_id = message_id(request)
    ctx.store.message(msg_id)  # 404 before the answer starts
    response = web.StreamResponse(headers={"Content-Type": "message/rfc822"})
    await response.prepare(request)
    for chunk in ctx.store.body(msg_id):
        await response.write(chunk)
    await response.write_eof()
    return response
