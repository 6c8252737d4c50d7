"""Delivery webhooks: each delivered, deferred and bounced event POSTed as JSON to a URL.

    [plugins.webhooks]
    options = { url = "https://hooks.example.com/zoneq", secret = "...", backlog = 10000 }

The outcome hooks only put the event in a queue and return: a slow or dead receiver must
never hold up a delivery (``async def`` handlers run on zoneq's event loop).  One task
per process sends the queue in order, one POST at a time, so the receiver sees events in
the order they happened; a POST that fails (no connection, a timeout, any status but 2xx)
is retried after a back-off that doubles up to ``max_backoff``, up to ``retries`` times,
after which that event is logged and given up.

The queue is bounded (``backlog`` events waiting, plus the one being sent).  When it is
full the *oldest* waiting event is dropped: when a receiver was down for long, its owner
would rather have the recent outcomes than a day-old trickle, and events are a record, not
the mail itself (the queue's own event log keeps everything; the export reads that).  Drops
are counted and logged, at the first drop and every 1,000 after, and in a summary at stop.

Delivery is at least once: a receiver that took an event but answered too late gets it
again.  Each event carries an ``id`` (also in the ``Idempotency-Key`` header) for
receivers to recognise a repeat.  With ``secret``, the header ``X-Zoneq-Signature`` is
``sha256=`` and the hex HMAC-SHA256 (RFC 2104) of ``<X-Zoneq-Timestamp>.<body>``, so the
receiver can check where the event came from and refuse old replays; with ``token``,
``Authorization: Bearer <token>`` (RFC 6750) is sent.  aiohttp is the client: zoneq already
depends on it, and it gives per-request timeouts and connection reuse.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import hashlib
import hmac
import json
import logging
import time
import uuid
from typing import Any, Final

import aiohttp
from pydantic import AnyHttpUrl, BaseModel, ConfigDict, Field

from zoneq.plugin import Hook, OptionError, OutcomeArgs, PluginApp

EVENTS: Final = (Hook.DELIVERED, Hook.DEFERRED, Hook.BOUNCED)
DROP_LOG_EVERY: Final = 1000


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    url: AnyHttpUrl
    token: str | None = Field(default=None, min_length=1)
    """Sent as ``Authorization: Bearer <token>``."""
    secret: str | None = Field(default=None, min_length=16)
    """HMAC-SHA256 key for ``X-Zoneq-Signature``; at least 16 characters."""
    events: list[str] = Field(default_factory=lambda: [str(hook) for hook in EVENTS])
    timeout: float = Field(default=10.0, gt=0, le=300)
    """Seconds one POST may take, connecting included."""
    retries: int = Field(default=10, ge=0, le=1000)
    """Further attempts after the first fails; then the event is logged and given up."""
    backoff: float = Field(default=1.0, gt=0, le=3600)
    """Seconds before the first retry; doubled after each failure up to ``max_backoff``."""
    max_backoff: float = Field(default=300.0, gt=0, le=86_400)
    backlog: int = Field(default=10_000, ge=1, le=10_000_000)
    """Events waiting to be sent, at most; when full, the oldest is dropped."""


def event_body(hook: Hook, args: OutcomeArgs, event_id: str, now: float) -> dict[str, Any]:
    reply = args.reply
    return {
        "id": event_id,
        "event": str(hook),
        "time": round(now * 1000),
        "zone": args.zone,
        "message_id": args.message_id,
        "sender": args.sender,
        "recipient": args.recipient,
        "attempts": args.attempts,
        "reply": str(reply) if reply is not None else None,
        "code": reply.code if reply is not None else None,
        "enhanced": str(reply.enhanced) if reply is not None and reply.enhanced else None,
    }


def signature(secret: str, timestamp: str, body: bytes) -> str:
    mac = hmac.new(secret.encode(), timestamp.encode() + b"." + body, hashlib.sha256)
    return "sha256=" + mac.hexdigest()


class WebhookSender:
    """The bounded queue of one process and the task that empties it."""

    def __init__(self, options: Options, log: logging.Logger) -> None:
        self.options = options
        self.log = log
        self.waiting: collections.deque[tuple[str, bytes]] = collections.deque()
        # The event being POSTed or waiting out a retry's back-off: no longer in
        # ``waiting``, not yet sent nor given up.
        self.in_flight: tuple[str, bytes] | None = None
        self.dropped = 0
        self.given_up = 0
        self.sent = 0
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self._session: aiohttp.ClientSession | None = None

    def enqueue(self, event_id: str, body: bytes) -> None:
        """Queue one event; never waits.  Starts the sending task on the caller's loop."""
        if len(self.waiting) >= self.options.backlog:
            self.waiting.popleft()
            self.dropped += 1
            if self.dropped == 1 or self.dropped % DROP_LOG_EVERY == 0:
                self.log.warning(
                    "webhook backlog full (%d events): dropped the oldest, %d dropped so far",
                    self.options.backlog,
                    self.dropped,
                )
        self.waiting.append((event_id, body))
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()  # bound to the running loop
            self._task = asyncio.get_running_loop().create_task(self._run())
        self._wake.set()

    async def _run(self) -> None:
        timeout = aiohttp.ClientTimeout(total=self.options.timeout)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            self._session = session
            while True:
                if not self.waiting:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                self.in_flight = self.waiting.popleft()
                await self._deliver(session, *self.in_flight)
                # Not in a finally: an event cut short by close() stays counted as unsent.
                self.in_flight = None

    async def _deliver(self, session: aiohttp.ClientSession, event_id: str, body: bytes) -> None:
        delay = self.options.backoff
        for attempt in range(self.options.retries + 1):
            problem = await self._post(session, event_id, body)
            if problem is None:
                self.sent += 1
                return
            if attempt == self.options.retries:
                break
            self.log.info("webhook %s: %s; retry in %.1f s", event_id, problem, delay)
            await asyncio.sleep(delay)
            delay = min(delay * 2, self.options.max_backoff)
        self.given_up += 1
        self.log.error(
            "webhook %s given up after %d attempts: %s", event_id, self.options.retries + 1, problem
        )

    async def _post(self, session: aiohttp.ClientSession, event_id: str, body: bytes) -> str | None:
        """None when the receiver took the event, else why not."""
        headers = {"Content-Type": "application/json", "Idempotency-Key": event_id}
        if self.options.token is not None:
            headers["Authorization"] = f"Bearer {self.options.token}"
        if self.options.secret is not None:
            timestamp = str(int(time.time()))
            headers["X-Zoneq-Timestamp"] = timestamp
            headers["X-Zoneq-Signature"] = signature(self.options.secret, timestamp, body)
        try:
            async with session.post(str(self.options.url), data=body, headers=headers) as response:
                await response.read()
                if 200 <= response.status < 300:
                    return None
                return f"HTTP {response.status}"
        except TimeoutError:
            return f"no answer within {self.options.timeout:g} s"
        except aiohttp.ClientError as exc:
            return f"{type(exc).__name__}: {exc}"

    def unsent(self) -> int:
        """Events neither sent nor given up: those waiting and the one in flight."""
        return len(self.waiting) + (self.in_flight is not None)

    async def close(self) -> None:
        """At stop: a short grace (one ``timeout``) to send what waits and the event in
        flight (its POST or its retry back-off), then give up on the rest."""
        task = self._task
        if task is not None and not task.done():
            deadline = asyncio.get_running_loop().time() + self.options.timeout
            while self.unsent() and asyncio.get_running_loop().time() < deadline:
                await asyncio.sleep(0.05)
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if self.unsent() or self.dropped or self.given_up:
            self.log.warning(
                "webhooks stopping: %d sent, %d unsent, %d dropped (backlog full), %d given up",
                self.sent,
                self.unsent(),
                self.dropped,
                self.given_up,
            )


def init(app: PluginApp) -> None:
    options = app.options
    assert isinstance(options, Options)
    unknown = sorted(set(options.events) - {str(hook) for hook in EVENTS})
    if unknown:
        text = f"unknown events {', '.join(unknown)}: use delivered, deferred, bounced"
        raise OptionError(("events",), text)
    sender = WebhookSender(options, app.log)

    def handler_for(hook: Hook) -> Any:
        async def queue_event(args: OutcomeArgs) -> None:
            event_id = uuid.uuid4().hex
            body = json.dumps(event_body(hook, args, event_id, time.time())).encode()
            sender.enqueue(event_id, body)

        return queue_event

    for hook in EVENTS:
        if str(hook) in options.events:
            app.add_hook(hook, handler_for(hook))
    app.on_close(sender.close)
