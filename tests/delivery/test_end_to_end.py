"""The delivery engine end to end, with real parts only.

A real store, queue service and IPC server run in the test's process (where the core would
be); the supervisor starts real zone worker processes (``python -m zoneq worker``); dnsmasq
answers the MX lookups; Postfix's smtp-sink is the remote MX.  Messages are committed to the
store as the SMTP receiver will commit them.
"""

from __future__ import annotations

import asyncio
import os
import random
import signal
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.storage.conftest import async_test
from tests.support.dnsmasq import Dnsmasq, running_dnsmasq
from tests.support.smtpsink import Sink, run_smtp_sink
from zoneq.config import Config, load_config
from zoneq.ipc.core import QueueHandler
from zoneq.ipc.server import IpcServer
from zoneq.queue.service import QueueService
from zoneq.storage.records import MessageMeta, NewRecipient
from zoneq.storage.store import QueueStore
from zoneq.supervisor import Supervisor

pytestmark = pytest.mark.integration

BODY = (
    b"From: sender@src.test\r\nTo: someone@ok.test\r\nSubject: end to end\r\n"
    b"Message-ID: <e2e@src.test>\r\n\r\nHello.\r\n.leading dot\r\n"
)


@dataclass
class Bed:
    sink: Sink
    dns: Dnsmasq
    dead_ip: str
    directory: Path


@pytest.fixture
def bed(tmp_path: Path) -> Iterator[Bed]:
    sink_ip = f"127.0.{random.randint(1, 250)}.{random.randint(2, 250)}"
    dead_ip = f"127.0.{random.randint(1, 250)}.1"  # nothing listens there: refused
    with run_smtp_sink(host=sink_ip) as sink:
        records = [
            "mx-host=ok.test,mx1.ok.test,10",
            "mx-host=ok.test,mx2.ok.test,20",
            f"host-record=mx1.ok.test,{dead_ip}",
            f"host-record=mx2.ok.test,{sink_ip}",
            "mx-host=src.test,mx.src.test,10",
            f"host-record=mx.src.test,{sink_ip}",
            "dns-rr=nullmx.test,15,000000",
            "address=/nx.test/",
        ]
        with running_dnsmasq(records, tmp_path / "dns") as dns:
            yield Bed(sink, dns, dead_ip, tmp_path)


def write_config(bed: Bed, *, connections: int = 4) -> Path:
    path = bed.directory / "zones.toml"
    path.write_text(
        f"""
[server]
hostname = "mx.zoneq.test"
data_dir = "{bed.directory / "queue"}"
ipc_socket = "{bed.directory / "zoneq.sock"}"

[delivery]
mx_port = {bed.sink.port}
nameservers = ["127.0.0.1"]
dns_port = {bed.dns.port}
dns_timeout = "5s"
allow_loopback_mx = true
tls = "none"

[zones.default]
processes = 1
connections = {connections}

[zones.bounces]
processes = 1
connections = 2
"""
    )
    return path


@dataclass
class Core:
    store: QueueStore
    service: QueueService
    supervisor: Supervisor
    config: Config


@asynccontextmanager
async def running_core(config_path: Path) -> AsyncIterator[Core]:
    config = load_config(config_path)
    store = QueueStore.open(Path(config.server.data_dir))
    store.recover()
    service = QueueService.from_config(store, config)
    server = IpcServer(Path(config.server.ipc_socket), QueueHandler(service, set(config.zones)))
    await server.start()
    supervisor = Supervisor({z: c.processes for z, c in config.zones.items()}, config_path, 10)
    await supervisor.start()
    stop = asyncio.Event()
    promoter = asyncio.create_task(service.run(stop, interval_s=0.2))
    try:
        yield Core(store, service, supervisor, config)
    finally:
        stop.set()
        await supervisor.stop()
        await server.close()
        await promoter
        await store.close()


async def queue(store: QueueStore, recipients: list[str], sender: str = "sender@src.test") -> int:
    msg_id = store.begin(0)
    meta = MessageMeta(msg_id, sender, len(BODY), 1, 0, headers={"Subject": "end to end"})
    rcpts = [NewRecipient(address, "default") for address in recipients]
    await store.commit(meta, rcpts, 0, tail=BODY)
    return msg_id


