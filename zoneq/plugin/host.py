"""The plugin host: loads the enabled plugins and calls their hooks, each under a time limit.

A plugin is a module with ``init(app)``; ``app.add_hook(Hook.X, handler)`` registers a
handler, which is called with the hook's argument object (``hooks.py``).  ``async def``
handlers run on the event loop; plain functions run on the plugin's own threads
(``threads.py``), so a handler that blocks (file I/O, a slow crypto library, a hang) cannot
stall every SMTP session, and the time limit can abandon it.  An abandoned thread runs on
until it returns by itself (Python has no way to kill a thread); when all of a plugin's
threads are held so, its next calls fail at once (``Fault.STUCK``) rather than queue, and
nothing else in zoneq is short of a thread.

A plain handler's time limit counts from when it starts running on one of those threads,
not from the call: under a burst, calls wait for a thread, and a call that waited is not a
hang.  The wait has its own bound, the same figure: a call that got no thread within it
never runs and fails as ``Fault.BUSY`` (451 4.3.0 too).  So a call takes at most twice its
plugin's limit, well inside any SMTP client's command timeouts (RFC 5321 section
4.5.3.2: minutes).

Isolation (issue 5): whatever a handler does, ``call`` either returns a ``HookResult`` or
raises ``PluginFailure``; the callers turn that into 451 4.3.0 at receive time and a logged
deferral at send time.  ``notify`` (outcome hooks) never raises.  "Whatever" includes any
``BaseException`` (``KeyboardInterrupt``, ``SystemExit``, a stray ``CancelledError``, a
``GeneratorExit``); only the caller's own cancellation and the close of the host's own
coroutine pass through.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import Collection
from dataclasses import dataclass, field, replace

from zoneq.config.loader import InvalidConfig
from zoneq.config.model import Config
from zoneq.plugin.app import Handler, PluginApp
from zoneq.plugin.check import close_app, initialise
from zoneq.plugin.errors import Fault, PluginFailure
from zoneq.plugin.hooks import SPECS, AddHeaders, Drop, Hook, Mode, RouteArgs
from zoneq.protocol.replies import Reply

__all__ = ["Handler", "HookResult", "PluginApp", "PluginHost"]

log = logging.getLogger("zoneq.plugin")


@dataclass(frozen=True, slots=True)
class HookResult:
    """What the plugins decided at one hook; all None/empty when none had an opinion."""

    reply: Reply | None = None
    zone: str | None = None
    drop: Drop | None = None
    authenticated: bool | None = None
    headers: tuple[bytes, ...] = ()
    plugin: str | None = None
    """The plugin whose answer decided (the last to add headers or choose a zone)."""


@dataclass(slots=True)
class _Registered:
    app: PluginApp
    handler: Handler
    timeout_s: float

    @property
    def plugin(self) -> str:
        return self.app.name


@dataclass(slots=True)
class PluginHost:
    """The loaded plugins' handlers per hook, in config order."""

    zones: Collection[str]
    handlers: dict[Hook, list[_Registered]] = field(default_factory=dict)
    apps: list[PluginApp] = field(default_factory=list)

    @classmethod
    def from_config(cls, config: Config) -> PluginHost:
        """Import, configure and initialise every enabled plugin.

        Raises ``InvalidConfig`` (a ``ConfigError``) listing every plugin's faults, each
        naming ``plugins.<name>``: nothing starts with a plugin missing (issue 5).
        """
        apps, problems = initialise(config)
        if problems:
            raise InvalidConfig(problems, "plugins")
        host = cls(zones=frozenset(config.zones))
        for app, timeout_s in apps:
            host.add(app, timeout_s)
        return host

    def add(self, app: PluginApp, timeout_s: float) -> None:
        for hook, handler in app.hooks:
            self.handlers.setdefault(hook, []).append(_Registered(app, handler, timeout_s))
        self.apps.append(app)

    def handles(self, hook: Hook) -> bool:
        """Whether any plugin listens at ``hook`` (callers skip building arguments if not)."""
        return bool(self.handlers.get(hook))

    async def call(self, hook: Hook, args: object) -> HookResult:
        """Ask the plugins at ``hook``; raises ``PluginFailure`` if one misbehaves."""
        spec = SPECS[hook]
        if spec.mode is Mode.NOTIFY:
            raise ValueError(f"{hook} is an outcome hook: use notify()")
        if not isinstance(args, spec.args):
            raise TypeError(f"{hook} takes {spec.args.__name__}, not {type(args).__name__}")
        headers: list[bytes] = []
        chosen: HookResult = HookResult()
        for entry in self.handlers.get(hook, ()):
            result = await self._invoke(hook, entry, args)
            if result is None:
                continue
            if isinstance(result, AddHeaders):
                headers.extend(result.fields)
                chosen = HookResult(plugin=entry.plugin)
                continue
            if spec.mode is Mode.CHAIN and isinstance(result, str):
                # The next plugin sees this choice as if the rules had made it.
                args = replace(args, zone=result, rule=f"plugin:{entry.plugin}")  # type: ignore[type-var]
                chosen = HookResult(zone=result, plugin=entry.plugin)
                continue
            if isinstance(result, Drop):
                # Dropped where the chain had placed it, not where the rules had: the
                # DROPPED event's zone is what per-zone analytics count.
                assert isinstance(args, RouteArgs)  # the only hook that allows a Drop
                result = replace(result, zone=args.zone)
            return _decision(result, entry.plugin, tuple(headers))
        return replace(chosen, headers=tuple(headers))

    async def notify(self, hook: Hook, args: object) -> list[PluginFailure]:
        """Tell every plugin at an outcome hook; failures are logged and returned, not raised."""
        failures: list[PluginFailure] = []
        for entry in self.handlers.get(hook, ()):
            try:
                await self._invoke(hook, entry, args)
            except PluginFailure as exc:
                log.error("%s", exc)
                failures.append(exc)
        return failures

    async def close(self) -> None:
        """Run the plugins' ``on_close`` callbacks (one that fails does not stop the rest)
        and stop their threads."""
        for app in self.apps:
            await close_app(app)

    async def _invoke(self, hook: Hook, entry: _Registered, args: object) -> object:
        try:
            result = await _run(hook, entry, args)
        except TimeoutError:
            raise PluginFailure(
                entry.plugin, hook, Fault.TIMED_OUT, f"no answer within {entry.timeout_s:g}s"
            ) from None
        except PluginFailure:
            raise
        # BaseException, not Exception (issue 5): raised from a handler, SystemExit or
        # KeyboardInterrupt would reach the event loop and stop the whole server, and a
        # CancelledError, a GeneratorExit or a bare BaseException would end the client's
        # session with no reply.  What is not the handler's own is passed on: the
        # caller's cancellation and the close of this coroutine.
        except BaseException as exc:
            if _closing(exc) or _caller_cancelled(exc):
                raise
            detail = f"{type(exc).__name__}: {exc}"
            raise PluginFailure(entry.plugin, hook, Fault.RAISED, detail) from exc
        problem = self._check(hook, result)
        if problem is not None:
            raise PluginFailure(entry.plugin, hook, Fault.GARBAGE, problem)
        return result

    def _check(self, hook: Hook, result: object) -> str | None:
        """Why ``result`` is not an answer ``hook`` allows, or None if it is."""
        spec = SPECS[hook]
        if result is None:
            return None
        if spec.mode is Mode.NOTIFY:
            return f"outcome hooks return nothing, got {type(result).__name__}"
        if not isinstance(result, spec.results):
            allowed = ", ".join(kind.__name__ for kind in spec.results)
            return f"expected None or {allowed}, got {type(result).__name__} {result!r:.80}"
        if isinstance(result, Reply) and not 400 <= result.code <= 599:
            return f"a reply from a plugin must refuse (4xx or 5xx), got {result.code}"
        if isinstance(result, str) and result not in self.zones:
            return f"routed to zone {result!r}, which is not defined in [zones]"
        return None


