"""A hung zone worker with a real ``zoneq serve``: killed after its silence, its lease back.

A worker stopped with SIGSTOP (or whose event loop is blocked) sends nothing on its IPC
connection, and that connection stays open: without a watchdog it would keep its leases,
and its connection slots, until it exits, which it never does.  The supervisor kills a
worker the core has not heard from for ``WORKER_SILENCE_S``; the existing exit path then
returns its leases and starts a new worker, which delivers the mail.

The core runs with a short silence (``zoneq.runtime.WORKER_SILENCE_S`` set before
``serve`` starts, in the core only: the workers are started as usual).  smtp-sink holds
its reply to DATA for a few seconds, so the worker is stopped while it holds the lease and
before it has sent the body: the message must then arrive exactly once.
"""

from __future__ import annotations

import asyncio
import os
import re
import signal
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from tests.delivery.test_serve_process import data_dir, dumps, inspect, queue_small, serve_bed
from tests.support.serve import Serve, alive, start_serve, start_time
from tests.support.smtpsink import Sink

pytestmark = pytest.mark.integration

SILENCE_S = 8.0  # the core's deadline here; a live worker is heard from every 2 s
DATA_HOLD_S = "4"  # smtp-sink waits this long before its 354 (``-w``)
TIMEOUT_S = 40.0

# ``zoneq serve`` with a short deadline: the constant is read when serve builds its
# supervisor, so setting it before ``main`` runs is enough.
_SERVE_WITH_SHORT_SILENCE = (
    "import sys\n"
    "import zoneq.runtime\n"
    f"zoneq.runtime.WORKER_SILENCE_S = {SILENCE_S}\n"
    "from zoneq.cli import main\n"
    "sys.exit(main(sys.argv[1:]))\n"
)


def start_serve_with_short_silence(config: Path, log: Path) -> Serve:
    return start_serve(config, log, python_args=("-c", _SERVE_WITH_SHORT_SILENCE))


def zone_worker(serve: Serve, zone: str) -> int:
    """The PID of the zone's (only) worker, from its command line."""
    for pid in serve.workers():
        with open(f"/proc/{pid}/cmdline", "rb") as cmdline:
            if f"\0--zone\0{zone}\0".encode() in cmdline.read():
                return pid
    raise AssertionError(f"no worker of zone {zone} among {serve.workers()}")


def socket_inodes(pid: int) -> set[str]:
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        try:
            target = os.readlink(fd)
        except OSError:
            continue  # closed meanwhile
        if target.startswith("socket:["):
            inodes.add(target[len("socket:[") : -1])
    return inodes


def connected_to(pid: int, sink: Sink) -> bool:
    """Whether ``pid`` has an established TCP connection to the sink (/proc/net/tcp)."""
    mine = socket_inodes(pid)
    for line in Path(f"/proc/{pid}/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        remote_port = int(fields[2].rpartition(":")[2], 16)
        if remote_port == sink.port and fields[3] == "01" and fields[9] in mine:
            return True
    return False


def wait_until(condition: Callable[[], bool], what: str, timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"not within {timeout} s: {what}")
        time.sleep(0.02)


def test_a_stopped_worker_is_killed_and_its_lease_delivered_by_its_replacement(
    tmp_path: Path,
) -> None:
    with serve_bed(tmp_path, "-w", DATA_HOLD_S) as bed:
        config = bed.config(connections=2)
        (message_id,) = asyncio.run(queue_small(data_dir(config), 1))
        serve = start_serve_with_short_silence(config, tmp_path / "serve.log")
        hung: tuple[int, int | None] | None = None
        try:
            serve.wait_ready(expected_workers=2)
            worker = zone_worker(serve, "default")
            ticks = start_time(worker)
            # The worker leased the message and is talking to the MX, which holds its 354:
            # the body has not been sent.
            wait_until(lambda: connected_to(worker, bed.sink), "the worker connects to the MX")
            os.kill(worker, signal.SIGSTOP)
            hung = (worker, ticks)
            stopped = time.monotonic()
            wait_until(lambda: message_id in dumps(bed.sink)[0], "the message is delivered")
            delivered_s = time.monotonic() - stopped
            time.sleep(2.0)  # a second copy would be on its way by now
            ids, partial = dumps(bed.sink)
            replacement = zone_worker(serve, "default")
            log = serve.log_text()
            serve.terminate()
        finally:
            if hung is not None and alive(*hung):
                os.kill(hung[0], signal.SIGCONT)  # let it stop with the rest on SIGTERM
            serve.cleanup()
        state = asyncio.run(inspect(data_dir(config)))

    print(f"\nstopped worker {worker}: delivered by {replacement} {delivered_s:.1f} s later")
    assert delivered_s >= SILENCE_S - 1.0  # not before the deadline (1 s of tick slack)
    assert ids == [message_id], (ids, partial)  # once, by the replacement
    assert start_time(worker) != ticks  # the stopped worker is gone, reaped
    assert replacement != worker
    warning = rf"worker default-0 \(pid {worker}\) silent for [0-9.]+ s"
    assert re.search(warning, log), log
    assert state.messages == 0, state.counters
    assert state.counters == state.recount