async def until_empty(store: QueueStore, timeout: float = 30.0) -> None:
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while store.message_count() > 0:
        if loop.time() > deadline:
            pytest.fail(f"queue not empty after {timeout} s: {store.counters()}")
        await asyncio.sleep(0.1)
    # The counters move when an outcome is staged; its batch (with its event) lands a little
    # later on the writer's thread, and store.events() reads the disk.
    await store.drain()


@async_test
async def test_messages_reach_the_backup_mx_when_the_first_refuses(bed: Bed) -> None:
    async with running_core(write_config(bed)) as core:
        for n in range(20):
            await queue(core.store, [f"a{n}@ok.test", f"b{n}@ok.test"])
        await until_empty(core.store)
        events = [e for _, e in core.store.events() if e.kind.value == "delivered"]
    assert len(events) == 40
    assert {e.mx for e in events} == {"mx2.ok.test"}  # mx1 refused: the next MX took it
    got = bed.sink.messages(20)
    assert len(got) == 20
    for message in got:
        assert len(message.rcpt_args) == 2  # one transaction per message and domain
        assert message.content.endswith(b"Hello.\n.leading dot\n")  # dot-stuffing undone


@async_test
async def test_null_mx_and_nxdomain_bounce_once_and_the_dsn_is_delivered(bed: Bed) -> None:
    async with running_core(write_config(bed)) as core:
        await queue(core.store, ["x@nullmx.test", "y@nx.test"])
        await until_empty(core.store)
        kinds = [e.kind.value for _, e in core.store.events()]
    assert kinds.count("bounced") == 2
    # The two domains were two jobs, each failing in its own report; the message's failures
    # are told in one DSN (``queue/bounces.py``: the first waits while the other is in
    # flight), listing each failed recipient once, sent with the null reverse-path to the
    # sender's MX (the sink).
    assert kinds.count("delivered") == 1
    [dsn] = bed.sink.messages(1)
    assert "<>" in dsn.mail_args
    text = dsn.content.decode()
    assert text.count("Final-Recipient:") == 2
    assert "Status: 5.1.10" in text and "x@nullmx.test" in text
    assert "Status: 5.1.2" in text and "y@nx.test" in text


@async_test
async def test_a_worker_killed_mid_delivery_loses_nothing(bed: Bed) -> None:
    with run_smtp_sink("-W", ".:2", host=bed.sink.host) as slow:  # final reply after 2 s
        bed = Bed(slow, bed.dns, bed.dead_ip, bed.directory)
        async with running_core(write_config(bed, connections=1)) as core:
            await queue(core.store, ["k@ok.test"])
            loop = asyncio.get_running_loop()
            deadline = loop.time() + 10
            while core.service.in_flight() == 0 and loop.time() < deadline:
                await asyncio.sleep(0.05)
            await asyncio.sleep(0.5)  # the body is on its way; the reply is 2 s off
            pid = core.supervisor.pids()["default-0"]
            os.kill(pid, signal.SIGKILL)
            await until_empty(core.store, timeout=40)
            assert core.supervisor.restarts() >= 1
            delivered = [e for _, e in core.store.events() if e.kind.value == "delivered"]
        assert len(delivered) == 1
        copies = slow.messages(1, timeout=5)
        assert 1 <= len(copies) <= 2  # the RFC 1047 window: at most one extra copy


@async_test
async def test_a_final_reply_after_90_seconds_is_one_copy_with_the_default_timeouts(
    bed: Bed,
) -> None:
    """RFC 5321 4.5.3.2.6 gives the reply after the dot 10 minutes; aiosmtplib's default of
    60 s would give up on this server after it had the message, and the retry would
    deliver a second copy.  The workers here run with zoneq's default timeouts."""
    with run_smtp_sink("-W", ".:90", host=bed.sink.host) as slow:
        bed = Bed(slow, bed.dns, bed.dead_ip, bed.directory)
        async with running_core(write_config(bed, connections=1)) as core:
            await queue(core.store, ["patient@ok.test"])
            await until_empty(core.store, timeout=150)
            kinds = [e.kind.value for _, e in core.store.events()]
        assert kinds.count("delivered") == 1
        assert "deferred" not in kinds
        assert len(slow.messages(1, timeout=5)) == 1
