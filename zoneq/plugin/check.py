"""Loading the enabled plugins: import, validate options, run ``init``; every fault named.

The config loader (below this package) can import a plugin and validate its options, but
the faults a plugin finds in its own ``init`` (a DKIM key file that does not exist, a rule
naming an undefined zone, an unknown event name) only show when ``init`` runs.  So start-up
(``PluginHost.from_config``) and ``zoneq check-config`` (``plugin_problems``) both run it,
here, and report every fault at once, each naming ``plugins.<name>`` (and the option where
the plugin said which, with ``OptionError``): nothing starts half-configured (issue 5).

``init`` registers handlers and reads files; it must not start tasks (the bundled plugins
start theirs at the first event), so running it for a check costs nothing lasting, and the
check runs the plugins' ``on_close`` callbacks afterwards all the same.
"""

from __future__ import annotations

import asyncio
import inspect
import logging

from zoneq.config.loader import InvalidConfig, Problem, dotted_key, load_plugin
from zoneq.config.model import Config
from zoneq.plugin.app import PluginApp
from zoneq.plugin.errors import OptionError

__all__ = ["initialise", "plugin_problems"]

log = logging.getLogger("zoneq.plugin")


def initialise(config: Config) -> tuple[list[tuple[PluginApp, float]], list[Problem]]:
    """Every enabled plugin initialised, with its time limit; and every fault found."""
    apps: list[tuple[PluginApp, float]] = []
    problems: list[Problem] = []
    for name, settings in config.plugins.items():
        if not settings.enabled:
            continue
        try:
            module, options = load_plugin(name, settings)
        except InvalidConfig as exc:
            problems.extend(exc.problems)
            continue
        app = PluginApp(name, options, config)
        try:
            module.init(app)
        # SystemExit too: a plugin's init calling sys.exit() is its fault, reported as such.
        except (Exception, SystemExit) as exc:
            problems.extend(_init_problems(name, exc))
            continue
        apps.append((app, settings.timeout_s))
    return apps, problems


def plugin_problems(config: Config) -> list[Problem]:
    """What ``zoneq check-config`` adds to the loader's checks: each plugin's ``init`` run
    (on an event loop, as at start-up), then closed again."""

    async def check() -> list[Problem]:
        apps, problems = initialise(config)
        for app, _timeout in apps:
            await close_app(app)
        return problems

    return asyncio.run(check())


async def close_app(app: PluginApp) -> None:
    """Run ``app``'s close callbacks (one that fails does not stop the rest), stop its threads."""
    for closer in app.closers:
        try:
            result = closer()
            if inspect.isawaitable(result):
                await result
        except Exception:
            log.exception("plugin %r: a close callback failed", app.name)
    app.threads.close()


def _init_problems(name: str, exc: BaseException) -> list[Problem]:
    if isinstance(exc, BaseExceptionGroup):
        return [p for inner in exc.exceptions for p in _init_problems(name, inner)]
    if isinstance(exc, OptionError):
        return [Problem(dotted_key(("plugins", name, "options", *exc.where)), exc.problem)]
    return [Problem(dotted_key(("plugins", name)), f"init failed: {type(exc).__name__}: {exc}")]
