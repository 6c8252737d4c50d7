"""The API application: built from the core's parts, served on ``api.listen``.

``create_app`` is an app factory in aiohttp's style: it receives the built dependencies
(store, queue service, config, clock) and wires them into typed ``AppKey`` state, the two
middlewares (JSON errors outside, bearer auth inside) and the routes.  ``ApiServer`` runs it
on a TCP site and stops it; ``zoneq serve`` starts it after the receiver and stops it right
after the receiver on SIGTERM.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Final

from aiohttp import web

from zoneq.api.auth import bearer_auth
from zoneq.api.context import CONTEXT, ApiContext
from zoneq.api.errors import json_errors
from zoneq.api.metrics import new_registry
from zoneq.api.routes import setup_routes
from zoneq.api.submit import BUILDS, JSON_BUILDS
from zoneq.api.suppression_list import SuppressionLists
from zoneq.api.token import ensure_token
from zoneq.config import Config
from zoneq.ipc.figures import WorkerFigures
from zoneq.plugin import PluginHost
from zoneq.queue.admin import QueueAdmin
from zoneq.queue.intake import Intake
from zoneq.queue.service import QueueService
from zoneq.storage.store import QueueStore

log = logging.getLogger("zoneq.api")

JSON_OVERHEAD: Final = 1 << 20
SHUTDOWN_GRACE_S: Final = 5.0


def create_app(
    store: QueueStore,
    service: QueueService,
    config: Config,
    *,
    token: str,
    clock: Callable[[], int],
    plugins: PluginHost | None = None,
    workers: WorkerFigures | None = None,
) -> web.Application:
    """``plugins``: the core's, asked at ``queue:route`` for every submitted recipient;
    ``workers``: what the zone workers report of themselves, for ``/metrics``."""
    admin = QueueAdmin(store, service, list(config.zones), clock=clock)
    ctx = ApiContext(
        store=store,
        admin=admin,
        intake=Intake(store, config, clock=clock, plugins=plugins),
        config=config,
        clock=clock,
        token=token,
        registry=new_registry(store, admin, workers),
        suppression=SuppressionLists.from_config(config),
    )
    # A JSON submission is read whole (attachments in base64 are 4/3 of their size); raw
    # uploads are streamed and not bound by this.
    max_json = int(config.receiver.max_message_size) * 4 // 3 + JSON_OVERHEAD
    app = web.Application(middlewares=[json_errors, bearer_auth(token)], client_max_size=max_json)
    app[CONTEXT] = ctx
    app[BUILDS] = asyncio.Semaphore(JSON_BUILDS)
    setup_routes(app)
    return app


class ApiServer:
    """The API on a TCP socket.  Port 0 in ``api.listen`` picks a free port (tests)."""

    def __init__(self, app: web.Application, host: str, port: int) -> None:
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=SHUTDOWN_GRACE_S)
        self._host = host
        self._port = port
        self.port = 0

    async def start(self) -> None:
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        addresses = self._runner.addresses
        self.port = int(addresses[0][1]) if addresses else self._port

    async def close(self) -> None:
        await self._runner.cleanup()


async def start_api(
    store: QueueStore,
    service: QueueService,
    config: Config,
    *,
    clock: Callable[[], int],
    plugins: PluginHost | None = None,
    workers: WorkerFigures | None = None,
) -> ApiServer | None:
    """The API as ``zoneq serve`` runs it, or None when ``api.enabled`` is false.

    A port that cannot be bound raises ``OSError`` (serve stops with the address named): an
    operator who configured the API expects it, and finds out at start, not in an incident.
    """
    if not config.api.enabled:
        return None
    token = ensure_token(config)
    host, port = config.api.listen_address
    app = create_app(
        store, service, config, token=token, clock=clock, plugins=plugins, workers=workers
    )
    server = ApiServer(app, host, port)
    try:
        await server.start()
    except OSError:
        await server.close()
        raise
    log.info("HTTP API on %s:%d", host, server.port)
    return server
