"""Starts zoneq's child processes, restarts the ones that die, stops them on shutdown.

Two kinds of children, one supervisor class, each run as ``python -m zoneq --log-level V
<kind> ... [--config-on-stdin] [--config F]``:

* zone workers, ``worker --zone Z --name N`` (``Supervisor(workers, ...)``);
* SMTP receiver processes, ``receiver --name R --listen-fd L --intake-fd I [--tls-listen-fd
  T]`` (``Supervisor.receivers``).  Each start (a restart too) hands the child its
  descriptors (``pass_fds``): the listening socket the core bound (every receiver accepts
  on it and the kernel spreads the connections), the implicit-TLS one with
  ``receiver.tls_listen`` (RFC 8314), and its end of a fresh Unix socket pair whose other
  end the core serves with ``IntakeServer``: the child's queue, and the way the core sees
  it die (EOF) and abandons what it had in progress.

Every child, a restarted one too, is handed the text of the configuration the core loaded
(``config_text``) on its stdin, and ``F`` only names it: zoneq has no reload (README), so a
file edited while it runs must reach no child, or zoneq would run two configs at once (a
zone renamed in the file would leave its restarted workers refusing to start while the
core routes mail into it; a receiver restarted into a file that no longer parses would
exit again and again while the core keeps its listening socket, so clients would connect
and hear no greeting).  Paths in the config mean what they meant to the core: relative
ones are relative to the working directory, which the children inherit.  The files a
path names are still read at each start: a receiver restarted after its TLS certificate
was renewed serves the new one.  ``V`` is the level this process logs at (``zoneq
--log-level``), so a child's lines are as many as the core's.

A child that exits while zoneq is running is restarted after a delay (``Backoff``): 1 s
after a crash, doubled with each quick crash after it up to 30 s, so a child that cannot
start does not spin.  On shutdown every child gets SIGTERM (a worker finishes the jobs in
hand, a receiver answers 421 and finishes or abandons its messages), then SIGKILL after
``grace`` seconds; always by PID, and only the processes started here.  serve stops the
receivers' supervisor first.

A worker that hangs (SIGSTOP, an event loop blocked) does not exit, and its IPC connection
stays open, so its leases and connection slots would stay held for good.  With a ``Watch``
the supervisor asks the IPC server once a second when it last heard from each worker (a
live one writes at least every few seconds, ``delivery/worker.py``) and SIGKILLs one
silent for longer than ``Watch.silence``; the exit path above then returns its leases (the
connection ends) and restarts it.  A worker that has not said hello yet is still starting
(plugins loading, a loaded machine) and is given ``Watch.starting`` from its start instead.
The watch ends before the stop begins, so it never kills a worker finishing its jobs.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import sys
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("zoneq.supervisor")

# How a child is run: ``python -m zoneq <kind> ...``, with this interpreter.
ZONEQ_COMMAND = (sys.executable, "-m", "zoneq")

# Attaches the core's end of a new socket pair to the intake server, under a child's name.
Attach = Callable[[socket.socket, str], Awaitable[None]]

# When the core last heard from each connected worker: PID -> a ``time.monotonic()`` reading.
Heard = Callable[[], Mapping[int, float]]

WATCH_INTERVAL_S = 1.0


@dataclass(frozen=True)
class Watch:
    """How a hung worker is told from a live one: ``heard`` (the IPC server's), and how long
    a worker may be silent once it has said hello (``silence``) or before (``starting``,
    counted from its start), in seconds."""

    heard: Heard
    silence: float = 60.0
    starting: float = 120.0

    def overdue(self, started: float, heard: float | None, now: float) -> float | None:
        """How long a worker started at ``started`` and last heard from at ``heard`` (None:
        never) has been silent at ``now``, if that is past its allowance; else None."""
        since, allowed = (started, self.starting) if heard is None else (heard, self.silence)
        silent = now - since
        return silent if silent > allowed else None


@dataclass(frozen=True)
class Backoff:
    """How long a child that exited waits to be started again: ``first`` seconds after its
    first crash, twice the previous delay after each quick crash that follows, at most
    ``cap``; a child that ran ``stable`` seconds before it exited starts over at ``first``."""

    first: float = 1.0
    cap: float = 30.0
    stable: float = 60.0

    def after(self, previous: float, ran: float) -> float:
        """The delay before the next start of a child that ran ``ran`` seconds; ``previous``
        is the delay before the start that just ended (0.0 for the first start)."""
        if previous == 0.0 or ran >= self.stable:
            return self.first
        return min(previous * 2, self.cap)


@dataclass
class _Slot:
    kind: str  # "worker" or "receiver": the subcommand, and the word in the logs
    name: str
    args: list[str]
    process: asyncio.subprocess.Process | None = None
    delay: float = 0.0  # before the current start: none for the first one
    started: float = 0.0
    heard: float | None = None  # last heard from by the core (``Watch``), this start
    killed: bool = False  # by the watch, this start
    restarts: int = 0
    task: asyncio.Task[None] | None = field(default=None, repr=False)


@dataclass(frozen=True)
class _Sockets:
    """What each receiver process is handed."""

    listener: socket.socket
    attach: Attach
    tls_listener: socket.socket | None = None  # receiver.tls_listen

    def fd_args(self, intake_fd: int) -> tuple[tuple[int, ...], tuple[str, ...]]:
        """The descriptors a receiver inherits, and the arguments that name them."""
        fds = (self.listener.fileno(), intake_fd)
        args = ("--listen-fd", str(fds[0]), "--intake-fd", str(intake_fd))
        if self.tls_listener is None:
            return fds, args
        tls_fd = self.tls_listener.fileno()
        return (*fds, tls_fd), (*args, "--tls-listen-fd", str(tls_fd))


class Supervisor:
    def __init__(
        self,
        workers: dict[str, int],
        config_path: Path | None,
        grace: float = 30.0,
        *,
        config_text: str | None = None,
        backoff: Backoff = Backoff(),
        command: Sequence[str] = ZONEQ_COMMAND,
        watch: Watch | None = None,
    ) -> None:
        """``config_text``: the text the core loaded from ``config_path`` (the embedded
        default if None), handed to every child; without it each child reads
        ``config_path`` when it starts.  ``command`` runs zoneq.  ``watch``: kill workers
        that fall silent (none are watched without it)."""
        self._slots = [
            _Slot("worker", f"{zone}-{n}", ["--zone", zone, "--name", f"{zone}-{n}"])
            for zone, count in sorted(workers.items())
            for n in range(count)
        ]
        self._config_path = config_path
        self._config_text = None if config_text is None else config_text.encode()
        self._grace = grace
        self._backoff = backoff
        self._zoneq = tuple(command)
        self._stopping = False
        self._sockets: _Sockets | None = None
        self._liveness = watch
        self._liveness_task: asyncio.Task[None] | None = None

    @classmethod
    def receivers(
        cls,
        count: int,
        config_path: Path | None,
        *,
        listener: socket.socket,
        attach: Attach,
        tls_listener: socket.socket | None = None,
        grace: float = 30.0,
        config_text: str | None = None,
        backoff: Backoff = Backoff(),
        command: Sequence[str] = ZONEQ_COMMAND,
    ) -> Supervisor:
        """``count`` receiver processes accepting on ``listener`` (and on ``tls_listener``
        for implicit TLS), each with a socket to the core that ``attach`` serves; the rest
        as for workers."""
        supervisor = cls(
            {}, config_path, grace, config_text=config_text, backoff=backoff, command=command
        )
        supervisor._slots = [
            _Slot("receiver", f"receiver-{n}", ["--name", f"receiver-{n}"]) for n in range(count)
        ]
        supervisor._sockets = _Sockets(listener, attach, tls_listener)
        return supervisor

    def _command(self, slot: _Slot, *extra: str) -> list[str]:
        # The root logger's level is what ``zoneq --log-level`` set (logs.configure); a
        # global option, so it goes before the subcommand.
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        command = [*self._zoneq, "--log-level", level, slot.kind, *slot.args, *extra]
        if self._config_text is not None:
            command.append("--config-on-stdin")
        if self._config_path is not None:
            command += ["--config", str(self._config_path)]
        return command

    async def start(self) -> None:
        for slot in self._slots:
            await self._spawn(slot)
            slot.task = asyncio.create_task(self._watch(slot))
        if self._liveness is not None:
            self._liveness_task = asyncio.create_task(self._watch_silence(self._liveness))

    async def _spawn(self, slot: _Slot) -> None:
        if self._sockets is None:
            slot.process = await self._exec(self._command(slot))
        else:
            core_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                await self._sockets.attach(core_end, slot.name)
                fds, fd_args = self._sockets.fd_args(child_end.fileno())
                command = self._command(slot, *fd_args)
                slot.process = await self._exec(command, pass_fds=fds)
            finally:
                # The child has its copy; ours must go, or the core would never see EOF
                # when the child dies.
                child_end.close()
        slot.started = time.monotonic()
        slot.heard, slot.killed = None, False
        log.info("%s %s started (pid %d)", slot.kind, slot.name, slot.process.pid)

    async def _exec(
        self, command: list[str], pass_fds: Sequence[int] = ()
    ) -> asyncio.subprocess.Process:
        """Start ``command`` and write the config's text, if any, to its stdin, then EOF."""
        if self._config_text is None:
            return await asyncio.create_subprocess_exec(*command, pass_fds=pass_fds)
        process = await asyncio.create_subprocess_exec(
            *command, stdin=asyncio.subprocess.PIPE, pass_fds=pass_fds
        )
        assert process.stdin is not None
        process.stdin.write(self._config_text)
        # A child that died before reading it all breaks the pipe: _watch sees it exit.
        with contextlib.suppress(ConnectionError):
            await process.stdin.drain()
        process.stdin.close()
        return process

    async def _watch(self, slot: _Slot) -> None:
        while not self._stopping:
            assert slot.process is not None
            code = await slot.process.wait()
            if self._stopping:
                return
            ran = time.monotonic() - slot.started
            slot.delay = self._backoff.after(slot.delay, ran)
            log.warning(
                "%s %s (pid %d) exited with %s after %.1f s; restarting in %.3g s",
                slot.kind,
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

    async def _watch_silence(self, watch: Watch) -> None:
        """Once a second, kill the workers that have been silent too long."""
        ticked = time.monotonic()
        while not self._stopping:
            await asyncio.sleep(WATCH_INTERVAL_S)
            now = time.monotonic()
            late = now - ticked > 2 * WATCH_INTERVAL_S
            ticked = now
            if late:
                # This process was not running either (its event loop blocked, the machine
                # overloaded): what the workers sent meanwhile is still unread, so their
                # silence cannot be judged before the readers have had their turn.
                continue
            heard = watch.heard()
            for slot in self._slots:
                self._judge(slot, watch, heard, now)

    def _judge(self, slot: _Slot, watch: Watch, heard: Mapping[int, float], now: float) -> None:
        process = slot.process
        if process is None or process.returncode is not None or slot.killed:
            return
        # A connection that ended (the worker exiting) leaves its last time here.
        slot.heard = heard.get(process.pid, slot.heard)
        silent = watch.overdue(slot.started, slot.heard, now)
        if silent is None:
            return
        if slot.heard is None:
            log.warning(
                "%s %s (pid %d) has not connected %.1f s after its start: killing it",
                slot.kind,
                slot.name,
                process.pid,
                silent,
            )
        else:
            log.warning(
                "%s %s (pid %d) silent for %.1f s, hung: killing it (leases back to ready)",
                slot.kind,
                slot.name,
                process.pid,
                silent,
            )
        slot.killed = True
        with contextlib.suppress(ProcessLookupError):
            process.kill()  # by PID, a child of ours; _watch reaps and restarts it

    def pids(self) -> dict[str, int]:
        return {s.name: s.process.pid for s in self._slots if s.process is not None}

    def restarts(self) -> int:
        return sum(slot.restarts for slot in self._slots)

    async def stop(self) -> None:
        self._stopping = True
        if self._liveness_task is not None:
            # First: a worker finishing its jobs after SIGTERM must not be taken for hung.
            self._liveness_task.cancel()
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
                        "child pid %d did not stop in %.0f s: killing", process.pid, self._grace
                    )
                    with contextlib.suppress(ProcessLookupError):
                        process.kill()
            if late:
                await asyncio.wait(late, timeout=5)
        for slot in self._slots:
            if slot.task is not None:
                slot.task.cancel()
