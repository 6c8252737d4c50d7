"""The supervisor (``zoneq/supervisor.py``): its restart back-off, the config text and the
log level it hands each worker and receiver process, and, with a real ``zoneq serve``, that
a restarted worker or receiver runs the config the core loaded at start, not the file as
edited since (there is no reload).

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
import smtplib
import socket
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import pytest

from tests.receiver.processes import start_receiver_serve
from tests.receiver.test_processes import wait_until
from tests.storage.conftest import async_test
from tests.support.serve import running_serve, smtp_port, write_serve_config
from zoneq.cli import _child_config, build_parser
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


Started = Callable[[Sequence[str], str, list[socket.socket]], Supervisor]


def one_worker(command: Sequence[str], text: str, _: list[socket.socket]) -> Supervisor:
    return Supervisor({"z": 1}, None, 5, config_text=text, backoff=FAST, command=command)


def one_receiver(command: Sequence[str], text: str, held: list[socket.socket]) -> Supervisor:
    """A receiver supervisor whose sockets (the listener, the core's ends) go to ``held``."""
    listener = socket.create_server(("127.0.0.1", 0))
    held.append(listener)

    async def attach(core_end: socket.socket, name: str) -> None:
        held.append(core_end)

    return Supervisor.receivers(
        1,
        None,
        listener=listener,
        attach=attach,
        grace=5,
        config_text=text,
        backoff=FAST,
        command=command,
    )


@pytest.mark.parametrize(
    ("started", "arguments"),
    [
        (one_worker, r"worker --zone z --name z-0 --config-on-stdin"),
        (
            one_receiver,
            r"receiver --name receiver-0 --listen-fd \d+ --intake-fd \d+ --config-on-stdin",
        ),
    ],
    ids=["worker", "receiver"],
)
@pytest.mark.parametrize("level", ["DEBUG", "ERROR"])
@async_test
async def test_each_start_hands_the_child_the_config_text_and_the_log_level(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, started: Started, arguments: str, level: str
) -> None:
    """The same text on a restart, followed by EOF: the child's ``cat`` returns, then it
    notes its arguments: ``--log-level`` first (zoneq's global option: before the
    subcommand) with the level this process logs at."""
    caplog.set_level(level)  # the root logger's, as ``zoneq --log-level`` sets it
    given = "# the text the core loaded\n"
    copies = tmp_path / "copies"
    args = tmp_path / "copies.args"
    copy_stdin = 'cat >> "$0"; echo "$@" >> "$0.args"; exit 3'
    held: list[socket.socket] = []
    supervisor = started(("/bin/sh", "-c", copy_stdin, str(copies)), given, held)
    await supervisor.start()
    try:
        deadline = time.monotonic() + 10
        while len(noted(args)) < 2:  # a start and a restart
            assert time.monotonic() < deadline, noted(args)
            await asyncio.sleep(0.02)
    finally:
        await supervisor.stop()
        for held_socket in held:
            held_socket.close()
    assert copies.read_text().startswith(given * 2)
    for line in noted(args):
        assert re.fullmatch(f"--log-level {level} {arguments}", line), line


def noted(path: Path) -> list[str]:
    return path.read_text().splitlines() if path.exists() else []


# --- the child's side: zoneq worker|receiver --config-on-stdin --------------------------

CHILDREN = [
    ["worker", "--zone", "default", "--name", "default-0"],
    ["receiver", "--name", "receiver-0", "--listen-fd", "3", "--intake-fd", "4"],
]


def child_config(
    monkeypatch: pytest.MonkeyPatch, child: list[str], stdin: str, *args: str
) -> Config:
    monkeypatch.setattr(sys, "stdin", io.TextIOWrapper(io.BytesIO(stdin.encode())))
    parsed = build_parser(internal_only=True).parse_args([*child, "--config-on-stdin", *args])
    return _child_config(parsed)


@pytest.mark.parametrize("child", CHILDREN, ids=lambda child: child[0])
def test_a_child_runs_the_text_on_its_stdin_not_the_file_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, child: list[str]
) -> None:
    served = default_config_text()
    assert child_config(monkeypatch, child, served) == load_config(None)  # no --config
    edited = tmp_path / "zones.toml"
    edited.write_text(served.replace("[zones.default]", "[zones.renamed]"))
    assert "default" in child_config(monkeypatch, child, served, "--config", str(edited)).zones
    with pytest.raises(ConfigError, match=re.escape(f"{edited}: invalid TOML")):
        child_config(monkeypatch, child, "[server", "--config", str(edited))  # the file's name


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


def advertised_size(port: int) -> str:
    """The SIZE (RFC 1870) the receiver on 127.0.0.1:``port`` offers after its greeting."""
    with smtplib.SMTP("127.0.0.1", port, timeout=10) as smtp:
        code, _ = smtp.ehlo("client.test")
        assert code == 250
        return smtp.esmtp_features["size"]


@pytest.mark.integration
def test_a_restarted_receiver_process_serves_the_config_serve_loaded_not_a_broken_file(
    tmp_path: Path,
) -> None:
    """``receiver.processes = 1`` and the file made invalid TOML while serve runs: the
    receiver killed and restarted comes back and serves as before, its SIZE the loaded
    one.  It used to read the file and exit 2 at every restart while the core kept the
    listening socket: clients connected and heard no greeting."""
    config = write_serve_config(tmp_path / "zoneq", mx_port=25, dns_port=53)  # no delivery
    receiver = '[receiver]\nprocesses = 1\nmax_message_size = "1MiB"\n'
    config.write_text(config.read_text().replace("[receiver]\n", receiver))
    port = smtp_port(config)  # read now: the file will not parse
    serve = start_receiver_serve(config, tmp_path / "serve.log")
    try:
        serve.wait_ready(3)  # a worker for each of the two zones, and the receiver
        assert advertised_size(port) == str(1 << 20)
        (first,) = serve.receivers()
        config.write_text(config.read_text().replace("[receiver]", "[receiver"))
        os.kill(first, signal.SIGKILL)  # the receiver of this serve's, by PID
        wait_until("a receiver is back", lambda: bool(set(serve.receivers()) - {first}))
        assert advertised_size(port) == str(1 << 20)
        log = serve.log_text()
    finally:
        serve.cleanup()
    assert "configuration error" not in log
