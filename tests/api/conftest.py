"""The API under test: a real QueueStore on disk, the real queue service, the aiohttp app on
a real TCP socket of 127.0.0.1 (port 0), and aiohttp's client talking to it.

pytest-asyncio is not installed: async tests run through ``async_test`` (``asyncio.run``).
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import aiohttp

from tests.storage.conftest import T0, async_test, queue_message, store, stores
from zoneq.api.app import ApiServer, create_app
from zoneq.config import Config, loads_config
from zoneq.plugin import PluginHost
from zoneq.queue.service import QueueService
from zoneq.storage.store import QueueStore

__all__ = ["T0", "Api", "api_running", "async_test", "queue_message", "store", "stores"]

TOKEN = "test-token-0123456789abcdef"
CONFIG = """
[server]
hostname = "mx.zoneq.test"
[receiver]
max_message_size = "{max_size}"
[api]
listen = "127.0.0.1:0"
token = "{token}"
[zones.default]
[zones.bulk]
[zones.bounces]
"""


def make_config(max_size: str = "50MiB") -> Config:
    return loads_config(CONFIG.format(token=TOKEN, max_size=max_size))


class Clock:
    """A settable clock (ms), so ages and "older than" are exact."""

    def __init__(self, now: int = T0) -> None:
        self.now = now

    def __call__(self) -> int:
        return self.now


@dataclass
class Api:
    store: QueueStore
    service: QueueService
    config: Config
    clock: Clock
    session: aiohttp.ClientSession
    base: str

    def url(self, path: str) -> str:
        return self.base + path

    async def call(
        self, method: str, path: str, *, token: str | None = TOKEN, **kwargs: Any
    ) -> tuple[int, Any]:
        """One request; the status and the decoded JSON body (None if not JSON)."""
        headers = dict(kwargs.pop("headers", {}))
        if token is not None:
            headers["Authorization"] = f"Bearer {token}"
        async with self.session.request(method, self.url(path), headers=headers, **kwargs) as r:
            body = await r.json() if r.content_type == "application/json" else None
            return r.status, body


@contextlib.asynccontextmanager
async def api_running(
    store: QueueStore,
    config: Config | None = None,
    clock: Clock | None = None,
    plugins: PluginHost | None = None,
) -> AsyncIterator[Api]:
    config = config or make_config()
    clock = clock or Clock()
    service = QueueService.from_config(store, config, clock=clock)
    app = create_app(store, service, config, token=TOKEN, clock=clock, plugins=plugins)
    server = ApiServer(app, "127.0.0.1", 0)
    await server.start()
    try:
        async with aiohttp.ClientSession() as session:
            yield Api(store, service, config, clock, session, f"http://127.0.0.1:{server.port}")
    finally:
        await server.close()
