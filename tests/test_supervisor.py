"""The supervisor (``zoneq/supervisor.py``): its restart back-off, the config text it hands
each worker, and, with a real ``zoneq serve``, that a restarted worker runs the config the
core loaded at start, not the file as edited since (there is no reload).

The unit tests run the real ``Supervisor`` on ``/bin/sh`` children (``command``), so they
take a fraction of a second: each child notes its start, or copies its stdin, and exits.
"""

from __future__ import annotations

import asyncio
import io
import itertools
import os
import re
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.storage.conftest import async_test
from tests.support.serve import running_serve, write_serve_config
from zoneq.cli import _worker_config, build_parser
from zoneq.config import Config, default_config_text, load_config
from zoneq.errors import ConfigError
from zoneq.supervisor import Backoff, Supervisor

DEFAULT = Backoff()


@pytest.mark.parametrize(
    ("previous", "ran", "delay"),
    [
        (0.0, 0.0, 1.0),  # the first crash: 1 s, not twice that
        (1.0, 0.1, 2.0),  # each quick crash after it doubles the delay
        (2.0, 0.1, 4.0),
        (16.0, 59.9, 30.0),  # up to the cap
        (30.0, 0.1, 30.0),  # and no further
        (30.0, 60.0, 1.0),  # a child that ran a minute starts over
        (0.0, 3600.0, 1.0),
    ],
)
def test_the_delay_before_a_restart(previous: float, ran: float, delay: float) -> None:
    assert DEFAULT.after(previous, ran) == delay


# A child that notes when it started ($0 is the file, the supervisor's arguments follow).
NOTE_START = 'date +%s.%N >> "$0"; exit 3'
FAST = Backoff(first=0.02, cap=0.08, stable=60.0)
WINDOW_S = 2.0
RESTARTING = re.compile(r"restarting in ([0-9.e+-]+) s$")


def expected_delays(count: int) -> list[float]:
    return [min(FAST.first * 2**n, FAST.cap) for n in range(count)]


async def supervise(supervisor: Supervisor, seconds: float) -> None:
    await supervisor.start()
    try:
        await asyncio.sleep(seconds)
    finally:
        await supervisor.stop()


@async_test
async def test_a_child_that_exits_at_once_is_restarted_with_growing_capped_delays(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The delays chosen are the ones logged; the times the children noted only bound them
    from below (a loaded machine may start a child late, never early)."""
    starts = tmp_path / "starts"
    command = ("/bin/sh", "-c", NOTE_START, str(starts))
    supervisor = Supervisor({"z": 1}, None, grace=5, backoff=FAST, command=command)
    with caplog.at_level("WARNING", logger="zoneq.supervisor"):
        await supervise(supervisor, WINDOW_S)
    logged = [
        float(found.group(1))
        for record in caplog.records
        if (found := RESTARTING.search(record.getMessage()))
    ]
    times = [float(line) for line in starts.read_text().split()]
    gaps = [later - earlier for earlier, later in itertools.pairwise(times)]
    # With no delay it would be hundreds of starts in the window; with these, no more than
    # the restarts whose delays add up to less than the window.
    fit = sum(1 for n in range(1, 100) if sum(expected_delays(n)) <= WINDOW_S)
    assert 4 <= len(gaps) <= fit, gaps
    assert logged[: len(gaps)] == pytest.approx(expected_delays(len(gaps))), logged
    for gap, delay in zip(gaps, logged, strict=False):
        assert gap >= delay, (gaps, logged)


@async_test
async def test_each_start_hands_the_child_the_config_text_on_stdin(tmp_path: Path) -> None:
    """The same text on a restart, followed by EOF: the child's ``cat`` returns, then it
    notes its arguments."""
    given = "# the text the core loaded\n"
    copies = tmp_path / "copies"
    args = tmp_path / "copies.args"
    copy_stdin = 'cat >> "$0"; echo "$@" >> "$0.args"; exit 3'
    command = ("/bin/sh", "-c", copy_stdin, str(copies))
    supervisor = Supervisor({"z": 1}, None, 5, config_text=given, backoff=FAST, command=command)
    await supervisor.start()
    try:
        deadline = time.monotonic() + 10
        while len(noted(args)) < 2:  # a start and a restart
            assert time.monotonic() < deadline, noted(args)
            await asyncio.sleep(0.02)
    finally:
        await supervisor.stop()
    assert copies.read_text().startswith(given * 2)
    assert set(noted(args)) == {"worker --zone z --name z-0 --config-on-stdin"}


def noted(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


# --- the child's side: zoneq worker --config-on-stdin -----------------------------------


def child_config(monkeypatch: pytest.MonkeyPatch, stdin: str, *args: str) -> Config:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin.encode())))
    parsed = build_parser(internal_only=True).parse_args(
        ["worker", "--zone", "default", "--name", "default-0", "--config-on-stdin", *args]
    )
    return _worker_config(parsed)


def test_a_child_runs_the_text_on_its_stdin_not_the_file_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    served = default_config_text()
    assert child_config(monkeypatch, served) == load_config(None)  # serve with no --config
    edited = tmp_path / "zones.toml"
    edited.write_text(served.replace("[zones.default]", "[zones.renamed]"))
    assert "default" in child_config(monkeypatch, served, "--config", str(edited)).zones
    with pytest.raises(ConfigError, match=re.escape(f"{edited}: invalid TOML")):
        child_config(monkeypatch, "[server", "--config", str(edited))  # named after the file


# --- with a real zoneq serve ----------------------------------------------------------


def connected_workers(log: str, zone: str) -> list[int]:
    """PIDs of the workers of ``zone`` whose hello the core has logged, in order."""
    return [int(p) for p in re.findall(rf"worker pid (\d+) of zone {zone} connected", log)]


@pytest.mark.integration
def test_a_restarted_worker_runs_the_config_serve_loaded_not_the_edited_file(
    tmp_path: Path,
) -> None:
    """The zone renamed in the file while serve runs: a worker of the zone killed and
    restarted comes back and serves it (it used to read the edited file and refuse to
    start, for ever, while the core kept routing mail into the zone)."""
    config = write_serve_config(tmp_path / "zoneq", mx_port=25, dns_port=53)  # no delivery
    with running_serve(config, tmp_path / "serve.log") as serve:
        (first,) = connected_workers(serve.log_text(), "default")
        edited = config.read_text().replace("[zones.default]", "[zones.renamed]")
        config.write_text(f'{edited}\n[routing]\ndefault_zone = "renamed"\n')
        os.kill(first, signal.SIGKILL)  # a worker of this serve's, by PID
        deadline = time.monotonic() + 20
        while len(connected_workers(serve.log_text(), "default")) < 2:
            assert time.monotonic() < deadline, serve.log_tail()
            assert serve.running(), serve.log_tail()
            time.sleep(0.1)
        log = serve.log_text()
    assert "no zone 'default'" not in log
    assert "configuration error" not in log
