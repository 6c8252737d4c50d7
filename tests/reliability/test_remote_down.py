"""A remote MX that is down for a while: delivery resumes by itself, no restart.

down.test's MX is an address where nothing listens yet: connections are refused, the
worker's dead-host cache marks the address dead (``delivery.dead_host_backoff`` the first
time, 5 s here; ``hostcache.py``) and
the recipients are deferred on a short retry schedule.  A few seconds later smtp-sink starts
on that address.  Without any restart (the same core and worker PIDs throughout), every
acknowledged message must reach it once the dead period has run out on its own (ZoneMTA's
cache needed a restart, its issue #182), and each exactly once.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from tests.reliability.bed import WORKERS, inspect_queue, loopback_ip, mail_bed
from tests.support.ledger import Dumps, Ledger, Load, audit, send_for, wait_settled
from tests.support.serve import smtp_port, start_serve
from tests.support.smtpsink import run_smtp_sink

pytestmark = pytest.mark.integration

OUTAGE_S = 3.0
DEAD_PERIOD_S = 5.0  # delivery.dead_host_backoff: the first failure's dead period
RESUME_LIMIT_S = DEAD_PERIOD_S + 30.0  # plus the retry interval, promotion and slack
RECIPIENTS = ("d1@down.test", "d2@down.test")


def test_delivery_resumes_by_itself_after_the_remote_comes_back(tmp_path: Path) -> None:
    ledger = Ledger()
    dumps = Dumps()
    down_ip = loopback_ip()
    with mail_bed(tmp_path, remotes={"down.test": down_ip}) as bed:
        config = bed.config(
            connections=4, retry="2s", delivery={"dead_host_backoff": f'"{DEAD_PERIOD_S:.0f}s"'}
        )
        serve = start_serve(config, tmp_path / "serve.log")
        try:
            workers = serve.wait_ready(expected_workers=WORKERS)
            load = Load(RECIPIENTS, sizes=(300, 20_000), pause=0.05)
            sent_at = time.monotonic()
            asyncio.run(send_for(smtp_port(config), ledger, "down", load, 1.0))
            time.sleep(OUTAGE_S)  # connections refused meanwhile: deferred, address dead
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
    state = inspect_queue(config)
    result = audit(ledger, dumps)
    print(
        f"\nremote down {OUTAGE_S:.0f} s: {len(ledger.acknowledged)} acknowledged; all delivered "
        f"{resumed_s:.1f} s after the remote came up ({up_at - sent_at:.1f} s after the first "
        "send); "
        f"{result.summary()}"
    )
    assert ledger.acknowledged
    assert settled, f"not all delivered {RESUME_LIMIT_S} s after the remote came back"
    assert same, "the core or a worker was restarted"
    assert not result.problems(), result.problems()
    assert result.duplicate_count == 0
    assert state.messages == 0, state.counters
