"""A corrupted record: quarantined and reported, the rest delivered; and one zoneq per queue.

Messages are queued with the store while ``zoneq serve`` is stopped, then one recipient
record's value and one message's metadata are overwritten with garbage through plyvel
directly (as a torn write or a bad disk would leave them), and one body chunk is deleted.
``zoneq serve`` must deliver every other recipient, leave the bad records where they are
(an operator may repair them; deleting would lose the recipients silently) and say so in
its log.  A second ``zoneq serve`` on the same data directory must refuse to start, with a
message naming the directory, and a non-zero exit status.
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

import plyvel
import pytest

from tests.reliability.bed import WORKERS, QueueState, data_dir_of, inspect_queue, mail_bed
from tests.support.ledger import SENDER, Dumps, Ledger, make_message, wait_settled
from tests.support.serve import ROOT, api_get, api_port, start_serve
from zoneq.storage import keys
from zoneq.storage.records import MessageMeta, NewRecipient
from zoneq.storage.store import QueueStore

pytestmark = pytest.mark.integration

MESSAGES = 12
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
            meta = MessageMeta(msg_id, SENDER, len(wire), 1, now_ms())
            await store.commit(meta, [NewRecipient(recipient, "default")], now_ms(), tail=wire)
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
        first = sorted(ledger.acknowledged.items())[:3]
        (victim_id, [victim]), (chunk_id, [chunk_rcpt]), (meta_id, [meta_rcpt]) = first
        bad_key = corrupt_one(queue, victim)
        # Unreadable metadata: the message cannot be sent; the rest must go on (its worker
        # must not crash, and no other message's outcome may be lost with it).
        corrupt_key(queue, keys.message_meta(ids[meta_id]), GARBAGE)
        # A lost body chunk (a chunk's bytes carry no checksum: garbage in one would be sent
        # as it is; a missing one is what the store can notice).
        corrupt_key(queue, keys.message_chunk(ids[chunk_id], 0), None)
        lost = {(victim_id, victim), (chunk_id, chunk_rcpt), (meta_id, meta_rcpt)}
        expected = ledger.expected() - lost
        log = tmp_path / "serve.log"
        serve = start_serve(config, log)
        try:
            serve.wait_ready(expected_workers=WORKERS)
            settled = wait_settled(bed.sink, dumps, expected, timeout=30.0)
            port = api_port(config)
            token = (queue / "api.token").read_text().strip()
            health = api_get(port, "/health")
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
    # the message whose body lost its chunk waits deferred (its worker asked, was told the
    # chunk is missing, and lived on: the supervisor never restarted it).
    assert run.state.messages == 3
    assert run.state.quarantined >= 1  # the recipient record, found by the scan at start
    assert "restarting" not in run.log, run.log[-2000:]


def test_the_quarantined_count_is_in_health_and_metrics(run: Run) -> None:
    # Still 200: one bad record is for an operator to look at, not an outage.
    status, body = run.health
    assert status == 200
    # The recipient record (found by the scan at start) and the message's metadata (found
    # when its job was handed out).
    assert json.loads(body) == {"status": "ok", "quarantined": 2}
    assert "\nzoneq_quarantined_records 2.0\n" in run.metrics, run.metrics


def test_the_quarantined_record_is_reported_in_the_log(run: Run) -> None:
    assert "quarantine" in run.log.lower() and run.victim in run.log, run.log[-2000:]


def test_a_second_serve_on_the_same_queue_refuses_to_start(run: Run) -> None:
    assert run.second.returncode != 0
    assert str(run.queue) in run.second.stderr, run.second.stderr
    assert "in use by another zoneq" in run.second.stderr, run.second.stderr
