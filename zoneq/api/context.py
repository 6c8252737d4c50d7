"""What the API's views share: the core's parts, under one typed application key."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from aiohttp import web

from zoneq.api.suppression_list import SuppressionLists
from zoneq.config import Config
from zoneq.queue.admin import QueueAdmin
from zoneq.queue.intake import Intake
from zoneq.storage.store import QueueStore

if TYPE_CHECKING:  # metrics.py imports this module for its handlers
    from zoneq.api.metrics import MetricsRegistry


@dataclass(frozen=True, slots=True)
class ApiContext:
    store: QueueStore
    admin: QueueAdmin
    intake: Intake
    config: Config
    clock: Callable[[], int]  # ms since the epoch
    token: str
    registry: MetricsRegistry
    suppression: SuppressionLists | None = None
    """The suppression plugin's list, None when ``[plugins.suppression]`` is not enabled."""


CONTEXT = web.AppKey("context", ApiContext)


def context(request: web.Request) -> ApiContext:
    return request.app[CONTEXT]
