"""``PluginApp``: what a plugin's ``init(app)`` receives and registers its hooks with."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from pydantic import BaseModel

from zoneq.config.model import Config
from zoneq.plugin.hooks import Hook
from zoneq.plugin.threads import PluginThreads

__all__ = ["Handler", "PluginApp"]

Handler = Callable[[Any], object | Awaitable[object]]
"""A hook handler: called with the hook's argument object, returns a result or None."""

T = TypeVar("T")


class PluginApp:
    """What a plugin's ``init(app)`` receives."""

    def __init__(self, name: str, options: BaseModel | dict[str, Any], config: Config) -> None:
        self.name = name
        self.options = options
        """The plugin's ``Options`` model instance, or the raw table if it defines none."""
        self.config = config
        self.log = logging.getLogger(f"zoneq.plugin.{name}")
        self.hooks: list[tuple[Hook, Handler]] = []
        self.closers: list[Callable[[], object | Awaitable[object]]] = []
        self.threads = PluginThreads(name)
        """This plugin's own threads (started at first use): plain handlers run here."""

    def add_hook(self, hook: Hook | str, handler: Handler) -> None:
        """Call ``handler`` at ``hook``; a hook name that does not exist is refused here, at
        start-up, rather than never being called."""
        try:
            known = Hook(hook)
        except ValueError:
            names = ", ".join(h.value for h in Hook)
            raise ValueError(f"unknown hook {hook!r}; hooks are: {names}") from None
        if not callable(handler):
            raise TypeError(f"handler for {known} is not callable: {handler!r}")
        self.hooks.append((known, handler))

    def on_close(self, closer: Callable[[], object | Awaitable[object]]) -> None:
        """Call ``closer`` when zoneq stops (close sessions, flush a backlog)."""
        self.closers.append(closer)

    async def to_thread(self, fn: Callable[..., T], *args: Any) -> T:
        """Run blocking ``fn(*args)`` on this plugin's threads, from an ``async def``
        handler (CPU work such as signing, a blocking library), off the event loop."""
        result: T = await asyncio.wrap_future(self.threads.submit(fn, *args))
        return result
