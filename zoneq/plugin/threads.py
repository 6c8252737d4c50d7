"""Each plugin's own threads: where its plain (``def``) handlers and ``app.to_thread`` run.

Why not the event loop's default executor (``asyncio.to_thread``): that pool is shared by
the whole process (scrypt for AUTH, the API's file work, ``getaddrinfo`` in the workers)
and has only ``min(32, cpus + 4)`` threads.  The time limit abandons a call but cannot
stop its thread (Python cannot kill a thread), so a handler that never returns used to
take one shared thread per call until nothing else in the process could run (issue 5).
Here a plugin's hung handlers can only use up that plugin's threads.

Why not ``concurrent.futures.ThreadPoolExecutor``: its threads are joined when the
interpreter exits, so one handler that never returns would keep ``zoneq serve`` from
ever stopping after SIGTERM.  These threads are daemons, and the pool is a queue and a few
lines around it.

The pool counts *stuck* calls: ones whose caller gave up at the time limit while the
handler was running, and that have not returned since.  When every thread is stuck a new
call could only wait behind them, so the host fails it at once instead (``stuck_full``).
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
from collections.abc import Callable
from typing import Any, Final

__all__ = ["THREADS_PER_PLUGIN", "PluginThreads", "RaisedGeneratorExit"]

THREADS_PER_PLUGIN: Final = 4
"""Threads each plugin gets for its plain handlers; a plugin that needs more concurrency
for blocking work should make that work faster or use ``async def`` with its own limits."""


class RaisedGeneratorExit(Exception):
    """A call on a plugin's thread raised ``GeneratorExit``; that exception is the cause.

    It cannot reach the caller as itself: asyncio throws a future's exception into the
    awaiting task's coroutine, and a ``GeneratorExit`` thrown into a coroutine first
    closes every coroutine it awaits (PEP 342, ``throw`` as ``close``), so the host could
    not answer and the client's session would end with no reply.  As an ``Exception`` it
    is an ordinary failure of that call."""


_Started = Callable[[], None] | None
_Item = tuple["concurrent.futures.Future[Any]", Callable[..., Any], tuple[Any, ...], _Started]


class PluginThreads:
    """A fixed number of daemon threads, started at the first call, for one plugin."""

    def __init__(self, plugin: str, size: int = THREADS_PER_PLUGIN) -> None:
        if size < 1:
            raise ValueError(f"a plugin needs at least one thread, not {size}")
        self.plugin = plugin
        self.size = size
        self._queue: queue.SimpleQueue[_Item | None] = queue.SimpleQueue()
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._stuck = 0
        self._closed = False

    @property
    def stuck(self) -> int:
        """Calls abandoned at their time limit that are still running."""
        return self._stuck

    @property
    def stuck_full(self) -> bool:
        """Whether every thread is held by a stuck call (a new call would only queue)."""
        return self._stuck >= self.size

    def submit(
        self, fn: Callable[..., Any], *args: Any, started: _Started = None
    ) -> concurrent.futures.Future[Any]:
        """Run ``fn(*args)`` on one of this plugin's threads.  ``started``, if given, is
        called on that thread just before ``fn`` (not at all for a call cancelled while it
        waited): the host's time limit counts from then, not from the submission."""
        future: concurrent.futures.Future[Any] = concurrent.futures.Future()
        with self._lock:
            if self._closed:
                raise RuntimeError(f"plugin {self.plugin!r}: its threads are stopped")
            if not self._threads:
                self._start()
        self._queue.put((future, fn, args, started))
        return future

    def abandoned(self, future: concurrent.futures.Future[Any]) -> None:
        """The caller stopped waiting for ``future`` (time limit).  Not started yet: it is
        cancelled and never runs.  Running: it counts as stuck until it returns."""
        if future.cancel() or future.done():
            return
        with self._lock:
            self._stuck += 1
        # Called at once if it finished in between, so the count cannot leak.
        future.add_done_callback(self._returned)

    def close(self) -> None:
        """Let idle threads end; stuck ones end when their call returns (or with the
        process: they are daemons)."""
        with self._lock:
            self._closed = True
            for _ in self._threads:
                self._queue.put(None)

    def _returned(self, _future: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._stuck -= 1

    def _start(self) -> None:
        for index in range(self.size):
            thread = threading.Thread(
                target=self._work, name=f"plugin-{self.plugin}-{index}", daemon=True
            )
            thread.start()
            self._threads.append(thread)

    def _work(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            future, fn, args, started = item
            if not future.set_running_or_notify_cancel():
                continue  # cancelled while it waited: its caller already gave up
            try:
                if started is not None:
                    started()
                result = fn(*args)
            except GeneratorExit as exc:  # not as itself: see RaisedGeneratorExit
                future.set_exception(_carried(exc))
            # BaseException, as concurrent.futures does: a handler's SystemExit or
            # KeyboardInterrupt becomes that call's failure, not the end of the thread.
            except BaseException as exc:
                future.set_exception(exc)
            else:
                future.set_result(result)


def _carried(exc: GeneratorExit) -> RaisedGeneratorExit:
    carrier = RaisedGeneratorExit(str(exc) or "GeneratorExit")
    carrier.__cause__ = exc
    return carrier
