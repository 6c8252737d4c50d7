"""The supervisor's watch for hung workers (``Watch`` in ``zoneq/supervisor.py``).

``Watch.overdue`` is pure and tested from a table.  The rest runs the real ``Supervisor``
on ``/bin/sh`` children that sleep (a hung worker is one that says nothing), with a
``heard`` of the test's own standing in for the IPC server's: who is killed, when, what is
logged, and that a stop in progress is never raced by a kill.
"""

from __future__ import annotations

import asyncio
import re
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.storage.conftest import async_test
from zoneq.supervisor import Backoff, Supervisor, Watch

FAST = Backoff(first=0.05, cap=0.1, stable=60.0)
SLEEPER = ("/bin/sh", "-c", "exec sleep 30")


def never_heard() -> dict[int, float]:
    return {}


WATCH = Watch(never_heard, silence=60.0, starting=120.0)


@pytest.mark.parametrize(
    ("started", "heard", "now", "overdue"),
    [
        (0.0, None, 119.0, None),  # starting up: the longer allowance
        (0.0, None, 120.0, None),  # exactly at it: not yet
        (0.0, None, 121.0, 121.0),  # never said hello: silent since its start
        (0.0, 100.0, 121.0, None),  # said something 21 s ago
        (0.0, 100.0, 160.0, None),
        (0.0, 100.0, 160.5, 60.5),  # a minute of silence after the last word
        (500.0, 10.0, 600.0, 590.0),  # counted from the last word, not from the start
    ],
)
def test_when_a_worker_is_overdue(
    started: float, heard: float | None, now: float, overdue: float | None
) -> None:
    assert WATCH.overdue(started, heard, now) == overdue


async def wait_for(condition: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        await asyncio.sleep(0.02)


@async_test
async def test_a_silent_worker_is_killed_and_restarted_a_talking_one_is_not(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Two workers; the core hears from ``z-1`` all along and last heard from ``z-0`` long
    ago.  Only ``z-0`` is killed (SIGKILL, logged with its name, PID and silence), and the
    supervisor starts it again."""
    supervisor: Supervisor | None = None

    def heard() -> dict[int, float]:
        assert supervisor is not None
        pids = supervisor.pids()
        now = time.monotonic()
        return {pids["z-0"]: now - 5.0, pids["z-1"]: now}

    watch = Watch(heard, silence=1.0, starting=30.0)
    supervisor = Supervisor({"z": 2}, None, 5, backoff=FAST, command=SLEEPER, watch=watch)
    with caplog.at_level("WARNING", logger="zoneq.supervisor"):
        await supervisor.start()
        try:
            first = supervisor.pids()
            await wait_for(lambda: supervisor.restarts() >= 1)
            after = supervisor.pids()
        finally:
            await supervisor.stop()
    assert after["z-0"] != first["z-0"]
    assert after["z-1"] == first["z-1"]
    logged = caplog.text
    assert re.search(rf"worker z-0 \(pid {first['z-0']}\) silent for 5\.\d s", logged), logged
    assert f"worker z-0 (pid {first['z-0']}) exited with -9" in logged
    assert "z-1" not in logged


@async_test
async def test_a_worker_that_never_says_hello_gets_the_start_up_allowance(
    caplog: pytest.LogCaptureFixture,
) -> None:
    watch = Watch(never_heard, silence=0.1, starting=1.5)
    supervisor = Supervisor({"z": 1}, None, 5, backoff=FAST, command=SLEEPER, watch=watch)
    with caplog.at_level("WARNING", logger="zoneq.supervisor"):
        await supervisor.start()
        try:
            (first,) = supervisor.pids().values()
            begun = time.monotonic()
            await wait_for(lambda: supervisor.restarts() >= 1)
            killed_after = time.monotonic() - begun
        finally:
            await supervisor.stop()
    # Not at the silence of a worker that has spoken: at the start-up allowance.
    assert killed_after >= 1.5
    assert f"worker z-0 (pid {first}) has not connected" in caplog.text


@async_test
async def test_a_stop_in_progress_is_not_raced_by_the_watch(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A worker finishing its jobs after SIGTERM says nothing more to the core, and may take
    its time: it stops on its own, it is not killed as hung meanwhile."""
    ended = tmp_path / "ended"
    # Ends 2 s after SIGTERM (trap runs once the sleep in the foreground is over).
    finishing = f'trap "sleep 2; echo done > {ended}; exit 0" TERM; while :; do sleep 0.1; done'
    heard_at: dict[int, float] = {}
    watch = Watch(lambda: heard_at, silence=1.0, starting=30.0)
    command = ("/bin/sh", "-c", finishing)
    supervisor = Supervisor({"z": 1}, None, 10, backoff=FAST, command=command, watch=watch)
    with caplog.at_level("WARNING", logger="zoneq.supervisor"):
        await supervisor.start()
        (pid,) = supervisor.pids().values()
        heard_at[pid] = time.monotonic()  # it spoke, once, just now
        await asyncio.sleep(0.5)
        await supervisor.stop()  # the worker goes quiet for good from here
    assert ended.read_text() == "done\n"  # it finished; SIGKILL would have cut the trap
    assert "silent" not in caplog.text
    assert supervisor.restarts() == 0
