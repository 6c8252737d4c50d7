"""Submission: a message from JSON fields, or a raw RFC 5322 message streamed in.

Either way the answer is 201 only once the message is durable (the store's synced commit);
a local fault is 503 with nothing stored, so the client's retry cannot make a duplicate.
The raw upload is read and written chunk by chunk (``zoneq.queue.intake``): a 100 MB
message never sits in memory.

Recipients are routed as SMTP's are, ``queue:route`` plugins included.  Recipients a plugin
refuses are listed in the answer (``refused``, each with the plugin's reply) and the rest
queued; when every recipient is refused nothing is stored and the answer is 422 (a 5yz
reply: do not send this again) or 503 with Retry-After (a 4yz reply among them: later may
work).  A failing plugin is 503 too, as any local fault.  When every recipient was dropped
by a plugin (accepted, not delivered, an event each) the answer is 200: nothing was
created, so there is no Location.

A JSON submission is read whole and built into a message (``zoneq.api.mime``): the body,
its model, the decoded attachments and the message's bytes are several copies of the
attachment at once, and the build is CPU work of up to seconds.  So at most ``JSON_BUILDS``
are read and built at once, in a thread, off the event loop that SMTP sessions and the other
requests share.  The rest wait, their bodies unread (TCP holds them back, not memory), for
at most ``JSON_WAIT_S``: then 503 with Retry-After, as any local and temporary fault, rather
than a client left hanging behind a queue of big builds.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterable, AsyncIterator
from typing import Final

from aiohttp import ClientPayloadError, web

from zoneq.api.context import context
from zoneq.api.errors import RETRY_AFTER_S, error_response, parse_body
from zoneq.api.mime import build, check_bounds
from zoneq.api.models import Queued, RefusedRecipient, Submission
from zoneq.plugin import PluginFailure
from zoneq.protocol.ids import format_id
from zoneq.queue.consults import RoutingTooSlow
from zoneq.queue.intake import Envelope, Receipt, Refused

log = logging.getLogger("zoneq.api")

READ_SIZE = 65_536
JSON_BUILDS: Final = 2
JSON_WAIT_S: Final = 30.0
# How long a JSON body may take to arrive once its permit is held: a client sending it
# slowly would otherwise keep a permit, and with JSON_BUILDS of them refuse everyone else.
JSON_READ_S: Final = 30.0
BUILDS: Final = web.AppKey("json_builds", asyncio.Semaphore)


def _source(request: web.Request, how: str) -> dict[str, str]:
    return {"client": request.remote or "", "protocol": how}


def _created(receipt: Receipt) -> web.Response:
    body = Queued(
        id=format_id(receipt.msg_id),
        size=receipt.size,
        recipients=list(receipt.recipients),
        zones=list(receipt.zones),
        refused=[
            RefusedRecipient(recipient=r.recipient, code=r.reply.code, reply=str(r.reply))
            for r in receipt.refused
        ],
    )
    if not receipt.recipients:  # every one dropped by a plugin: nothing was stored
        return web.json_response(body.model_dump(), status=200)
    location = f"/api/v1/messages/{body.id}"
    return web.json_response(body.model_dump(), status=201, headers={"Location": location})


async def _queue(
    request: web.Request,
    body: AsyncIterable[bytes],
    envelope: Envelope | None,
    how: str,
    size_hint: int,
    *,
    sender: str | None = None,
    recipients: tuple[str, ...] = (),
) -> web.Response:
    """Hand the message to the intake; the answer for what became of it."""
    intake = context(request).intake
    try:
        receipt = await intake.receive(
            body,
            envelope,
            source=_source(request, how),
            size_hint=size_hint,
            sender=sender,
            recipients=recipients,
        )
    except Refused as exc:
        if exc.transient:
            return error_response(503, str(exc), {"Retry-After": RETRY_AFTER_S})
        return error_response(422, str(exc))
    except (PluginFailure, RoutingTooSlow) as exc:
        # Ours and temporary, like SMTP's 451 4.3.0; the details are for the log only.  A
        # routing deadline means no plugin hung, but there were too many recipients for
        # it: as temporary, and not the storage fault the generic 503 names.
        log.error("%s %s: %s", request.method, request.path, exc)
        if isinstance(exc, RoutingTooSlow):
            text = "routing the recipients took too long (local, temporary): nothing was stored"
        else:
            text = "a routing plugin failed (local, temporary): nothing was stored, try again later"
        return error_response(503, text, {"Retry-After": RETRY_AFTER_S})
    return _created(receipt)


async def _once(data: bytes) -> AsyncIterator[bytes]:
    yield data


def _built(
    raw: bytes, *, hostname: str, now_ms: int, max_recipients: int
) -> tuple[bytes, Envelope]:
    """The JSON body made into a message; in a thread (touches no loop state)."""
    submission = parse_body(Submission, raw)
    check_bounds(submission, max_recipients=max_recipients)
    return build(submission, hostname=hostname, now_ms=now_ms)


async def submit_json(request: web.Request) -> web.Response:
    ctx = context(request)
    builds = request.app[BUILDS]
    try:
        async with asyncio.timeout(JSON_WAIT_S):
            await builds.acquire()
    except TimeoutError:
        text = "busy building other JSON submissions (local, temporary): nothing was stored"
        return error_response(503, text, {"Retry-After": RETRY_AFTER_S})
    # Released when the build ends: aiohttp does not cancel a handler whose client left
    # (its handler_cancellation is off), so the thread never outlives the permit.
    try:
        try:
            async with asyncio.timeout(JSON_READ_S):
                raw = await request.read()
        except TimeoutError:
            text = f"the request body did not arrive within {JSON_READ_S:g} s: nothing stored"
            return error_response(408, text)
        except (ClientPayloadError, ConnectionResetError) as exc:
            # The client went away mid-body, as for the raw upload below: its doing.
            log.info("%s %s: body cut off, nothing stored: %r", request.method, request.path, exc)
            return error_response(400, "the body was cut off before its end: nothing stored")
        data, envelope = await asyncio.to_thread(
            _built,
            raw,
            hostname=ctx.config.server.resolved_hostname(),
            now_ms=ctx.clock(),
            max_recipients=ctx.config.receiver.max_recipients,
        )
    finally:
        builds.release()
    return await _queue(request, _once(data), envelope, "http", len(data))


async def submit_raw(request: web.Request) -> web.Response:
    """``POST /api/v1/messages/raw?from=a@x&to=b@y&to=c@z``.  Without ``to`` the recipients
    come from the header fields (``sendmail -t``: To, Cc, Bcc; the Bcc field removed);
    without ``from`` the sender does (Sender, else From); ``from=`` (empty) is the null
    reverse-path ``<>``.  Line ends are stored as CRLF, whatever the upload used."""
    recipients = tuple(request.query.getall("to", []))
    sender = request.query.get("from")
    body = request.content.iter_chunked(READ_SIZE)
    size = request.content_length or 0
    try:
        return await _queue(
            request, body, None, "http-raw", size, sender=sender, recipients=recipients
        )
    except (ClientPayloadError, ConnectionResetError) as exc:
        # The client went away mid-upload: its doing, not a fault of ours, and nothing was
        # stored (the intake abandoned the message).  The 400 is for the access log only.
        log.info("%s %s: upload cut off, nothing stored: %r", request.method, request.path, exc)
        return error_response(400, "the upload was cut off before its end: nothing stored")
