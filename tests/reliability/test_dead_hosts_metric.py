"""``zoneq_dead_hosts`` in ``/metrics``: a real ``zoneq serve`` whose worker finds a remote
MX down shows 1 for its zone, and 0 again once the remote accepts and the cache retried it.

down.test's MX is an address where nothing listens: the connection is refused and the
worker's dead-host cache rests the address (``delivery/hostcache.py``).  The worker tells
the core its count (``Report.dead_hosts``, ``ipc/messages.py``) and the core's collector
sums the latest counts of each zone's connected workers.  Once the gauge has shown 1,
smtp-sink starts on that address; the message is delivered after the rest without any
restart, the log shows the cache forgetting the address ("alive again"), and the gauge
must go back to 0 and stay there.
"""

from __future__ import annotations

import smtplib
import time
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.reliability.bed import WORKERS, data_dir_of, loopback_ip, mail_bed
from tests.support.ledger import SENDER, make_message
from tests.support.serve import api_get, api_port, smtp_port, start_serve
from tests.support.smtpsink import run_smtp_sink

pytestmark = pytest.mark.integration

ZONE = "default"
DEAD_PERIOD_S = 3.0  # delivery.dead_host_backoff: the first failure's rest
RETRY = "1s"  # the default zone's retry schedule: the probe comes soon after a rest
MARK_LIMIT_S = 20.0  # from the send until the gauge shows the address dead
# A probe that still finds nothing listening rests it twice as long: one more rest.
RESUME_LIMIT_S = 3 * DEAD_PERIOD_S + 20.0
STAY_S = 2.5  # the gauge must stay 0 this long (the worker looks once a second)


def dead_hosts(port: int, token: str) -> tuple[dict[str, float], str]:
    """The gauge's value per zone, and the exposition text it came in."""
    status, text = api_get(port, "/metrics", token)
    assert status == 200, text
    for family in text_string_to_metric_families(text):
        if family.name == "zoneq_dead_hosts":
            assert family.type == "gauge"
            return {sample.labels["zone"]: sample.value for sample in family.samples}, text
    raise AssertionError(f"no zoneq_dead_hosts in /metrics:\n{text}")


def wait_for_gauge(
    port: int, token: str, value: float, timeout: float, seen: list[float]
) -> str | None:
    """Scrape (bounded) until the default zone's gauge is ``value``; every reading goes to
    ``seen``.  The text of the scrape that showed it, or None at the time limit."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        gauge, text = dead_hosts(port, token)
        seen.append(gauge[ZONE])
        if gauge[ZONE] == value:
            return text
        time.sleep(0.1)
    return None


def test_the_dead_host_gauge_rises_and_falls_with_the_remote(tmp_path: Path) -> None:
    down_ip = loopback_ip()
    seen: list[float] = []
    with mail_bed(tmp_path, remotes={"down.test": down_ip}) as bed:
        config = bed.config(retry=RETRY, delivery={"dead_host_backoff": f'"{DEAD_PERIOD_S:.0f}s"'})
        serve = start_serve(config, tmp_path / "serve.log")
        try:
            workers = serve.wait_ready(expected_workers=WORKERS)
            port = api_port(config)
            token = (data_dir_of(config) / "api.token").read_text().strip()
            before, _ = dead_hosts(port, token)
            message, _ = make_message("<dead-gauge@src.test>", ["r@down.test"], 500)
            with smtplib.SMTP("127.0.0.1", smtp_port(config), timeout=10) as client:
                client.sendmail(SENDER, ["r@down.test"], message)
            risen = wait_for_gauge(port, token, 1, MARK_LIMIT_S, seen)
            with run_smtp_sink(host=down_ip, port=bed.port) as remote:
                delivered = remote.messages(1, timeout=RESUME_LIMIT_S)
                fallen = wait_for_gauge(port, token, 0, RESUME_LIMIT_S, seen)
                stayed = []
                stay_until = time.monotonic() + STAY_S
                while time.monotonic() < stay_until:
                    stayed.append(dead_hosts(port, token)[0][ZONE])
                    time.sleep(0.2)
            same = serve.running() and set(serve.workers()) == set(workers)
            serve.terminate()
        finally:
            serve.cleanup()
        log = serve.log_text()
    print(f"\ndead-host gauge readings of zone {ZONE}: {seen}; then {stayed}")
    # Every configured zone is shown from the start, at 0: no worker has rested anything.
    assert before == {"default": 0, "bounces": 0}
    assert risen is not None, f"the gauge never showed 1: {seen}\n{log[-3000:]}"
    assert "# HELP zoneq_dead_hosts " in risen
    assert "# TYPE zoneq_dead_hosts gauge" in risen
    assert f'zoneq_dead_hosts{{zone="{ZONE}"}} 1.0' in risen
    assert len(delivered) == 1, f"not delivered after the remote came up\n{log[-3000:]}"
    assert f"MX address {down_ip} is alive again" in log, "the cache never retried the address"
    assert fallen is not None, f"the gauge never went back to 0: {seen}"
    assert stayed and set(stayed) == {0}, f"the gauge did not stay at 0: {stayed}"
    assert same, "the core or a worker was restarted"
