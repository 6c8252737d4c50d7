"""The parts of tools/bench/compare.py (and accept_bench.py's Postfix set-up) that decide
what the side-by-side run reports: a phase that times out or breaks is reported, not
raised; copies at the sink are counted once per (Message-ID, recipient); the memory figure
names the core by its PID; the Postfix install holds back service starts."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import smtplib
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.smtpsink import Sink, run_smtp_sink
from tests.support.testbed import missing
from zoneq.config.loader import load_config

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tools" / "bench"))

import accept_bench  # noqa: E402
import compare  # noqa: E402

# --- a phase that runs out or breaks is reported -------------------------------------------


@contextlib.contextmanager
def silent_listener() -> Iterator[int]:
    """A server on 127.0.0.1 that accepts connections and never says a word (no greeting:
    an SMTP client waits for its 220 until its time runs out)."""
    ready = threading.Event()
    port: list[int] = []
    loop = asyncio.new_event_loop()
    held: list[asyncio.StreamWriter] = []

    async def hold(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held.append(writer)  # kept open, unanswered, until the test ends

    async def serve() -> asyncio.Server:
        server = await asyncio.start_server(hold, "127.0.0.1", 0)
        port.append(server.sockets[0].getsockname()[1])
        ready.set()
        return server

    server = loop.run_until_complete(serve())
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        assert ready.wait(5)
        yield port[0]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(5)
        server.close()
        for writer in held:
            writer.close()
        loop.run_until_complete(server.wait_closed())
        loop.close()


def test_a_silent_mta_times_the_phase_out_instead_of_raising(tmp_path: Path) -> None:
    args = compare.parse(["--sessions", "2", "--timeout", "1"])
    figure = compare.Figure("1 1 KB messages", "accepts/s", "msg/s")
    with silent_listener() as port:
        started = time.monotonic()
        try:
            run = compare.source("127.0.0.1", port, args, count=5, size=1024)
        except accept_bench.Missing as exc:
            missing(str(exc))
        took = time.monotonic() - started
    compare.rate(run, figure, "zoneq")
    assert not run.complete
    assert run.accepted == 0
    assert "timed out" in run.note
    assert 1.0 <= took < 10.0  # killed at its timeout, not left hanging
    assert figure.values == {"zoneq": None}
    assert figure.notes == ["zoneq: 0 of 5 accepted; timed out after 1 s"]


@pytest.mark.parametrize(
    ("failure", "said"),
    [
        (RuntimeError("zoneq serve not ready within 30 s\nlog..."), "RuntimeError: zoneq serve"),
        (subprocess.TimeoutExpired(["smtp-source"], 1.0), "TimeoutExpired: Command"),
        (subprocess.CalledProcessError(1, ["postfix", "start"]), "CalledProcessError: Command"),
        (ConnectionRefusedError(111, "Connection refused"), "ConnectionRefusedError: [Errno 111]"),
        (smtplib.SMTPServerDisconnected("gone"), "SMTPServerDisconnected: gone"),
    ],
)
def test_a_broken_phase_is_noted_on_its_figures(failure: Exception, said: str) -> None:
    accept = compare.Figure("w", "accepts/s", "msg/s")
    e2e = compare.Figure("w", "end to end", "msg/s", values={"postfix": 10.0})
    with compare.noted("zoneq", accept, e2e):
        raise failure
    for figure in (accept, e2e):
        assert figure.values["zoneq"] is None
        assert len(figure.notes) == 1
        assert figure.notes[0].startswith(f"zoneq: {said}")
        assert "\n" not in figure.notes[0]  # the first line only: a table note
    assert e2e.values["postfix"] == 10.0  # the other side's figure stands


def test_a_value_set_before_the_failure_stays_and_a_missing_program_ends_the_run() -> None:
    figure = compare.Figure("w", "accepts/s", "msg/s")
    with compare.noted("zoneq", figure):
        figure.values["zoneq"] = 5.0
        raise RuntimeError("after the figure")
    assert figure.values == {"zoneq": 5.0}
    with pytest.raises(accept_bench.Missing), compare.noted("zoneq", figure):
        raise accept_bench.Missing("smtp-source not found")


# --- counting at the sink ------------------------------------------------------------------


def dump(message_id: str, recipients: list[str], body_lines: int = 3) -> bytes:
    """A transaction as smtp-sink dumps it (smtp-sink(1), DUMP FILE FORMAT)."""
    fields = [
        "X-Client-Addr: 127.0.0.1",
        "X-Client-Proto: ESMTP",
        "X-Helo-Args: mx.zoneq.test",
        "X-Mail-Args: <a@src.test>",
        *(f"X-Rcpt-Args: <{r}>" for r in recipients),
        "Received: from mx.zoneq.test ([127.0.0.1])",
        "\tby smtp-sink (smtp-sink) with ESMTP id 1;",
        "\tSat, 21 Nov 2026 12:00:00 +0000 (UTC)",
        "From: a@src.test",
        f"Message-ID: {message_id}",
        "",
        *(["x" * 76] * body_lines),
        "",
    ]
    return "\n".join(fields).encode() + b"\n"


def counter_on(directory: Path) -> compare.SinkCounter:
    directory.mkdir(exist_ok=True)
    return compare.SinkCounter(Sink("127.0.0.2", 25, directory, os.getpid()))


PAIRS = st.lists(
    st.tuples(
        st.sampled_from(["<m1@src.test>", "<m2@src.test>", "<3ff0.0006.0003@vm>"]),
        st.lists(st.sampled_from(["b@ok.test", "1b@ok.test", "u7@d7.test"]), min_size=1),
    ),
    max_size=12,
)


@settings(max_examples=60, deadline=None)
@given(copies=PAIRS)
def test_each_pair_counts_once_and_every_extra_copy_is_a_duplicate(
    copies: list[tuple[str, list[str]]], tmp_path_factory: pytest.TempPathFactory
) -> None:
    counter = counter_on(tmp_path_factory.mktemp("dumps"))
    expected: Counter[tuple[str, str]] = Counter()
    for n, (message_id, recipients) in enumerate(copies):
        (counter.sink.dump_dir / f"msg.{n}").write_bytes(dump(message_id, recipients))
        expected.update((message_id, r) for r in recipients)
    assert counter.scan() == (len(expected), expected.total() - len(expected))
    assert counter.scan() == (len(expected), expected.total() - len(expected))  # read once


def test_a_dump_still_being_written_is_left_for_the_next_scan(tmp_path: Path) -> None:
    counter = counter_on(tmp_path / "dumps")
    whole = dump("<m@src.test>", ["b@ok.test", "c@ok.test"])
    path = counter.sink.dump_dir / "msg.1"
    path.write_bytes(whole[:-1])  # smtp-sink ends a dump with an empty line
    assert counter.scan() == (0, 0)
    assert counter.wait(1, time.monotonic() + 0.3) is None
    path.write_bytes(whole)
    assert counter.wait(2, time.monotonic() + 5) is not None
    assert counter.scan() == (2, 0)
    counter.clear()
    assert counter.scan() == (0, 0)
    assert not list(counter.sink.dump_dir.glob("msg.*"))


def test_a_big_copy_is_counted_from_its_head(tmp_path: Path) -> None:
    counter = counter_on(tmp_path / "dumps")
    lines = (compare.HEAD_BYTES // 77) * 3  # three heads' worth of body
    (counter.sink.dump_dir / "msg.1").write_bytes(dump("<huge@src.test>", ["big@ok.test"], lines))
    assert counter.scan() == (1, 0)
    assert counter.copies == Counter({("<huge@src.test>", "big@ok.test"): 1})


def test_smtp_sink_copies_of_one_message_sent_twice_are_one_delivery_and_one_duplicate(
    tmp_path: Path,
) -> None:
    body = b"From: a@src.test\r\nMessage-ID: <twice@src.test>\r\n\r\nhello\r\n"
    with run_smtp_sink() as sink:
        counter = compare.SinkCounter(sink)
        for _ in range(2):
            with smtplib.SMTP(sink.host, sink.port, timeout=10) as client:
                client.sendmail("a@src.test", ["b@ok.test", "c@ok.test"], body)
        assert counter.wait(2, time.monotonic() + 10) is not None
        deadline = time.monotonic() + 10
        while counter.scan() != (2, 2) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert counter.scan() == (2, 2)


# --- what the figures say about the run ----------------------------------------------------


@pytest.mark.parametrize(
    ("peak", "core", "expected"),
    [
        # The core is not always the lowest PID: PIDs wrap around.
        ({900: 50_000, 120: 40_000, 130: 41_000}, 900, ["core", "worker 1", "worker 2"]),
        ({100: 70_000, 200: 40_000}, 100, ["core", "worker 1"]),
        ({200: 40_000, 300: 41_000}, 100, ["worker 1", "worker 2"]),  # the core not sampled
        ({}, 100, []),
        ({5: 1}, None, ["worker 1"]),  # Postfix: no core given
    ],
)
def test_the_core_is_named_by_its_pid(
    peak: dict[int, int], core: int | None, expected: list[str]
) -> None:
    named = compare.roles(peak, core)
    assert [role for role, _ in named] == expected
    if core in peak:
        assert named[0] == ("core", peak[core])
    assert sorted(kib for _, kib in named) == sorted(peak.values())


def test_file_systems_come_from_the_mount_table(tmp_path: Path) -> None:
    assert compare.file_system(Path("/proc/self/status")) == "proc"
    assert compare.file_system(tmp_path / "not" / "yet") == compare.file_system(tmp_path)
    expected = subprocess.run(
        ["findmnt", "-n", "-o", "FSTYPE", "--target", str(tmp_path)],
        capture_output=True,
        text=True,
        check=False,
    )
    if expected.returncode == 0:  # util-linux's own answer, where it is installed
        assert compare.file_system(tmp_path) == expected.stdout.split()[-1]


def test_zoneq_delivers_as_wide_as_postfix(tmp_path: Path) -> None:
    from tests.reliability.bed import mail_bed

    args = compare.parse(["--processes", "2", "--connections", "10"])
    with mail_bed(tmp_path) as bed:
        config = load_config(compare.zoneq_config(bed, args))
    assert config.zones["default"].processes == 2
    assert config.zones["default"].connections == 10
    assert config.delivery.domain_connections == compare.concurrency(args) == 20
    assert config.storage.sync_commits  # the 250 waits for the sync, as Postfix's does


@pytest.mark.parametrize("option", ["--processes", "--connections", "--sessions", "--messages"])
def test_counts_below_one_are_refused(option: str) -> None:
    with pytest.raises(SystemExit):
        compare.parse([option, "0"])


# --- installing Postfix starts no system Postfix -------------------------------------------


def test_the_install_forbids_service_starts_and_cleans_up(tmp_path: Path) -> None:
    policy = tmp_path / "policy-rc.d"
    with accept_bench.services_held(policy):
        assert os.access(policy, os.X_OK)
        ran = subprocess.run([str(policy), "postfix", "start"], check=False, timeout=10)
        assert ran.returncode == 101  # invoke-rc.d(8): "action forbidden by policy"
    assert not policy.exists()
    with pytest.raises(RuntimeError), accept_bench.services_held(policy):
        assert policy.exists()
        raise RuntimeError("apt-get failed")
    assert not policy.exists()


def test_a_policy_of_the_machine_is_left_alone(tmp_path: Path) -> None:
    policy = tmp_path / "policy-rc.d"
    policy.write_text("#!/bin/sh\nexit 0\n")
    with accept_bench.services_held(policy):
        assert policy.read_text() == "#!/bin/sh\nexit 0\n"
    assert policy.read_text() == "#!/bin/sh\nexit 0\n"


@pytest.mark.parametrize(
    "content",
    [None, "", "garbage\n", f"{os.getpid()}\n", "4194304999\n"],
    ids=["no file", "empty", "garbage", "a pid that is not master", "a stale pid"],
)
def test_only_a_running_postfix_master_is_reported(tmp_path: Path, content: str | None) -> None:
    pid_file = tmp_path / "master.pid"
    if content is not None:
        pid_file.write_text(f"{content:>11}")  # Postfix right-aligns the PID
    assert accept_bench.system_postfix_master(pid_file) is None


def test_a_running_postfix_master_is_found_by_its_pid_file(tmp_path: Path) -> None:
    if not os.access(accept_bench.POSTFIX, os.X_OK) or os.geteuid() != 0:
        pytest.skip("needs Debian's postfix, and root")
    directory = Path(tempfile.mkdtemp(prefix="zoneq-master-"))
    directory.chmod(0o755)  # Postfix's own users enter its spool
    config_dir = accept_bench.setup_postfix(directory, accept_bench.free_port())
    master: int | None = None
    try:
        master = accept_bench.start_postfix(config_dir)
        assert master is not None
        pid_file = directory / "spool" / "pid" / "master.pid"
        assert accept_bench.system_postfix_master(pid_file) == master
    finally:
        accept_bench.stop_postfix(config_dir, master)
        shutil.rmtree(directory, ignore_errors=True)
