"""A full disk under ``zoneq serve``: 4xx to clients, delivery goes on, healing by itself.

The queue lives on a small tmpfs (root only, as ``tests/storage/test_full_disk.py``) with a
free-space floor (``storage.min_free``) and a recovery reserve (``storage.reserve``).  Mail
is queued faster than smtp-sink (one second per final dot) takes it, then something else
fills the file system to the last block.  While it is full, clients must get 4xx (452 from
the floor, or 451 when LevelDB itself hits ENOSPC), never 5xx; deliveries of what was
queued must go on (a delivery's delete is a write too: the reserve is given back so the
store can reopen and write it).  Once the space is freed, new mail must be accepted again
with no restart, and every acknowledged message delivered.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.reliability.bed import WORKERS, QueueState, inspect_queue, mail_bed
from tests.support.ledger import (
    Audit,
    Dumps,
    Ledger,
    Load,
    audit,
    logged_duplicates,
    send_for,
    wait_settled,
)
from tests.support.serve import smtp_port, start_serve
from tests.support.tmpfs import mounted_tmpfs

pytestmark = pytest.mark.integration

TMPFS_SIZE = "48m"
# The floor above the reserve: once the reserve is given back (a write hit ENOSPC), new mail
# still waits (452) while deliveries use the room.
STORAGE = {"min_free": '"10MiB"', "reserve": '"8MiB"'}
RECIPIENTS = ("r1@ok.test", "r2@ok.test")


@contextlib.contextmanager
def filled(mount_point: Path) -> Iterator[Path]:
    """A file taking every free block of the file system; removed on the way out."""
    filler = mount_point / "filler"
    stat = os.statvfs(mount_point)
    fd = os.open(filler, os.O_WRONLY | os.O_CREAT, 0o600)
    try:
        os.posix_fallocate(fd, 0, stat.f_bavail * stat.f_frsize)
    finally:
        os.close(fd)
    try:
        yield filler
    finally:
        with contextlib.suppress(FileNotFoundError):
            filler.unlink()


async def phases(
    port: int, ledger: Ledger, disk: Path, dumps_now: Callable[[], int]
) -> dict[str, int]:
    """Queue, fill the disk, send on, free it, send on; figures for each phase."""
    figures: dict[str, int] = {}
    load = Load(RECIPIENTS, sizes=(2_000, 20_000), pause=0.1)
    figures["queued"] = await send_for(port, ledger, "before", load, 1.5, clients=2)
    with filled(disk):
        delivered_at_full = dumps_now()
        refusals = len(ledger.refusals)
        figures["while_full"] = await send_for(port, ledger, "full", load, 3.0, clients=2)
        figures["refused_while_full"] = len(ledger.refusals) - refusals
        figures["delivered_while_full"] = dumps_now() - delivered_at_full
    await asyncio.sleep(2.5)  # the floor is re-read once a second; a reopen likewise
    figures["after"] = await send_for(port, ledger, "after", load, 2.0, clients=2)
    return figures


@dataclass
class Run:
    ledger: Ledger
    figures: dict[str, int]
    running: bool
    exit_code: int | None  # of the core, on SIGTERM after the fault
    settled: bool
    audit: Audit
    logged: Counter[tuple[str, str]]
    state: QueueState


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The scenario, once for the module's checks."""
    tmp_path = tmp_path_factory.mktemp("diskfull")
    ledger = Ledger()
    dumps = Dumps()
    logs = [tmp_path / "serve.log"]
    for disk in mounted_tmpfs(tmp_path / "disk", TMPFS_SIZE):
        with mail_bed(tmp_path, "-W", ".:1") as bed:
            config = bed.config(connections=4, storage=STORAGE, data_dir=disk / "queue")

            def dumps_now() -> int:
                return dumps.scan(bed.sink)[0]

            serve = start_serve(config, logs[0])
            try:
                serve.wait_ready(expected_workers=WORKERS)
                figures = asyncio.run(phases(smtp_port(config), ledger, disk, dumps_now))
                settled = wait_settled(bed.sink, dumps, ledger.expected(), timeout=90.0)
                running = serve.running()
                serve.terminate()
                exit_code = serve.process.returncode
            finally:
                serve.cleanup()
            dumps.scan(bed.sink)
        state = inspect_queue(config)
    result = Run(
        ledger,
        figures,
        running,
        exit_code,
        settled,
        audit(ledger, dumps),
        logged_duplicates(logs),
        state,
    )
    replies = sorted({r.split(": ", 1)[1][:44] for r in ledger.refusals})
    print(
        f"\nfull disk: {figures}; {len(ledger.refusals)} refused 4xx ({replies}); "
        f"{result.audit.summary()}; {sum(result.logged.values())} possible duplicate(s) logged"
    )
    return result


def test_clients_get_4xx_never_5xx_while_the_disk_is_full(run: Run) -> None:
    assert run.running, "zoneq serve died of the full disk"
    assert run.figures["refused_while_full"] > 0, "the full disk was never seen by a client"
    assert not run.ledger.refused_5xx, run.ledger.refused_5xx[:5]


def test_delivery_of_what_is_queued_goes_on_while_the_disk_is_full(run: Run) -> None:
    assert run.figures["delivered_while_full"] > 0


def test_mail_is_accepted_again_once_space_is_back_without_a_restart(run: Run) -> None:
    assert run.running
    assert run.figures["after"] > 0


def test_no_acknowledged_message_is_lost_or_damaged(run: Run) -> None:
    assert run.settled, run.audit.problems()
    assert not run.audit.problems(), run.audit.problems()
    assert run.state.messages == 0, run.state.counters
    assert run.state.counters == run.state.recount


def test_extra_copies_only_where_a_possible_duplicate_was_logged(run: Run) -> None:
    assert not run.audit.unexplained_duplicates(run.logged), run.audit.duplicates


def test_serve_still_stops_cleanly_after_the_disk_was_full(run: Run) -> None:
    assert run.exit_code == 0
