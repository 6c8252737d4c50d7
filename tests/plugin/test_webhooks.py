"""The bundled webhooks plugin against real aiohttp servers on loopback.

The plugin is loaded as zoneq loads it (``PluginHost.from_config``) and told outcomes
through ``host.notify``; the receiver is an aiohttp web server on a 127.x address that
fails, hangs or is not there at all, as each test needs.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import logging
import random
import socket
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import pytest
from aiohttp import web

from tests.support.plugins import BUNDLED, config_with, host_with
from zoneq.config import InvalidConfig
from zoneq.errors import ConfigError
from zoneq.plugin import EnhancedStatus, Hook, OutcomeArgs, PluginHost, Reply

pytestmark = pytest.mark.integration

SECRET = "s3cret-s3cret-s3cret"
TOKEN = "tok-123"
OUTCOMES = (Hook.DELIVERED, Hook.DEFERRED, Hook.BOUNCED)
REPLIES = {
    Hook.DELIVERED: Reply(250, ("ok",), EnhancedStatus(2, 0, 0)),
    Hook.DEFERRED: Reply(451, ("try later",), EnhancedStatus(4, 3, 0)),
    Hook.BOUNCED: Reply(550, ("no such user",), EnhancedStatus(5, 1, 1)),
}


@dataclass
class Receiver:
    """What the server got, and how it misbehaves: fail the first ``fail`` posts with 503,
    hang on the first ``hang`` posts (after reading them) for ``hang_s`` seconds."""

    fail: int = 0
    hang: int = 0
    hang_s: float = 30.0
    posts: int = 0
    accepted: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.read()
        self.posts += 1
        if self.posts <= self.hang:
            await asyncio.sleep(self.hang_s)
        if self.posts <= self.fail:
            return web.Response(status=503)
        self.accepted.append(json.loads(body))
        self.headers.append(dict(request.headers) | {"_body": body.decode()})
        return web.Response(status=204)


def loopback() -> tuple[str, int]:
    host = f"127.{random.randint(1, 250)}.{random.randint(1, 250)}.{random.randint(2, 250)}"
    with socket.socket() as probe:
        probe.bind((host, 0))
        return host, int(probe.getsockname()[1])


@asynccontextmanager
async def serving(receiver: Receiver, host: str, port: int) -> AsyncIterator[None]:
    app = web.Application()
    app.router.add_post("/hook", receiver.handle)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    await web.TCPSite(runner, host, port).start()
    try:
        yield
    finally:
        await runner.cleanup()


def webhook_host(host: str, port: int, **options: Any) -> PluginHost:
    settings = {"url": f"http://{host}:{port}/hook", "secret": SECRET, "token": TOKEN}
    settings |= {"timeout": 0.5, "backoff": 0.05, "max_backoff": 0.2, **options}
    return host_with({"webhooks": {"module": BUNDLED / "webhooks.py", "options": settings}})


def outcome(n: int, attempts: int = 1, hook: Hook = Hook.DELIVERED) -> OutcomeArgs:
    return OutcomeArgs("default", f"m{n}", "a@src.test", f"r{n}@dst.test", REPLIES[hook], attempts)


async def tell(host: PluginHost, end: int, start: int = 0) -> float:
    """Notify outcomes ``start`` to ``end - 1`` (cycling through the three hooks); the
    longest call, in seconds."""
    slowest = 0.0
    for n in range(start, end):
        begun = time.perf_counter()
        assert await host.notify(OUTCOMES[n % 3], outcome(n, hook=OUTCOMES[n % 3])) == []
        slowest = max(slowest, time.perf_counter() - begun)
    return slowest


async def until(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.02)


def exchange(receiver: Receiver, count: int, expect: int, **options: Any) -> float:
    """Tell ``count`` outcomes to a plugin posting to ``receiver``, wait until it accepted
    ``expect`` of them, stop the plugin; the longest notify call, in seconds."""

    async def main() -> float:
        address = loopback()
        async with serving(receiver, *address):
            host = webhook_host(*address, **options)
            slowest = await tell(host, count)
            await until(lambda: len(receiver.accepted) == expect)
            await host.close()
        return slowest

    return asyncio.run(main())


def test_every_event_arrives_once_in_order_after_failures() -> None:
    receiver = Receiver(fail=3)
    exchange(receiver, 12, expect=12)
    assert receiver.posts == 12 + 3  # the first event was posted four times
    assert [e["recipient"] for e in receiver.accepted] == [f"r{n}@dst.test" for n in range(12)]
    assert len({e["id"] for e in receiver.accepted}) == 12
    first = receiver.accepted[0]
    assert first | {"id": "", "time": 0} == {
        "id": "",
        "time": 0,
        "event": "delivered",
        "zone": "default",
        "message_id": "m0",
        "sender": "a@src.test",
        "recipient": "r0@dst.test",
        "attempts": 1,
        "reply": "250 2.0.0 ok",
        "code": 250,
        "enhanced": "2.0.0",
    }
    assert [e["event"] for e in receiver.accepted[:3]] == ["delivered", "deferred", "bounced"]
    assert receiver.accepted[2]["reply"] == "550 5.1.1 no such user"


def test_requests_carry_the_token_and_a_signature_that_verifies() -> None:
    receiver = Receiver()
    exchange(receiver, 2, expect=2)
    for headers, event in zip(receiver.headers, receiver.accepted, strict=True):
        assert headers["Authorization"] == f"Bearer {TOKEN}"
        assert headers["Idempotency-Key"] == event["id"]
        signed = f"{headers['X-Zoneq-Timestamp']}.{headers['_body']}".encode()
        expected = hmac.new(SECRET.encode(), signed, hashlib.sha256).hexdigest()
        assert headers["X-Zoneq-Signature"] == f"sha256={expected}"
        assert abs(int(headers["X-Zoneq-Timestamp"]) - time.time()) < 60
        # The signature is over this body: another body would not verify.
        tampered = signed.replace(b'"attempts": 1', b'"attempts": 2')
        assert tampered != signed
        assert hmac.new(SECRET.encode(), tampered, hashlib.sha256).hexdigest() != expected


def test_a_hanging_receiver_never_holds_up_the_caller() -> None:
    receiver = Receiver(hang=1, hang_s=5.0)
    slowest = exchange(receiver, 20, expect=20, timeout=0.5)  # told while the first POST hangs
    assert slowest < 0.2  # queued and returned: not the 0.5 s timeout, nor the 5 s hang
    # The hung POST was read by the receiver but not answered in time, so the event was sent
    # again: at least once, never lost, and in order.  It was never accepted the first time.
    assert [e["recipient"] for e in receiver.accepted] == [f"r{n}@dst.test" for n in range(20)]
    assert receiver.posts == 21


def test_receiver_down_then_up_gets_the_newest_backlog_in_order(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def main() -> Receiver:
        receiver = Receiver()
        address = loopback()  # nothing listens there yet: connection refused
        host = webhook_host(*address, backlog=5, retries=1000)
        await tell(host, 1)
        await asyncio.sleep(0.3)  # a few refused attempts of the first event
        slowest = await tell(host, 12, start=1)  # 11 more while it is retried
        assert slowest < 0.2
        async with serving(receiver, *address):
            await until(lambda: len(receiver.accepted) == 6)
            await asyncio.sleep(0.2)  # nothing more comes
            await host.close()
        return receiver

    with caplog.at_level(logging.INFO, logger="zoneq.plugin.webhooks"):
        receiver = asyncio.run(main())
    # The first event was being sent (retried) all along; of the 11 that waited, the bound
    # of 5 kept the newest 5 and dropped the oldest 6, each counted.
    assert [e["recipient"] for e in receiver.accepted] == [
        f"r{n}@dst.test" for n in (0, 7, 8, 9, 10, 11)
    ]
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "dropped the oldest, 1 dropped so far" in warnings[0]
    assert "6 dropped (backlog full)" in warnings[-1]
    assert any("ClientConnectorError" in r.getMessage() for r in caplog.records)


def test_an_event_is_given_up_after_its_retries(caplog: pytest.LogCaptureFixture) -> None:
    receiver = Receiver(fail=3)
    with caplog.at_level(logging.ERROR, logger="zoneq.plugin.webhooks"):
        exchange(receiver, 2, expect=1, retries=2)
    assert receiver.posts == 4  # three for the first event, given up; one for the second
    assert [e["recipient"] for e in receiver.accepted] == ["r1@dst.test"]
    assert any("given up after 3 attempts: HTTP 503" in r.getMessage() for r in caplog.records)


def test_only_the_chosen_events_are_sent() -> None:
    host = webhook_host("127.0.0.1", 9, events=["bounced"])
    assert not host.handles(Hook.DELIVERED) and not host.handles(Hook.DEFERRED)
    assert host.handles(Hook.BOUNCED)


@pytest.mark.parametrize(
    ("options", "key"),
    [
        ({"url": "ftp://x.test/"}, "plugins.webhooks.options.url"),
        ({"url": "http://x.test/", "backlog": 0}, "plugins.webhooks.options.backlog"),
        ({"url": "http://x.test/", "secret": "short"}, "plugins.webhooks.options.secret"),
        ({"url": "http://x.test/", "colour": "red"}, "plugins.webhooks.options.colour"),
    ],
)
def test_bad_options_name_their_key(options: dict[str, Any], key: str) -> None:
    with pytest.raises(InvalidConfig) as info:
        config_with({"webhooks": {"module": BUNDLED / "webhooks.py", "options": options}})
    assert key in {p.key for p in info.value.problems}


def test_an_unknown_event_stops_start_up() -> None:
    with pytest.raises(ConfigError) as info:
        webhook_host("127.0.0.1", 9, events=["delivered", "opened"])
    assert info.value.key == "plugins.webhooks.options.events"
    assert "opened" in info.value.problem


def test_close_waits_for_the_event_in_its_retry_back_off() -> None:
    """The event being retried has left the queue; stopping in its back-off still lets it
    be sent within the grace rather than cancelling it unseen."""

    async def main() -> Receiver:
        receiver = Receiver(fail=1)
        address = loopback()
        async with serving(receiver, *address):
            host = webhook_host(*address, timeout=2.0, backoff=0.3)
            await tell(host, 1)
            await until(lambda: receiver.posts == 1)  # refused once: now in its back-off
            await host.close()
        return receiver

    receiver = asyncio.run(main())
    assert [e["recipient"] for e in receiver.accepted] == ["r0@dst.test"]
    assert receiver.posts == 2


def test_close_counts_the_event_in_flight_as_unsent(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        host = webhook_host(*loopback(), retries=1000)  # nothing listens: refused, retried
        await tell(host, 1)
        await asyncio.sleep(0.2)
        await host.close()  # past the 0.5 s grace: given up at stop, and said so

    with caplog.at_level(logging.WARNING, logger="zoneq.plugin.webhooks"):
        asyncio.run(main())
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "0 sent, 1 unsent" in warnings[0]
