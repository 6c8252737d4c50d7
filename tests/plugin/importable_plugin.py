"""A plugin loaded by module name rather than file path (see test_host.py)."""

from __future__ import annotations

from zoneq.plugin import Hook, PluginApp, RouteArgs


def init(app: PluginApp) -> None:
    def route(args: RouteArgs) -> str:
        return "bulk"

    app.add_hook(Hook.QUEUE_ROUTE, route)
