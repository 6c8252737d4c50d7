"""A corrupted record: quarantined and reported, the rest delivered; and one zoneq per queue.

Messages are queued with the store while ``zoneq serve`` is stopped, then damaged through
plyvel directly (as a torn write or a bad disk would leave them): one recipient record's
value and one message's metadata overwritten with garbage, one message's metadata with a
field of the wrong type (``"chunks": "3"``), one body chunk deleted, one cut short, and one
message's ``#`` head deleted.  ``zoneq serve`` must deliver every other recipient, the one
whose message lost its head included, once (and record it, so no restart sends it again);
never deliver a body cut short; hold the messages whose body is damaged; leave the bad
records where they are (an operator may repair them; deleting would lose the recipients
silently) and say so in its log; and no worker may die of any of it.  A second ``zoneq
serve`` on the same data directory must refuse to start, with a message naming the
directory, and a non-zero exit status.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import msgpack
import plyvel
import pytest

from tests.reliability.bed import WORKERS, QueueState, data_dir_of, inspect_queue, mail_bed
from tests.support.ledger import SENDER, Dumps, Ledger, make_message, wait_settled
from tests.support.serve import ROOT, api_get, api_port, start_serve
from zoneq.storage import keys
from zoneq.storage.records import MessageMeta, NewRecipient, State
from zoneq.storage.store import QueueStore

pytestmark = pytest.mark.integration

MESSAGES = 12
# The recipient record, the two damaged metadata values, the missing and the torn chunk
# (found by the core when the worker could not send the body whole), the lost head.
QUARANTINED = 6
GARBAGE = b"\xc1\xff not a record \x00"  # 0xc1 is never valid msgpack


def now_ms() -> int:
    return time.time_ns() // 1_000_000


async def queue_messages(directory: Path, ledger: Ledger, count: int) -> dict[str, int]:
    """``count`` one-recipient messages committed with the store: acknowledged, as a 250 is.
    Their store ids by Message-ID."""
    ids: dict[str, int] = {}
    store = QueueStore.open(directory)
    store.recover()
    try:
        for n in range(count):
            message_id = f"<corrupt-{n}@src.test>"
            recipient = f"r{n}@ok.test"
            wire, ledger.digests[message_id] = make_message(message_id, [recipient], 500)
            msg_id = store.begin(now_ms())
            # In two chunks, so that one can be cut short with the headers whole.
            half = len(wire) // 2
            await store.write_chunk(msg_id, 0, wire[:half])
            meta = MessageMeta(msg_id, SENDER, len(wire), 2, now_ms())
            rcpts = [NewRecipient(recipient, "default")]
            await store.commit(meta, rcpts, now_ms(), tail=wire[half:])
            ledger.acknowledged[message_id] = [recipient]
            ids[message_id] = msg_id
    finally:
        await store.close()
    return ids


def corrupt_one(directory: Path, address: str) -> bytes:
    """Overwrite the ready record of ``address`` with garbage; its key."""
    db = plyvel.DB(str(directory))
    try:
        prefix = keys.zone_prefix(keys.READY, "default")
        for key in db.iterator(prefix=prefix, include_value=False):
            if key.endswith(keys.text(address)):
                db.put(key, GARBAGE, sync=True)
                return bytes(key)
    finally:
        db.close()
    raise AssertionError(f"no ready record for {address}")


def mistype_chunks(directory: Path, msg_id: int) -> None:
    """Rewrite a message's metadata with ``"chunks": "3"``: it decodes, with a wrong type."""
    db = plyvel.DB(str(directory))
    try:
        key = keys.message_meta(msg_id)
        meta = msgpack.unpackb(db.get(key))
        meta["chunks"] = "3"
        db.put(key, msgpack.packb(meta), sync=True)
    finally:
        db.close()


def queued_and_held(config: Path) -> tuple[set[str], list[str]]:
    """Every queued recipient's address, in any state, and the hold reasons of those held
    in the default zone (``zoneq serve`` stopped)."""

    async def read() -> tuple[set[str], list[str]]:
        store = QueueStore.open(data_dir_of(config))
        store.recover()
        try:
            queued = {
                keys.decode_record(key)[3]
                for family in (keys.READY, keys.DEFERRED, keys.HELD)
                for key in store.database.keys(prefix=family)
            }
            return queued, [r.hold_reason for r in store.browse("default", State.HELD)[0]]
        finally:
            await store.close()

    return asyncio.run(read())


def wait_quarantined(port: int, count: int, timeout: float) -> tuple[int, str]:
    """``/health`` once it counts ``count`` quarantined records (or at the timeout)."""
    deadline = time.monotonic() + timeout
    while True:
        health = api_get(port, "/health")
        if json.loads(health[1]).get("quarantined") == count or time.monotonic() > deadline:
            return health
        time.sleep(0.2)


def corrupt_key(directory: Path, key: bytes, value: bytes | None) -> None:
    """Overwrite ``key`` with ``value``, or delete it (a lost write) for None."""
    db = plyvel.DB(str(directory))
    try:
        assert db.get(key) is not None, key
        if value is None:
            db.delete(key, sync=True)
        else:
            db.put(key, value, sync=True)
    finally:
        db.close()


