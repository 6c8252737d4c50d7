"""Starts the zone worker processes, restarts the ones that die, stops them on shutdown.

Each worker runs as ``python -m zoneq worker --zone Z --name N [--config F]``.  A worker that
exits while zoneq is running is restarted after a delay that doubles with each quick
failure (1 s up to 30 s), so a worker that cannot start does not spin.  On shutdown every
worker gets SIGTERM (it finishes the jobs in hand), then SIGKILL after ``grace`` seconds;
always by PID, and only the processes started here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("zoneq.supervisor")

MIN_DELAY_S = 1.0
MAX_DELAY_S = 30.0
STABLE_S = 60.0  # a worker that ran this long resets the delay


@dataclass
class _Slot:
    zone: str
    name: str
    process: asyncio.subprocess.Process | None = None
    delay: float = MIN_DELAY_S
    started: float = 0.0
    restarts: int = 0
    task: asyncio.Task[None] | None = field(default=None, repr=False)


class Supervisor:
    def __init__(
        self, workers: dict[str, int], config_path: Path | None, grace: float = 30.0
    ) -> None:
        self._slots = [
            _Slot(zone, f"{zone}-{n}")
            for zone, count in sorted(workers.items())
            for n in range(count)
        ]
        self._config_path = config_path
        self._grace = grace
        self._stopping = False

    def _command(self, slot: _Slot) -> list[str]:
        command = [
            sys.executable,
            "-m",
            "zoneq",
            "worker",
            "--zone",
            slot.zone,
            "--name",
            slot.name,
        ]
        if self._config_path is not None:
            command += ["--config", str(self._config_path)]
        return command

    async def start(self) -> None:
        for slot in self._slots:
            await self._spawn(slot)
            slot.task = asyncio.create_task(self._watch(slot))

    async def _spawn(self, slot: _Slot) -> None:
        slot.process = await asyncio.create_subprocess_exec(*self._command(slot))
        slot.started = time.monotonic()
        log.info("worker %s started (pid %d)", slot.name, slot.process.pid)

    async def _watch(self, slot: _Slot) -> None:
        while not self._stopping:
            assert slot.process is not None
            code = await slot.process.wait()
            if self._stopping:
                return
            ran = time.monotonic() - slot.started
            slot.delay = MIN_DELAY_S if ran >= STABLE_S else min(slot.delay * 2, MAX_DELAY_S)
            log.warning(
                "worker %s (pid %d) exited with %s after %.1f s; restarting in %.0f s",
                slot.name,
                slot.process.pid,
                code,
                ran,
                slot.delay,
            )
            await asyncio.sleep(slot.delay)
            if self._stopping:
                return
            slot.restarts += 1
            await self._spawn(slot)

    def pids(self) -> dict[str, int]:
        return {s.name: s.process.pid for s in self._slots if s.process is not None}

    def restarts(self) -> int:
        return sum(slot.restarts for slot in self._slots)

    async def stop(self) -> None:
        self._stopping = True
        running = [s.process for s in self._slots if s.process and s.process.returncode is None]
        for process in running:
            with contextlib.suppress(ProcessLookupError):
                process.send_signal(signal.SIGTERM)
        waits = [asyncio.create_task(p.wait()) for p in running]
        if waits:
            _, late = await asyncio.wait(waits, timeout=self._grace)
            for process in running:
                if process.returncode is None:
                    log.warning(
                        "worker pid %d did not stop in %.0f s: killing", process.pid, self._grace
                    )
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
            if late:
                await asyncio.wait(late, timeout=5)
        for slot in self._slots:
            if slot.task is not None:
                slot.task.cancel()
