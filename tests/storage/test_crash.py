"""Crash consistency of the queue store on a real LevelDB directory.

The requirement: a process killed with SIGKILL between any two writes leaves, after reopen and
sweep, either the whole committed message or no trace of it.

``crash_child.py`` runs a seeded workload (concurrent receiving sessions, abandons, holds,
deliveries, deferrals) and kills itself right after its N-th ``Database.write``; the parent
does that for every N (sampled evenly when there are more than the budget allows, always
with the first and last boundaries), and also kills children at random wall-clock moments
(which lands inside LevelDB writes and fsyncs as well).  After each kill the parent opens
the directory with a fresh store, ``recover()`` s it (which sweeps orphans) and checks,
against the child's fsynced ledger:

1. every message whose ``commit()`` returned is whole: head, metadata, every chunk byte for
   byte, and every recipient still queued in exactly one state unless ``complete()`` was
   called for it;
2. no trace of anything that did not commit: no chunk, marker, head, metadata, record, due
   entry or event for an id that was never passed to ``commit()``; a commit in flight at
   the kill is either whole or absent, never partial;
3. the persisted counters equal a full recount;
4. the store accepts and commits a new message afterwards.

``ZONEQ_LONG_TESTS=1`` runs every boundary of several seeds and many more random kills.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import msgpack
import pytest

from tests.storage.crash_child import CHUNK_SIZE, Ledger, body_for, now_ms
from zoneq.protocol.events import Event, EventKind
from zoneq.protocol.ids import format_id, parse_id
from zoneq.storage import keys
from zoneq.storage.records import MessageMeta, Recipient, decode_head
from zoneq.storage.store import QueueStore, new_recipients

pytestmark = pytest.mark.integration

CHILD = Path(__file__).with_name("crash_child.py")
REPO = Path(__file__).resolve().parents[2]
LONG = os.environ.get("ZONEQ_LONG_TESTS") == "1"

CHILD_TIMEOUT_S = 60.0
# Kill points: all of them up to this many, else the first and last EDGE plus an even sample.
MAX_BOUNDARIES = 100_000 if LONG else 150
EDGE = 12
SEEDS = (1, 2, 3, 4) if LONG else (1,)
RANDOM_KILLS = 150 if LONG else 50
# Wall-clock budgets: stop taking new kill points once spent (the count is reported).
BOUNDARY_BUDGET_S = 3_600.0 if LONG else 45.0
RANDOM_BUDGET_S = 1_200.0 if LONG else 25.0
WORKLOAD = ("--sessions", "6" if LONG else "4", "--messages", "10" if LONG else "8")


# --- running the child ------------------------------------------------------------------


@dataclass
class ChildRun:
    returncode: int
    stderr: str
    elapsed_s: float


def run_child(
    directory: Path,
    ledger: Path,
    *args: str,
    kill_after_s: float | None = None,
    from_ready: bool = False,
) -> ChildRun:
    """Run the child to its end, or SIGKILL it by PID ``kill_after_s`` after its start (or,
    with ``from_ready``, after it logged that its store is recovered); always reap it."""
    command = [sys.executable, str(CHILD), str(directory), str(ledger), *args]
    offset = ledger.stat().st_size if ledger.exists() else 0
    started = time.monotonic()
    proc = subprocess.Popen(
        command, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True
    )
    try:
        if kill_after_s is not None:
            if from_ready:
                wait_for_ready(proc, ledger, offset)
            try:
                proc.wait(timeout=kill_after_s)
            except subprocess.TimeoutExpired:
                os.kill(proc.pid, signal.SIGKILL)
        try:
            _, stderr = proc.communicate(timeout=CHILD_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate(timeout=10)
            pytest.fail(f"crash child {' '.join(command)} hung for {CHILD_TIMEOUT_S} s")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(timeout=10)
    return ChildRun(proc.returncode, stderr, time.monotonic() - started)


def wait_for_ready(proc: subprocess.Popen[str], ledger: Path, offset: int) -> None:
    """Poll the ledger (bounded) until the child has recovered its store or has exited."""
    give_up = time.monotonic() + CHILD_TIMEOUT_S
    while time.monotonic() < give_up and proc.poll() is None:
        if ledger.exists():
            with ledger.open("rb") as file:
                file.seek(offset)
                if b'"t":"ready"' in file.read():
                    return
        time.sleep(0.001)


def workload_seconds(ledger: Path) -> float:
    """How long a finished child's workload took, from its ``ready`` to its ``end``."""
    lines = [json.loads(line) for line in ledger.read_bytes().splitlines()]
    at = {line["t"]: line["at"] for line in lines if line["t"] in ("ready", "end")}
    return float(at["end"] - at["ready"])