def _caller_cancelled(exc: BaseException) -> bool:
    """Whether ``exc`` is the calling task's own cancellation (``Task.cancel``, a timeout
    around the call, a session or the server closing), which must reach the caller, rather
    than a ``CancelledError`` a handler raised that nobody asked for."""
    if not isinstance(exc, asyncio.CancelledError):
        return False
    task = asyncio.current_task()
    # Python 3.11: cancelling() counts the cancel() requests not yet uncancelled.
    return task is not None and task.cancelling() > 0


def _closing(exc: BaseException) -> bool:
    """Whether ``exc``, caught in ``_invoke``, is the close of that coroutine
    (``coroutine.close()``), which must end it, rather than a ``GeneratorExit`` a handler
    raised, which is only that plugin's failure.  ``close()`` closes the innermost
    coroutine first and then raises a new ``GeneratorExit`` in each frame outwards (PEP
    342), so the one ``_invoke`` sees was raised at its own ``await`` and its traceback
    holds that frame alone; one a handler raised comes up through ``_run``.  (A plain
    handler's arrives from its thread as a ``RaisedGeneratorExit``: see ``threads.py``.)"""
    where = exc.__traceback__
    return isinstance(exc, GeneratorExit) and where is not None and where.tb_next is None


async def _run(hook: Hook, entry: _Registered, args: object) -> object:
    """The handler's answer; ``TimeoutError`` when it ran past its time limit."""
    handler = entry.handler
    if inspect.iscoroutinefunction(handler):
        async with asyncio.timeout(entry.timeout_s):
            result: object = await handler(args)
        return result
    threads = entry.app.threads
    if threads.stuck_full:
        # Queueing behind calls that may never return would only time out later; failing
        # now answers the client at once (451) and keeps the plugin's backlog at zero.
        detail = f"{threads.stuck} calls still running past their time limit"
        raise PluginFailure(entry.plugin, hook, Fault.STUCK, detail)
    loop = asyncio.get_running_loop()
    begun: list[float] = []  # the handler's start, appended on the plugin's thread
    # loop.time() is time.monotonic(), safe from any thread.
    future = threads.submit(handler, args, started=lambda: begun.append(loop.time()))
    answer = asyncio.wrap_future(future)
    try:
        # The time limit is the handler's: measured from when it starts running, so a
        # burst of calls queued for the plugin's threads is not blamed as hangs.  The wait
        # for a thread has a bound of its own (the same figure) and a truthful fault.
        try:
            async with asyncio.timeout(entry.timeout_s):
                result = await asyncio.shield(answer)
            start = begun[0]
        except TimeoutError:
            if future.cancel():  # still queued: it never runs
                detail = (
                    f"none of its {threads.size} threads was free within "
                    f"{entry.timeout_s:g}s (the call never ran)"
                )
                raise PluginFailure(entry.plugin, hook, Fault.BUSY, detail) from None
            start = begun[0] if begun else loop.time()  # just started
            async with asyncio.timeout_at(start + entry.timeout_s):
                result = await answer
        if inspect.isawaitable(result):  # a plain callable that returned a coroutine
            async with asyncio.timeout_at(start + entry.timeout_s):
                result = await result
    except (asyncio.CancelledError, TimeoutError):  # the limit (or the caller) gave up
        threads.abandoned(future)  # nothing to do if it never ran or has returned
        raise
    return result


def _decision(result: object, plugin: str, headers: tuple[bytes, ...]) -> HookResult:
    if isinstance(result, Reply):
        return HookResult(reply=result, headers=headers, plugin=plugin)
    if isinstance(result, Drop):
        return HookResult(drop=result, plugin=plugin)
    if isinstance(result, bool):
        return HookResult(authenticated=result, plugin=plugin)
    assert isinstance(result, str)  # _check allowed nothing else
    return HookResult(zone=result, plugin=plugin)