@dataclass
class Run:
    expected: set[tuple[str, str]]  # every pair but the corrupt one
    victim: str
    settled: bool
    delivered: Counter[tuple[str, str]]
    log: str
    second: subprocess.CompletedProcess[str]
    queue: Path
    health: tuple[int, str]
    metrics: str
    state: QueueState
    headless: tuple[str, str]  # delivered, though its message lost its ``#`` head
    queued: set[str]  # the recipients still queued at the end, in any state
    held: list[str]  # the hold reasons of the recipients held


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """The scenario, once for the module's checks."""
    tmp_path = tmp_path_factory.mktemp("corrupt")
    ledger = Ledger()
    dumps = Dumps()
    with mail_bed(tmp_path) as bed:
        config = bed.config()
        queue = data_dir_of(config)
        ids = asyncio.run(queue_messages(queue, ledger, MESSAGES))
        first = sorted(ledger.acknowledged.items())[:6]
        (victim_id, [victim]), (chunk_id, [chunk_rcpt]), (meta_id, [meta_rcpt]) = first[:3]
        (head_id, [head_rcpt]), (short_id, [short_rcpt]), (type_id, [type_rcpt]) = first[3:]
        bad_key = corrupt_one(queue, victim)
        # Unreadable metadata: the message cannot be sent; the rest must go on (its worker
        # must not crash, and no other message's outcome may be lost with it).
        corrupt_key(queue, keys.message_meta(ids[meta_id]), GARBAGE)
        # A lost body chunk (a chunk's bytes carry no checksum: garbage in one would be sent
        # as it is; a missing one is what the store can notice).
        corrupt_key(queue, keys.message_chunk(ids[chunk_id], 0), None)
        # A lost ``#`` head: delivered (its ``*`` and body are whole), and recorded as such.
        corrupt_key(queue, keys.message_head(ids[head_id]), None)
        # A torn chunk: 25 octets of the second left.  Never delivered cut short.
        short_key = keys.message_chunk(ids[short_id], 1)
        db = plyvel.DB(str(queue))
        torn = db.get(short_key)[:25]
        db.close()
        corrupt_key(queue, short_key, torn)
        # A wrong-typed field: it used to kill every worker that was handed the job.
        mistype_chunks(queue, ids[type_id])
        lost = {
            (victim_id, victim),
            (chunk_id, chunk_rcpt),
            (meta_id, meta_rcpt),
            (short_id, short_rcpt),
            (type_id, type_rcpt),
        }
        expected = ledger.expected() - lost
        log = tmp_path / "serve.log"
        serve = start_serve(config, log)
        try:
            serve.wait_ready(expected_workers=WORKERS)
            settled = wait_settled(bed.sink, dumps, expected, timeout=30.0)
            port = api_port(config)
            token = (queue / "api.token").read_text().strip()
            health = wait_quarantined(port, QUARANTINED, timeout=10.0)
            metrics = api_get(port, "/metrics", token)
            # A second zoneq on the same queue, while the first runs on.
            second = subprocess.run(
                [sys.executable, "-m", "zoneq", "serve", "--config", str(config)],
                cwd=ROOT,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=30,
                check=False,
            )
            assert serve.running(), "the first zoneq serve died"
            serve.terminate()
        finally:
            serve.cleanup()
        dumps.scan(bed.sink)
    queued, held = queued_and_held(config)
    result = Run(
        expected=expected,
        victim=victim,
        settled=settled,
        delivered=dumps.delivered(),
        log=log.read_text(errors="replace"),
        second=second,
        queue=queue,
        health=health,
        metrics=metrics[1],
        state=inspect_queue(config),
        headless=(head_id, head_rcpt),
        queued=queued,
        held=held,
    )
    print(
        f"\ncorrupt record {bad_key!r}: {len(result.delivered)} of {len(expected)} others "
        f"delivered; a second serve exited {second.returncode}: {second.stderr.strip()[-300:]}"
        f"\nhealth {health}\n"
        + "\n".join(line for line in metrics[1].splitlines() if "quarantin" in line)
    )
    return result


def test_the_rest_is_delivered_once_and_the_bad_record_is_kept(run: Run) -> None:
    assert run.settled
    assert set(run.delivered) == run.expected
    assert all(n == 1 for n in run.delivered.values())
    # Kept for an operator, not deleted (that would lose the recipient without a trace);
    # the two messages whose body is damaged are held (their workers could not send the
    # body whole, deferred, and lived on: the supervisor never restarted one), as is the
    # headless one's rest (its recipient delivered).
    assert run.state.messages == 6
    assert run.state.quarantined >= 1  # the recipient record, found by the scan at start
    assert "restarting" not in run.log, run.log[-2000:]
    assert "Traceback" not in run.log, run.log[-4000:]


def test_a_message_that_lost_its_head_is_delivered_once_and_recorded(run: Run) -> None:
    assert run.delivered[run.headless] == 1
    # Its record is gone (with its DELIVERED event): a restart does not send it again.
    assert run.headless[1] not in run.queued, run.queued


def test_a_damaged_body_is_held_never_delivered_cut_short(run: Run) -> None:
    assert len(run.held) == 2, run.held
    assert all(reason.startswith("quarantined: damaged body") for reason in run.held)


def test_the_quarantined_count_is_in_health_and_metrics(run: Run) -> None:
    # Still 200: one bad record is for an operator to look at, not an outage.
    status, body = run.health
    assert status == 200
    # The recipient record (found by the scan at start) and the message's metadata (found
    # when its job was handed out).
    assert json.loads(body) == {"status": "ok", "quarantined": QUARANTINED}
    assert f"\nzoneq_quarantined_records {QUARANTINED}.0\n" in run.metrics, run.metrics


def test_the_quarantined_record_is_reported_in_the_log(run: Run) -> None:
    assert "quarantine" in run.log.lower() and run.victim in run.log, run.log[-2000:]


def test_a_second_serve_on_the_same_queue_refuses_to_start(run: Run) -> None:
    assert run.second.returncode != 0
    assert str(run.queue) in run.second.stderr, run.second.stderr
    assert "in use by another zoneq" in run.second.stderr, run.second.stderr