def expect_killed(run: ChildRun, what: str) -> None:
    if run.returncode != -signal.SIGKILL:
        pytest.fail(f"{what}: child exited with {run.returncode}, not SIGKILL:\n{run.stderr}")


# --- the ledger -------------------------------------------------------------------------


@dataclass
class Expected:
    """What the child did with one message id, as far as its ledger says."""

    msg_id: int
    length: int
    chunks: int
    rcpts: list[tuple[str, str]]  # (address, zone), in commit order
    committed: bool = False  # commit() returned
    completing: set[tuple[str, str]] = field(default_factory=set)  # (zone, address)
    completed: set[tuple[str, str]] = field(default_factory=set)


@dataclass
class LedgerView:
    messages: dict[int, Expected] = field(default_factory=dict)
    abandoned: set[int] = field(default_factory=set)
    ends: list[int] = field(default_factory=list)  # writes made by children that ran to the end


def drop_partial_line(path: Path) -> None:
    """Cut a line the previous child was killed in the middle of, before the next appends.

    The line was an acknowledgement that never completed, so it is rightly not counted; left
    in place, the next child's first line would be glued to it and the ledger unreadable.
    """
    if not path.exists():
        return
    data = path.read_bytes()
    if data and not data.endswith(b"\n"):
        with path.open("r+b") as file:
            file.truncate(data.rfind(b"\n") + 1)


def read_ledger(path: Path) -> LedgerView:
    view = LedgerView()
    if not path.exists():
        return view
    data = path.read_bytes()
    # A kill can only cut the very last line (each line is one write); ignore a partial one.
    for line in data.split(b"\n")[:-1]:
        entry = json.loads(line)
        kind = entry["t"]
        if kind == "P":
            msg_id = parse_id(entry["id"])
            assert msg_id not in view.messages, f"id {entry['id']} committed twice (id reuse)"
            rcpts = [(address, zone) for address, zone in entry["rcpts"]]
            view.messages[msg_id] = Expected(msg_id, entry["len"], entry["chunks"], rcpts)
        elif kind == "C":
            view.messages[parse_id(entry["id"])].committed = True
        elif kind in ("X", "D"):
            expected = view.messages[parse_id(entry["id"])]
            where = (entry["zone"], entry["rcpt"])
            (expected.completing if kind == "X" else expected.completed).add(where)
        elif kind == "A":
            view.abandoned.add(parse_id(entry["id"]))
        elif kind == "end":
            view.ends.append(entry["writes"])
    return view


# --- what is on disk --------------------------------------------------------------------


@dataclass
class Disk:
    """Every key of the database, sorted by message id and family."""

    heads: dict[int, bytes] = field(default_factory=dict)
    metas: dict[int, bytes] = field(default_factory=dict)
    chunks: dict[int, dict[int, bytes]] = field(default_factory=dict)
    receiving: set[int] = field(default_factory=set)
    # msg id -> (zone, address) -> [(family, value)]
    records: dict[int, dict[tuple[str, str], list[tuple[bytes, bytes]]]] = field(
        default_factory=dict
    )
    dues: dict[int, list[tuple[str, int, str]]] = field(default_factory=dict)  # zone, ms, rcpt
    events: dict[int, list[Event]] = field(default_factory=dict)
    counters: dict[bytes, int] = field(default_factory=dict)
    unknown: list[bytes] = field(default_factory=list)

    def traces(self, msg_id: int) -> list[str]:
        """Which families hold a key of ``msg_id`` (events aside)."""
        found = []
        if msg_id in self.heads:
            found.append("head")
        if msg_id in self.metas:
            found.append("meta")
        if msg_id in self.chunks:
            found.append(f"chunks {sorted(self.chunks[msg_id])}")
        if msg_id in self.receiving:
            found.append("receiving marker")
        if msg_id in self.records:
            found.append(f"records {sorted(self.records[msg_id])}")
        if msg_id in self.dues:
            found.append(f"due entries {self.dues[msg_id]}")
        return found

    def ids(self) -> set[int]:
        return (
            set(self.heads)
            | set(self.metas)
            | set(self.chunks)
            | self.receiving
            | set(self.records)
            | set(self.dues)
            | set(self.events)
        )


