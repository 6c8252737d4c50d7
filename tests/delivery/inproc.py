"""A core and a zone worker in the test's own process, on real parts.

The core is the real store (LevelDB in the test's directory), queue service and IPC server;
the worker is the real ``Worker`` (MX lookup, transport, plugins) on a real IPC client, as
``zoneq worker`` runs it, but as a task here, so that a test can drive the core's clock,
look at its feedback state and read the outcomes it committed.  dnsmasq answers the MX
lookups (``tests/support/dnsmasq.py``); the remote MX is whatever the test starts.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import AsyncIterator, Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from tests.support.dnsmasq import Dnsmasq, running_dnsmasq
from zoneq.config import Config, validate_config
from zoneq.delivery.worker import Worker
from zoneq.ipc.client import IpcClient
from zoneq.ipc.core import QueueHandler
from zoneq.ipc.messages import Hello
from zoneq.ipc.server import IpcServer
from zoneq.plugin import PluginHost
from zoneq.protocol.events import Event
from zoneq.queue.service import QueueService, wall_clock_ms
from zoneq.storage.records import MessageMeta, NewRecipient
from zoneq.storage.store import QueueStore

ZONE = "default"

MESSAGE = (
    b"From: Shop <news@shop.example>\r\n"
    b"To: someone@ok.test\r\n"
    b"X-Sending-Zone: default\r\n"
    b"Subject: pools and plugins\r\n"
    b"Date: Sat, 21 Nov 2026 09:00:00 +0000\r\n"
    b"Message-ID: <inproc@shop.example>\r\n"
    b"\r\n"
    b"Hello.\r\n"
    b".leading dot\r\n"
)


@contextlib.contextmanager
def dns_for(
    directory: Path, domains: Sequence[str], address: str, hosts: int = 1
) -> Iterator[Dnsmasq]:
    """dnsmasq answering for each of ``domains`` with ``hosts`` MX hosts (preferences 10,
    20, ...), every one of them at ``address``."""
    records = []
    for number, domain in enumerate(domains):
        for host in range(hosts):
            name = f"mx{number}.{domain}" if host == 0 else f"mx{number}-{host}.{domain}"
            records += [
                f"mx-host={domain},{name},{10 * (host + 1)}",
                f"host-record={name},{address}",
            ]
    with running_dnsmasq(records, directory / "dns") as dns:
        yield dns


def config_for(
    directory: Path,
    dns: Dnsmasq,
    mx_port: int,
    zone: dict[str, Any] | None = None,
    **sections: dict[str, Any],
) -> Config:
    """A config for the in-process core and worker; ``zone`` is ``[zones.default]``."""
    data: dict[str, Any] = {
        "server": {
            "hostname": "mx.zoneq.test",
            "data_dir": str(directory / "queue"),
            "ipc_socket": str(directory / "core.sock"),
        },
        "delivery": {
            "mx_port": mx_port,
            "nameservers": ["127.0.0.1"],
            "dns_port": dns.port,
            "dns_timeout": "5s",
            "allow_loopback_mx": True,
            "tls": "none",
        },
        "zones": {ZONE: {"connections": 4, **(zone or {})}, "bounces": {}},
    }
    for name, section in sections.items():
        data[name] = {**data.get(name, {}), **section}
    return validate_config(data)


@dataclass
class InProc:
    config: Config
    store: QueueStore
    service: QueueService
    worker: Worker
    task: asyncio.Task[None]
    clock: Callable[[], int]

    async def queue(
        self, recipients: Sequence[str], body: bytes = MESSAGE, sender: str = "news@shop.example"
    ) -> int:
        now = self.clock()
        msg_id = self.store.begin(now)
        meta = MessageMeta(msg_id, sender, len(body), 1, now, headers={})
        rcpts = [NewRecipient(address, ZONE) for address in recipients]
        await self.store.commit(meta, rcpts, now, tail=body)
        return msg_id

    def events(self, kind: str | None = None) -> list[Event]:
        return [e for _, e in self.store.events() if kind is None or e.kind.value == kind]

    async def until(self, done: Callable[[], bool], timeout: float = 30.0) -> None:
        """Wait (bounded) until ``done()``; fail the test saying what the queue holds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while not done():
            if self.task.done():
                self.task.result()  # the worker died: show why
            if loop.time() > deadline:
                pytest.fail(f"not done after {timeout} s: {self.store.counters()}")
            await asyncio.sleep(0.02)


@contextlib.asynccontextmanager
async def running(
    config: Config,
    *,
    clock: Callable[[], int] = wall_clock_ms,
    worker_plugins: PluginHost | None = None,
    core_plugins: PluginHost | None = None,
) -> AsyncIterator[InProc]:
    """The core and one worker of ``default``; stopped (the worker first) on the way out."""
    store = QueueStore.open(Path(config.server.data_dir))
    store.recover()
    service = QueueService.from_config(store, config, clock=clock, plugins=core_plugins)
    socket_path = Path(config.server.ipc_socket)
    server = IpcServer(socket_path, QueueHandler(service, set(config.zones)))
    await server.start()
    client = await IpcClient.connect(socket_path, Hello(zone=ZONE, worker="t", pid=os.getpid()))
    worker = Worker(config, ZONE, client, worker_plugins)
    task = asyncio.create_task(worker.run())
    try:
        yield InProc(config, store, service, worker, task, clock)
    finally:
        worker.stopping.set()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(task, 15)
        await client.close()
        await server.close()
        await store.close()
