"""Loading the enabled plugins: import, validate options, run ``init``; every fault named.

The config loader (below this package) can import a plugin and validate its options, but
the faults a plugin finds in its own ``init`` (a DKIM key file that does not exist, a rule
naming an undefined zone, an unknown event name) only show when ``init`` runs.  So start-up
(``PluginHost.from_config``) and ``zoneq check-config`` (``plugin_problems``) both run it,
here, and report every fault at once, each naming ``plugins.<name>`` (and the option where
the plugin said which, with ``OptionError``): nothing starts half-configured (issue 5).

``check-config`` (``config_problems``) runs the ``init`` of every plugin that loads even when
the loader refused the file for another fault (a plugin's syntax error, a bad option, a pool
address): one run then lists a missing DKIM key next to the syntax error, not after it.

``init`` registers handlers and reads files; it must not start tasks (the bundled plugins
start theirs at the first event), so running it for a check costs nothing lasting, and the
check runs the plugins' ``on_close`` callbacks afterwards all the same.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Collection, Iterable
from pathlib import Path

from zoneq.config.loader import (
    InvalidConfig,
    Problem,
    dotted_key,
    load_config,
    load_plugin,
)
from zoneq.config.model import Config
from zoneq.errors import ConfigError
from zoneq.plugin.app import PluginApp
from zoneq.plugin.errors import OptionError

__all__ = ["config_problems", "initialise", "plugin_problems"]

log = logging.getLogger("zoneq.plugin")


def initialise(
    config: Config, *, skip: Collection[str] = frozenset()
) -> tuple[list[tuple[PluginApp, float]], list[Problem]]:
    """Every enabled plugin initialised, with its time limit; and every fault found.

    ``skip``: plugins left out (neither imported nor initialised), as if disabled.
    """
    apps: list[tuple[PluginApp, float]] = []
    problems: list[Problem] = []
    for name, settings in config.plugins.items():
        if not settings.enabled or name in skip:
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


def plugin_problems(config: Config, *, skip: Collection[str] = frozenset()) -> list[Problem]:
    """What ``zoneq check-config`` adds to the loader's checks: each plugin's ``init`` run
    (on an event loop, as at start-up), then closed again; the plugins in ``skip`` left out."""

    async def check() -> list[Problem]:
        apps, problems = initialise(config, skip=skip)
        for app, _timeout in apps:
            await close_app(app)
        return problems

    return asyncio.run(check())


def config_problems(path: Path | None) -> tuple[list[str], Config | None]:
    """Every fault of the config at ``path`` that ``zoneq check-config`` lists before the API
    token's, one line each; and the config when the loader found no fault.

    First the loader's (the file, TOML, the model, pool and listen addresses, each plugin's
    import and options), then each plugin's own ``init``.  When the loader refused the file
    it built no ``Config``, so the ``init`` checks run on the model alone (its other checks
    are the loader's, just reported), skipping the plugins the loader already named: a
    plugin that does not import is reported once, and hides no other plugin's fault.
    """
    try:
        config = load_config(path, serving=True)  # serve's verdict, its listen addresses too
    except InvalidConfig as exc:
        reported = list(exc.problems)
        model = exc.model
    except ConfigError as exc:  # no file, not UTF-8: nothing more to check
        return [str(exc)], None
    else:
        return [str(p) for p in plugin_problems(config)], config
    if model is not None:  # None: the model itself is at fault, no plugin was loaded
        reported += plugin_problems(model, skip=_named_plugins(model, reported))
    return [str(p) for p in reported], None


def _named_plugins(config: Config, problems: Iterable[Problem]) -> set[str]:
    """The plugins of ``config`` that one of ``problems`` names (its key under theirs)."""
    keys = [p.key for p in problems]
    named: set[str] = set()
    for name in config.plugins:
        prefix = dotted_key(("plugins", name))
        # A "." ends the plugin's part of a key: plugins.dkim2.module is not plugins.dkim's.
        if any(key == prefix or key.startswith(f"{prefix}.") for key in keys):
            named.add(name)
    return named


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