def _scan_message_key(disk: Disk, key: bytes, value: bytes) -> None:
    msg_id, part, index = keys.decode_message_key(key)
    if key == keys.message_head(msg_id):
        disk.heads[msg_id] = value
    elif key == keys.message_meta(msg_id):
        disk.metas[msg_id] = value
    elif part == keys.CHUNK_PART and index is not None and key == keys.message_chunk(msg_id, index):
        disk.chunks.setdefault(msg_id, {})[index] = value
    else:
        disk.unknown.append(key)


def scan(store: QueueStore) -> Disk:
    disk = Disk()
    for key, value in store.database.items():
        if key.startswith(keys.MESSAGE):
            _scan_message_key(disk, key, value)
        elif key.startswith(keys.RECEIVING):
            disk.receiving.add(keys.decode_receiving(key))
        elif key.startswith(keys.RECORD_FAMILIES):
            family, zone, msg_id, address = keys.decode_record(key)
            per_message = disk.records.setdefault(msg_id, {})
            per_message.setdefault((zone, address), []).append((family, value))
        elif key.startswith(keys.DUE):
            zone, due_ms, msg_id, address = keys.decode_due(key)
            disk.dues.setdefault(msg_id, []).append((zone, due_ms, address))
        elif key.startswith(keys.EVENT):
            event = Event.from_record(msgpack.unpackb(value))
            disk.events.setdefault(parse_id(event.message_id), []).append(event)
        elif key.startswith(keys.COUNTER):
            disk.counters[key] = int.from_bytes(value, "big", signed=True)
        elif key.startswith(keys.META):
            pass  # store-wide values
        else:
            disk.unknown.append(key)
    return disk


# --- the checks -------------------------------------------------------------------------


@dataclass
class Tally:
    checks: int = 0
    committed_whole: int = 0
    committed_delivered: int = 0
    in_flight_whole: int = 0
    in_flight_absent: int = 0
    recipients_redelivered: int = 0  # complete() returned but the record came back (allowed)
    orphans_swept: int = 0

    def add(self, other: Tally) -> None:
        for name in vars(self):
            setattr(self, name, getattr(self, name) + getattr(other, name))


