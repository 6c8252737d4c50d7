"""A remote MX that is down for a while: the dead-host cache rests it, then delivery resumes
by itself, no restart.

down.test's MX is an address where nothing listens yet: connections are refused, and the
worker's dead-host cache marks the address dead (``delivery.dead_host_backoff`` the first
time, 5 s here; ``hostcache.py``), which its log must say.  The recipients are deferred on
a 2 s retry schedule, so without the cache they would be tried again inside those 5 s.  As
soon as the log shows the marking, a listener of the test's own takes the address and
counts every connection that reaches it until the rest is nearly over: there must be none.
Then smtp-sink starts on that address.  Without any restart (the same core and worker PIDs
throughout), every acknowledged message must reach it once the dead period has run out on
its own (ZoneMTA's cache needed a restart, its issue #182), each exactly once, and the log
must show the address tried again after its rest.
"""

from __future__ import annotations

import asyncio
import re
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path

import pytest

from tests.reliability.bed import WORKERS, inspect_queue, loopback_ip, mail_bed
from tests.support.ledger import Dumps, Ledger, Load, audit, send_for, wait_settled
from tests.support.serve import Serve, smtp_port, start_serve
from tests.support.smtpsink import run_smtp_sink

pytestmark = pytest.mark.integration

DEAD_PERIOD_S = 5.0  # delivery.dead_host_backoff: the first failure's dead period
RETRY = "2s"  # shorter than the dead period: only the cache keeps the retries away
MARK_LIMIT_S = 15.0  # from the first send until the log shows the address marked dead
REST_MARGIN_S = 0.5  # the listener gives the address up this long before the rest ends
RESUME_LIMIT_S = 2 * DEAD_PERIOD_S + 30.0  # a probe may find neither listener: one more rest
RECIPIENTS = ("d1@down.test", "d2@down.test")


MIN_WATCH_S = 2.5  # the listener must watch at least one retry interval of the rest


def marked_dead(address: str) -> re.Pattern[str]:
    """The worker's line; group 1 its time (logging's default asctime, local), 2 the period."""
    return re.compile(
        rf"^(\S+ \S+) zoneq\.delivery INFO MX address {re.escape(address)} "
        r"marked dead for (\S+) s \(failure 1\)",
        re.M,
    )


def logged_at(asctime: str) -> float:
    """A log line's wall-clock time (the worker runs on this machine's clock)."""
    return datetime.strptime(asctime, "%Y-%m-%d %H:%M:%S,%f").timestamp()


def wait_for_log(serve: Serve, pattern: re.Pattern[str], timeout: float) -> re.Match[str] | None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = pattern.search(serve.log_text())
        if found is not None:
            return found
        time.sleep(0.05)
    return None


@contextmanager
def counting_listener(host: str, port: int) -> Iterator[list[float]]:
    """Listen on ``host:port`` and note when each connection arrives (closing it at once).

    A plain socket, not an SMTP server: the question is only whether anything connected.
    """
    accepted: list[float] = []  # time.time() of each accept
    listener = socket.create_server((host, port), reuse_port=False)
    listener.settimeout(0.05)
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                connection, _ = listener.accept()
            except TimeoutError:
                continue
            accepted.append(time.time())
            connection.close()

    thread = threading.Thread(target=accept, name="counting-listener", daemon=True)
    thread.start()
    try:
        yield accepted
    finally:
        stop.set()
        thread.join(timeout=5.0)
        listener.close()


def test_a_dead_remote_is_rested_then_delivery_resumes_by_itself(tmp_path: Path) -> None:
    ledger = Ledger()
    dumps = Dumps()
    down_ip = loopback_ip()
    with mail_bed(tmp_path, remotes={"down.test": down_ip}) as bed:
        config = bed.config(
            connections=4, retry=RETRY, delivery={"dead_host_backoff": f'"{DEAD_PERIOD_S:.0f}s"'}
        )
        serve = start_serve(config, tmp_path / "serve.log")
        try:
            workers = serve.wait_ready(expected_workers=WORKERS)
            load = Load(RECIPIENTS, sizes=(300, 20_000), pause=0.05)
            sent_at = time.time()
            asyncio.run(send_for(smtp_port(config), ledger, "down", load, 1.0))
            marked = wait_for_log(serve, marked_dead(down_ip), MARK_LIMIT_S)
            assert marked is not None, serve.log_text()[-3000:]
            # The line may be read late (it is written while the load is still sending): the
            # rest is timed from the line's own time stamp.
            marked_at = logged_at(marked.group(1))
            rest_ends = marked_at + DEAD_PERIOD_S
            with counting_listener(down_ip, bed.port) as accepted:
                watched_from = time.time()
                time.sleep(max(0.0, rest_ends - REST_MARGIN_S - watched_from))
                watched_s = time.time() - watched_from
                during_rest = [round(t - marked_at, 2) for t in accepted]
            with run_smtp_sink(host=down_ip, port=bed.port) as remote:
                up_at = time.monotonic()
                settled = wait_settled(
                    remote, dumps, ledger.expected(), timeout=RESUME_LIMIT_S, quiet=1.0
                )
                resumed_s = time.monotonic() - up_at
                dumps.scan(remote)
            same = serve.running() and set(serve.workers()) == set(workers)
            serve.terminate()
        finally:
            serve.cleanup()
        log = serve.log_text()
    state = inspect_queue(config)
    result = audit(ledger, dumps)
    retried = re.search(rf"MX address {re.escape(down_ip)}: trying again after", log)
    print(
        f"\nremote down: {len(ledger.acknowledged)} acknowledged; marked dead "
        f"{marked_at - sent_at:.1f} s after the first send for {marked.group(2)} s; "
        f"watched {watched_s:.1f} s of the rest: {len(during_rest)} connection(s); all "
        f"delivered {resumed_s:.1f} s after the remote came up; {result.summary()}"
    )
    assert ledger.acknowledged
    assert float(marked.group(2)) == DEAD_PERIOD_S
    assert watched_s >= MIN_WATCH_S, "the load took so long that the rest was not watched"
    assert during_rest == [], (
        f"connections reached the remote while it was marked dead: {during_rest}"
    )
    assert retried is not None, "the log never shows the address tried again after its rest"
    assert settled, f"not all delivered {RESUME_LIMIT_S} s after the remote came back"
    assert same, "the core or a worker was restarted"
    assert not result.problems(), result.problems()
    assert result.duplicate_count == 0
    assert state.messages == 0, state.counters
