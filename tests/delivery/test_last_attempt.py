"""The last attempt before expiry is a real one, even to an MX address that is resting.

The retry schedule promises one last try at the expiry time (``RetrySchedule.
next_attempt``).  It used to be skipped when the dead-host cache still rested the MX
address (the period doubles per failure, up to an hour), so a host that came back within
its rest had its recipients bounced without being tried.  The core now marks the job handed
out at the expiry (``Job.last_attempt``) and the walk ignores the cache for it.

The wire field is a pure unit (table-driven).  The rest runs on real parts (``inproc.py``:
the store on disk, the service, IPC and the worker; dnsmasq; first nothing listening on the
MX address, so the connection is refused, then Postfix's smtp-sink on it), with the core's
clock driven by the test and a dead-host period far longer than the test.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.delivery.inproc import InProc, config_for, running
from tests.delivery.test_dead_hosts_reason import DOWN, RECORDS, refused_port
from tests.queue.test_service import Clock
from tests.storage.conftest import MINUTE, async_test
from tests.support.dnsmasq import running_dnsmasq
from tests.support.smtpsink import run_smtp_sink
from zoneq.config import Config
from zoneq.ipc.messages import Job
from zoneq.protocol.events import Event

RECIPIENTS = ["a@down.test", "b@down.test"]


def settled(core: InProc) -> list[Event]:
    """The recipients' final events: delivered, or given up (expired, bounced)."""
    final = {"delivered", "expired", "bounced"}
    return [e for e in core.events() if e.kind.value in final]


@pytest.mark.parametrize(
    ("wire", "last"),
    [
        ({"last_attempt": True}, True),
        ({"last_attempt": False}, False),
        ({"last_attempt": None}, False),
        ({}, False),  # a core that does not send it: not the last attempt
    ],
)
def test_last_attempt_on_the_wire(wire: dict[str, object], last: bool) -> None:
    base = Job(msg_id=1, sender="", size=3, chunks=1, domain="down.test").to_wire()
    assert "last_attempt" not in base  # sent only when true
    assert Job.from_wire({**base, **wire}, "job").last_attempt is last
    marked = Job(msg_id=1, sender="", size=3, chunks=1, domain="d", last_attempt=True)
    assert Job.from_wire(marked.to_wire(), "job") == marked


async def up_to_the_expiry(core: InProc, clock: Clock) -> None:
    """Queue, and fail once (refused: the address rests for an hour of the worker's
    monotonic clock); retry while it rests (not the last attempt: the cache is heeded, the
    address skipped); then move the core's clock to the expiry, the last attempt."""
    await core.queue(RECIPIENTS)
    await core.until(lambda: len(core.events("deferred")) == 2)
    clock.now += MINUTE
    await core.service.promote_due()
    await core.until(lambda: len(core.events("deferred")) == 4)
    resting = core.events("deferred")[2:]
    assert all(f"[{DOWN}] resting after" in (e.text or "") for e in resting), resting
    clock.now += MINUTE


@contextlib.contextmanager
def core_config(tmp_path: Path) -> Iterator[tuple[Config, int]]:
    """The MX port (nothing listens yet) and a config: retry after 1m, expiry at 2m, and a
    dead-host period far longer than the test."""
    port = refused_port()
    zone = {"retry": "1m", "max_age": "2m"}
    with running_dnsmasq(RECORDS, tmp_path / "dns") as dns:
        yield config_for(tmp_path, dns, port, zone, delivery={"dead_host_backoff": "1h"}), port


@pytest.mark.integration
@async_test
async def test_the_last_attempt_tries_a_resting_host_and_delivers(tmp_path: Path) -> None:
    clock = Clock()
    with core_config(tmp_path) as (config, port):
        async with running(config, clock=clock) as core:
            await up_to_the_expiry(core, clock)
            with run_smtp_sink(host=DOWN, port=port) as sink:  # the host is back
                await core.service.promote_due()
                await core.until(lambda: len(settled(core)) == 2)
                outcomes = {e.recipient: (e.kind.value, e.text) for e in settled(core)}
                # Unfixed, the walk skipped the resting address: both expired, untried.
                assert sorted(outcomes) == RECIPIENTS
                assert all(kind == "delivered" for kind, _ in outcomes.values()), outcomes
                (message,) = sink.messages(1)
    assert message.rcpt_args == [f"<{r}>" for r in RECIPIENTS]  # one real transaction


@pytest.mark.integration
@async_test
async def test_a_host_still_down_at_the_last_attempt_expires_with_its_own_failure(
    tmp_path: Path,
) -> None:
    clock = Clock()
    with core_config(tmp_path) as (config, _):
        async with running(config, clock=clock) as core:
            await up_to_the_expiry(core, clock)
            await core.service.promote_due()
            await core.until(lambda: len(settled(core)) == 2)
            expired = settled(core)
    # The connection was made again and refused: the notice says so, not "resting".
    assert [e.kind.value for e in expired] == ["expired", "expired"]
    assert all("111" in (e.text or "") and "resting" not in (e.text or "") for e in expired)