class MessageCheck:
    """The checks of one message the child passed to ``commit()``."""

    def __init__(self, store: QueueStore, disk: Disk, exp: Expected, tally: Tally) -> None:
        self.store = store
        self.disk = disk
        self.exp = exp
        self.tally = tally
        self.problems: list[str] = []
        self.rcpt_keys = {(zone, address) for address, zone in exp.rcpts}
        self.zones = {zone for _, zone in exp.rcpts}
        self.events = disk.events.get(exp.msg_id, [])
        self.accepted_zones = {e.zone for e in self.events if e.kind is EventKind.ACCEPTED}
        self.delivered = Counter(
            (e.zone, e.recipient) for e in self.events if e.kind is EventKind.DELIVERED
        )

    def problem(self, text: str) -> None:
        state = "committed" if self.exp.committed else "commit in flight"
        self.problems.append(f"message {format_id(self.exp.msg_id)} ({state}): {text}")

    def run(self) -> list[str]:
        traces = self.disk.traces(self.exp.msg_id)
        if not traces:
            self.absent()
        elif self.exp.msg_id not in self.disk.heads or self.exp.msg_id not in self.disk.metas:
            self.problem(f"partial message on disk: {traces}")
        else:
            self.whole()
        return self.problems

    def gone(self, where: tuple[str, str]) -> None:
        """A recipient with no record left: complete() must have been called and landed."""
        if where not in self.exp.completing:
            self.problem(f"recipient {where} lost: gone although complete() was never called")
        if self.delivered[where] != 1:
            self.problem(f"recipient {where} gone with {self.delivered[where]} DELIVERED events")

    def absent(self) -> None:
        if not self.accepted_zones:  # the commit never landed
            if self.exp.committed:
                self.problem("commit() returned, but nothing of it is on disk")
            else:
                self.tally.in_flight_absent += 1
            if self.events:
                self.problem(f"no message, but events {[e.kind.value for e in self.events]}")
            return
        # The commit landed and every recipient has left since, each by complete().
        if self.accepted_zones != self.zones:
            self.problem(f"ACCEPTED events for zones {self.accepted_zones}, sent {self.zones}")
        for where in sorted(self.rcpt_keys):
            self.gone(where)
        self.tally.committed_delivered += 1

    def whole(self) -> None:
        exp, disk = self.exp, self.disk
        if exp.msg_id in disk.receiving:
            self.problem("receiving marker left beside a committed message")
        if self.accepted_zones != self.zones:
            self.problem(
                f"present, but ACCEPTED events for {self.accepted_zones}, not {self.zones}"
            )
        meta_key = keys.message_meta(exp.msg_id)
        meta = MessageMeta.decode(meta_key, exp.msg_id, disk.metas[exp.msg_id])
        if (meta.size, meta.chunks) != (exp.length, exp.chunks):
            self.problem(
                f"meta size/chunks {meta.size}/{meta.chunks}, sent {exp.length}/{exp.chunks}"
            )
        if set(meta.zones) != self.zones or meta.recipient_count != len(exp.rcpts):
            self.problem(f"meta zones {meta.zones} count {meta.recipient_count}, sent {exp.rcpts}")
        stored = disk.chunks.get(exp.msg_id, {})
        if sorted(stored) != list(range(exp.chunks)):
            self.problem(f"chunk indexes {sorted(stored)}, expected 0..{exp.chunks - 1}")
        body = body_for(exp.msg_id, exp.length)
        if b"".join(stored[i] for i in sorted(stored)) != body:
            self.problem("body on disk differs from what was written")
        if b"".join(self.store.body(exp.msg_id)) != body:
            self.problem("store.body() differs from what was written")
        self.recipients()
        if exp.committed:
            self.tally.committed_whole += 1
        else:
            self.tally.in_flight_whole += 1

    def recipients(self) -> None:
        exp, disk = self.exp, self.disk
        recorded = disk.records.get(exp.msg_id, {})
        for where in sorted(set(recorded) - self.rcpt_keys):
            self.problem(f"record for {where}, which is not one of its recipients")
        deferred_due: list[tuple[str, int, str]] = []
        for where in sorted(self.rcpt_keys):
            entries = recorded.get(where, [])
            if not entries:
                self.gone(where)
                continue
            if len(entries) > 1:
                self.problem(f"recipient {where} in several states: {[f for f, _ in entries]}")
            if self.delivered[where]:
                self.problem(f"recipient {where} still queued but has a DELIVERED event")
            if where in exp.completed:
                self.tally.recipients_redelivered += 1  # at-least-once: allowed
            zone, address = where
            for family, value in entries:
                if family == keys.DEFERRED:
                    record = Recipient.decode(b"", zone, exp.msg_id, address, value)
                    deferred_due.append((zone, record.next_attempt_ms, address))
        dues = disk.dues.get(exp.msg_id, [])
        if sorted(dues) != sorted(deferred_due):
            self.problem(f"due index {sorted(dues)} != deferred records {sorted(deferred_due)}")
        head_key = keys.message_head(exp.msg_id)
        _, remaining = decode_head(head_key, disk.heads[exp.msg_id])
        queued = sum(len(entries) for entries in recorded.values())
        if remaining != queued or remaining < 1:
            self.problem(f"head says {remaining} recipients queued, {queued} records on disk")
        api = {(q.recipient.zone, q.recipient.address) for q in self.store.recipients(exp.msg_id)}
        if api != set(recorded):
            self.problem(f"store.recipients() shows {sorted(api)}, disk {sorted(recorded)}")


