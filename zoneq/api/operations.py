"""Changing the queue: delete, purge, retry, hold, release, move, pause, resume.

Zone-wide operations answer with how many recipients they changed (0 is an answer); one
message's hold, release or retry that changes nothing is 409, since the caller named a
message in a state the operation does not apply to (nothing held; for a retry, nothing
deferred and nothing on the wire, whose deferral the retry would make due at once).
"""

from __future__ import annotations

from dataclasses import replace

from aiohttp import web

from zoneq.api.browse import message_id
from zoneq.api.context import context
from zoneq.api.errors import BadRequest, Conflict, parse_body
from zoneq.api.models import (
    Count,
    HoldCount,
    HoldRequest,
    MoveCount,
    MoveRequest,
    Selection,
    ZoneState,
    domain_filter,
)
from zoneq.protocol.ids import format_id
from zoneq.protocol.retry import parse_duration
from zoneq.queue import admin, service
from zoneq.storage.records import State


def _count(count: int) -> web.Response:
    return web.json_response(Count(count=count).model_dump())


def _changed(count: int, msg_id: int, what: str) -> web.Response:
    if count == 0:
        raise Conflict(f"message {format_id(msg_id)} has {what}")
    return _count(count)


def _hold_count(done: service.HoldCount) -> web.Response:
    return web.json_response(HoldCount(count=done.now, on_return=done.on_return).model_dump())


async def _hold_request(request: web.Request) -> HoldRequest:
    """The hold's optional body, its reason not empty: the reason is all a held recipient
    shows of why (``zoneq queue browse``), and releases are decided on it."""
    raw = await request.read() if request.can_read_body else b""
    hold = parse_body(HoldRequest, raw) if raw else HoldRequest()
    if not hold.reason.strip():
        raise BadRequest("reason: must not be empty: say why, or leave the field out")
    return hold


async def delete_message(request: web.Request) -> web.Response:
    """The whole message, or ``?recipient=addr`` only; no DSN (postsuper -d)."""
    ctx = context(request)
    return _count(await ctx.admin.delete(message_id(request), request.query.get("recipient")))


async def purge(request: web.Request) -> web.Response:
    ctx = context(request)
    body = parse_body(Selection, await request.read())
    age = None
    if body.older_than is not None:
        try:
            age = parse_duration(body.older_than)
        except ValueError as exc:
            raise BadRequest(f"older_than: {exc}") from None
    selection = admin.Selection(
        zone=body.zone,
        state=None if body.state is None else State(body.state),
        sender_domain=body.sender_domain,
        recipient_domain=body.recipient_domain,
    )
    if selection.is_everything() and not body.all:
        # Read by API clients and by `zoneq queue purge` users alike: both spellings.
        if age is None:
            raise BadRequest('no filter given: purging the whole queue needs "all": true (--all)')
        if age < admin.MIN_PURGE_AGE_MS:
            raise BadRequest(
                f"older_than: {body.older_than!r} is under an hour, so on its own it selects"
                ' nearly the whole queue: add another filter, or "all": true (--all) with it'
            )
    if age is not None:
        selection = replace(selection, older_than_ms=ctx.clock() - age)
    return _count(await ctx.admin.purge(selection))


async def retry_message(request: web.Request) -> web.Response:
    msg_id = message_id(request)
    retried = await context(request).admin.retry_message(msg_id)
    return _changed(retried, msg_id, "nothing on the wire and no deferred recipients")


async def hold_message(request: web.Request) -> web.Response:
    msg_id = message_id(request)
    hold = await _hold_request(request)
    held = await context(request).admin.hold_message(msg_id, hold.reason)
    if held.now == 0 and held.on_return == 0:
        raise Conflict(f"message {format_id(msg_id)} has no ready, deferred or leased recipients")
    return _hold_count(held)


async def release_message(request: web.Request) -> web.Response:
    """As a hold answers: released now (``count``), and those on the wire whose hold on
    return was cancelled (``on_return``); 409 only when neither."""
    msg_id = message_id(request)
    released = await context(request).admin.release_message(msg_id)
    if released.now == 0 and released.on_return == 0:
        raise Conflict(f"message {format_id(msg_id)} has no held recipients")
    return _hold_count(released)


async def retry_zone(request: web.Request) -> web.Response:
    """Deferred recipients of the zone (``?domain=`` to narrow) are ready now, and those on
    the wire when their attempt defers; how many of both."""
    ctx = context(request)
    domain = request.query.get("domain")
    if domain is not None:
        try:
            domain = domain_filter(domain)
        except ValueError as exc:  # "?domain=" must not widen to the whole zone
            raise BadRequest(f"domain: {exc}") from None
    return _count(await ctx.admin.retry(request.match_info["zone"], domain))


async def retry_domain(request: web.Request) -> web.Response:
    """Deferred recipients for one destination domain, in every zone, are ready now, and
    those on the wire when their attempt defers; how many of both."""
    return _count(await context(request).admin.retry(None, request.match_info["domain"]))


async def hold_zone(request: web.Request) -> web.Response:
    hold = await _hold_request(request)
    return _count(await context(request).admin.hold_zone(request.match_info["zone"], hold.reason))


async def release_zone(request: web.Request) -> web.Response:
    return _count(await context(request).admin.release_zone(request.match_info["zone"]))


async def move_zone(request: web.Request) -> web.Response:
    """The zone's recipients (``state`` to narrow) go to the configured zone ``to``, each
    in the state it is in; those on the wire stay, counted as ``in_flight``."""
    zone = request.match_info["zone"]
    body = parse_body(MoveRequest, await request.read())
    if body.to == zone:
        raise BadRequest(f"to: {zone!r} is the zone they are in")
    state = None if body.state is None else State(body.state)
    moved = await context(request).admin.move(zone, body.to, state)
    return web.json_response(MoveCount(count=moved.moved, in_flight=moved.in_flight).model_dump())


async def pause_zone(request: web.Request) -> web.Response:
    zone = request.match_info["zone"]
    await context(request).admin.pause(zone)
    return web.json_response(ZoneState(zone=zone, paused=True).model_dump())


async def resume_zone(request: web.Request) -> web.Response:
    zone = request.match_info["zone"]
    await context(request).admin.resume(zone)
    return web.json_response(ZoneState(zone=zone, paused=False).model_dump())
