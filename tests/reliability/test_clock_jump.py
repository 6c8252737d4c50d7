"""The clock jumps forward five days: expired messages bounce once each, with no storm.

slow.test's MX (a fault server of the test's own, ``tests/support/faultserver.py``) answers
every MAIL with 451, so messages to it wait in ``deferred`` on the default schedule (next
try in 15 minutes).  ``zoneq serve`` is then stopped and started again under libfaketime
five days later (``FAKETIME=+5d``, monotonic clocks left alone): past the zone's 72 h
``max_age``.  Every deferred recipient is due at once; each must be tried once more (RFC
5321 section 4.5.4.1: give up only after the retry period) and then bounced, one DSN per
message to the sender, never more; and the remote must never see more sessions at once than
the zone's connection limit: no delivery storm.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.reliability.bed import WORKERS, QueueState, inspect_queue, mail_bed
from tests.support.faultserver import Faults, FaultServer
from tests.support.ledger import Audit, Dumps, Ledger, Load, audit, send_until_cut, wait_settled
from tests.support.serve import smtp_port, start_serve
from tests.support.testbed import missing
from zoneq.storage.counters import zone_key
from zoneq.storage.records import State

pytestmark = pytest.mark.integration

MESSAGES = 24
CONNECTIONS = 4
LIBFAKETIME = Path("/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1")
RECIPIENTS = ("s1@slow.test", "s2@slow.test")
DEFERRED = State.DEFERRED.value


class CountingServer(FaultServer):
    """A fault server that also counts its sessions open at once."""

    def __init__(self, faults: Faults) -> None:
        super().__init__(faults)
        self.open = 0
        self.most = 0

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.open += 1
        self.most = max(self.most, self.open)
        try:
            await super()._handle(reader, writer)
        finally:
            self.open -= 1

    def mails(self) -> int:
        return self.verbs().count(b"MAIL")


@contextlib.contextmanager
def faked_clock(offset: str) -> Iterator[None]:
    """Processes started inside run ``offset`` ahead (libfaketime, inherited by workers)."""
    if not LIBFAKETIME.exists():
        missing(f"libfaketime not found at {LIBFAKETIME} (Debian: apt-get install faketime)")
    fake = {
        "LD_PRELOAD": str(LIBFAKETIME),
        "FAKETIME": offset,
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",  # timeouts and the dead-host cache stay real
    }
    saved = {key: os.environ.get(key) for key in fake}
    os.environ.update(fake)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


async def wait_for(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        await asyncio.sleep(0.1)
    return False


@dataclass
class Run:
    ledger: Ledger
    tried: bool = False  # the first run tried every message
    deferred_before: int = 0
    settled: bool = False
    attempts_after: int = 0  # transactions the remote saw after the jump
    most_at_once: int = 0  # sessions open at once after the jump
    dsns: int = 0
    audit: Audit | None = None
    state: QueueState | None = None


async def scenario(tmp_path: Path) -> Run:
    run = Run(Ledger())
    dumps = Dumps()
    async with CountingServer(Faults(mail_reply=b"451 4.3.0 try again later")) as remote:
        with mail_bed(tmp_path, port=remote.port, remotes={"slow.test": "127.0.0.1"}) as bed:
            config = bed.config(connections=CONNECTIONS)
            first = start_serve(config, tmp_path / "serve-1.log")
            try:
                await asyncio.to_thread(first.wait_ready, WORKERS)
                load = Load(RECIPIENTS)
                await send_until_cut(smtp_port(config), run.ledger, "old", load, limit=MESSAGES)
                run.tried = await wait_for(lambda: remote.mails() >= MESSAGES, 30.0)
                await asyncio.sleep(1.0)  # the last deferrals land
                await asyncio.to_thread(first.terminate)
            finally:
                await asyncio.to_thread(first.cleanup)
            before = await asyncio.to_thread(inspect_queue, config)
            run.deferred_before = before.counters.get(zone_key("default", DEFERRED), 0)
            mails_before = remote.mails()
            remote.most = 0
            with faked_clock("+5d"):
                later = start_serve(config, tmp_path / "serve-2.log")
            try:
                await asyncio.to_thread(later.wait_ready, WORKERS)
                run.settled = await asyncio.to_thread(
                    wait_settled, bed.sink, dumps, run.ledger.expected(), timeout=60.0, quiet=3.0
                )
                await asyncio.to_thread(later.terminate)
            finally:
                await asyncio.to_thread(later.cleanup)
            dumps.scan(bed.sink)
            run.attempts_after = remote.mails() - mails_before
            run.most_at_once = remote.most
    run.state = await asyncio.to_thread(inspect_queue, config)
    run.audit = audit(run.ledger, dumps)
    run.dsns = sum(1 for c in dumps.copies.values() if c.bounce_of)
    return run


def test_expired_messages_bounce_once_each_without_a_delivery_storm(tmp_path: Path) -> None:
    run = asyncio.run(scenario(tmp_path))
    ledger, result, state = run.ledger, run.audit, run.state
    assert result is not None and state is not None
    print(
        f"\nclock +5d: {len(ledger.acknowledged)} messages deferred ({run.deferred_before} "
        f"recipients); after the jump {run.attempts_after} attempt(s), at most "
        f"{run.most_at_once} session(s) at once, {run.dsns} DSN(s); {result.summary()}"
    )
    assert run.tried, "the first run never tried every message"
    assert run.deferred_before == len(ledger.expected())
    assert run.settled, result.problems()
    assert not result.problems()
    assert result.copies == 0
    # Exactly one report per expired recipient, in one DSN per message.
    assert dict(result.bounces) == dict.fromkeys(ledger.expected(), 1)
    assert run.dsns == len(ledger.acknowledged)
    # One more try per message, never more sessions at once than the zone allows.
    assert run.attempts_after == len(ledger.acknowledged)
    assert 0 < run.most_at_once <= CONNECTIONS
    assert state.messages == 0, state.counters