async def _check(directory: Path, ledger_path: Path, label: str) -> Tally:
    tally = Tally(checks=1)
    view = read_ledger(ledger_path)
    store = QueueStore.open(directory, chunk_size=CHUNK_SIZE)
    try:
        tally.orphans_swept = store.recover()
        disk = scan(store)
        problems: list[str] = []
        for exp in view.messages.values():
            problems += MessageCheck(store, disk, exp, tally).run()
        for msg_id in sorted(disk.ids() - set(view.messages)):
            why = "abandoned" if msg_id in view.abandoned else "never committed"
            events = [e.kind.value for e in disk.events.get(msg_id, [])]
            problems.append(
                f"message {format_id(msg_id)} ({why}): trace left {disk.traces(msg_id)}"
                f" events {events}"
            )
        if disk.receiving:
            problems.append(f"receiving markers left after recover(): {sorted(disk.receiving)}")
        if disk.unknown:
            problems.append(f"keys of no known family: {disk.unknown[:5]}")
        true = store.recount()
        if store.counters() != true:
            problems.append(f"counters {store.counters()} != recount {true}")
        if disk.counters != true:
            problems.append(f"counters on disk {disk.counters} != recount {true}")
        if problems:
            shown = "\n  ".join(problems[:25])
            pytest.fail(f"{label}: {len(problems)} problems in {directory}:\n  {shown}")
        assert await store.sweep(now_ms(), 0) == 0, f"{label}: recover() left orphans"

        # 4. The store goes on: a new two-chunk message commits and reads back whole.
        ledger = Ledger(ledger_path)
        try:
            msg_id = store.begin(now_ms())
            length = CHUNK_SIZE + 100
            body = body_for(msg_id, length)
            rcpts = [("after@crash.example", "default"), ("also@crash.example", "pool b")]
            await store.write_chunk(msg_id, 0, body[:CHUNK_SIZE])
            meta = MessageMeta(msg_id, "check@parent.example", length, 2, now_ms())
            ledger.log("P", id=format_id(msg_id), len=length, chunks=2, rcpts=rcpts, tail=True)
            await store.commit(meta, new_recipients(rcpts), now_ms(), tail=body[CHUNK_SIZE:])
            ledger.log("C", id=format_id(msg_id))
        finally:
            ledger.close()
        assert b"".join(store.body(msg_id)) == body, f"{label}: new message body"
        assert len(store.recipients(msg_id)) == 2, f"{label}: new message recipients"
        assert store.counters() == store.recount(), f"{label}: counters after a new message"
    finally:
        await store.close()
    return tally


def check_store(directory: Path, ledger: Path, label: str) -> Tally:
    return asyncio.run(_check(directory, ledger, label))


def kill_points(total: int) -> list[int]:
    """1..total, or the first and last EDGE plus an even sample; edges first."""
    if total <= MAX_BOUNDARIES:
        every = list(range(1, total + 1))
        return every[:EDGE] + every[-EDGE:][::-1] + every[EDGE:-EDGE]
    first = list(range(1, EDGE + 1))
    last = list(range(total, total - EDGE, -1))
    middle_count = MAX_BOUNDARIES - 2 * EDGE
    step = (total - 2 * EDGE) / (middle_count + 1)
    middle = sorted({EDGE + round(step * (i + 1)) for i in range(middle_count)})
    return first + last + middle


# --- the tests --------------------------------------------------------------------------


@pytest.mark.parametrize("seed", SEEDS)
def test_kill_after_each_write(tmp_path: Path, seed: int) -> None:
    args = (*WORKLOAD, "--seed", str(seed))
    # A full run, closed cleanly, counts the writes (group commit makes the count vary a
    # little from run to run: a kill point past a run's last write ends it at its end).
    counted = run_child(tmp_path / "count", tmp_path / "count.ledger", *args)
    assert counted.returncode == 0, counted.stderr
    total = read_ledger(tmp_path / "count.ledger").ends[0]
    assert total > 20, f"the workload made only {total} writes"
    tally = check_store(tmp_path / "count", tmp_path / "count.ledger", "clean run")

    points = kill_points(total)
    deadline = time.monotonic() + BOUNDARY_BUDGET_S
    done: list[int] = []
    ran_to_end = 0
    for n in points:
        if time.monotonic() > deadline:
            break
        directory, ledger = tmp_path / f"k{n}", tmp_path / f"k{n}.ledger"
        run = run_child(directory, ledger, *args, "--kill-after", str(n))
        expect_killed(run, f"kill after write {n}")
        if read_ledger(ledger).ends:
            ran_to_end += 1
        tally.add(check_store(directory, ledger, f"seed {seed}, killed after write {n}"))
        done.append(n)
    print(
        f"\nseed {seed}: {total} writes; killed after {len(done)} of {len(points)} boundaries "
        f"({ran_to_end} ran out of writes first); {tally}"
    )
    assert set(range(1, min(EDGE, total) + 1)) <= set(done), "budget too small for the edges"
    assert total in done, "the last write boundary was not reached"
    assert tally.committed_whole > 0 and tally.committed_delivered > 0


def test_kill_at_random_moments(tmp_path: Path) -> None:
    """SIGKILL from outside at random times (inside LevelDB writes and fsyncs too), all runs
    on one directory, so each child also starts from what the previous crash left.  One kill
    in four is timed from the start of the process (open and recover), the rest from the
    moment the store is recovered (the workload)."""
    rng = random.Random(20_241_121)
    directory, ledger = tmp_path / "queue", tmp_path / "ledger"
    timing = run_child(tmp_path / "timing", tmp_path / "timing.ledger", *WORKLOAD)
    assert timing.returncode == 0, timing.stderr
    busy_s = workload_seconds(tmp_path / "timing.ledger")
    tally = Tally()
    deadline = time.monotonic() + RANDOM_BUDGET_S
    runs = 0
    for run_index in range(RANDOM_KILLS):
        if time.monotonic() > deadline:
            break
        from_ready = rng.random() < 0.75
        delay = rng.uniform(0.0, 1.1 * (busy_s if from_ready else timing.elapsed_s))
        label = f"random kill {run_index}, {delay:.3f} s after {'ready' if from_ready else 'start'}"
        seed = str(100 + run_index)
        drop_partial_line(ledger)  # the last child may have been killed mid-line
        run = run_child(
            directory,
            ledger,
            *WORKLOAD,
            "--seed",
            seed,
            "--crash-at-end",
            kill_after_s=delay,
            from_ready=from_ready,
        )
        expect_killed(run, label)
        tally.add(check_store(directory, ledger, label))
        runs += 1
    print(
        f"\n{runs} random kills (child ~{timing.elapsed_s:.2f} s, workload ~{busy_s:.2f} s); "
        f"{tally}"
    )
    assert runs >= min(RANDOM_KILLS, 5)
    assert tally.committed_whole > 0


def test_abandon_with_chunk_write_in_flight_leaves_no_trace(tmp_path: Path) -> None:
    """A DATA timeout or disconnect cancels the session while write_chunk() is pending.

    Regression: abandon() once built its deletes from the durable database only, so a chunk
    still staged in the writer landed after the marker was gone and was never swept.
    """

    async def scenario() -> int:
        store = QueueStore.open(tmp_path / "queue", chunk_size=CHUNK_SIZE)
        store.recover()
        msg_id = store.begin(now_ms())
        await store.write_chunk(msg_id, 0, b"a" * CHUNK_SIZE)
        pending = asyncio.create_task(store.write_chunk(msg_id, 1, b"b" * CHUNK_SIZE))
        await asyncio.sleep(0)  # the chunk is staged, the session awaits it
        pending.cancel()  # asyncio.wait_for() timing out, or the client going away
        await store.abandon(msg_id)
        await store.drain()
        await store.close()
        return msg_id

    msg_id = asyncio.run(scenario())

    async def reopen() -> list[bytes]:
        store = QueueStore.open(tmp_path / "queue", chunk_size=CHUNK_SIZE)
        store.recover()
        await store.sweep(now_ms() + 3_600_000, 0)
        await store.drain()
        left = list(store.database.keys(prefix=keys.message_prefix(msg_id)))
        await store.close()
        return left

    left = asyncio.run(reopen())
    assert left == [], f"abandoned message left {left} after recover() and sweep()"
