"""The fault suite's test bed: remote MX hosts on one port, dnsmasq, and zoneq's config.

zoneq delivers to every MX on one port (``delivery.mx_port``), so each remote host of a
scenario is a different 127.x.y.z address on the same port: smtp-sink for ok.test and
src.test (where DSNs to the sender land), and whatever the scenario needs for its other
domains (a second smtp-sink that rejects, a fault server, or nothing at all: refused).
"""

from __future__ import annotations

import asyncio
import contextlib
import random
import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

from tests.support.dnsmasq import Dnsmasq, running_dnsmasq
from tests.support.serve import write_serve_config
from tests.support.smtpsink import Sink, run_smtp_sink
from zoneq.storage.store import QueueStore

WORKERS = 2  # one process for the default zone, one for the bounce zone
SINK = "sink"  # in ``remotes``: this domain's MX is the bed's smtp-sink


def loopback_ip() -> str:
    """A random address of 127.0.0.0/8 (not 127.0.0.1: other servers of the test use it)."""
    return f"127.{random.randint(1, 250)}.{random.randint(1, 250)}.{random.randint(2, 250)}"


@dataclass
class Bed:
    sink: Sink  # the MX of ok.test and src.test
    dns: Dnsmasq
    directory: Path

    @property
    def port(self) -> int:
        return self.sink.port

    def config(
        self,
        *,
        connections: int = 4,
        retry: str | None = None,
        max_age: str | None = None,
        storage: Mapping[str, str] | None = None,
        receiver: Mapping[str, str] | None = None,
        delivery: Mapping[str, str] | None = None,
        data_dir: Path | None = None,
    ) -> Path:
        """zoneq's config for this bed; ``retry``/``max_age`` for the default zone,
        ``storage``, ``receiver`` and ``delivery`` keys (TOML values as text), ``data_dir``
        for the queue."""
        path = write_serve_config(
            self.directory / "zoneq",
            mx_port=self.port,
            dns_port=self.dns.port,
            connections=connections,
        )
        text = path.read_text()
        zone = [f'retry = "{retry}"'] if retry else []
        zone += [f'max_age = "{max_age}"'] if max_age else []
        if zone:
            text = text.replace("[zones.default]\n", "[zones.default]\n" + "\n".join(zone) + "\n")
        if data_dir is not None:
            text = re.sub(r'^data_dir = ".*"$', f'data_dir = "{data_dir}"', text, flags=re.M)
        if receiver:
            lines = "".join(f"{k} = {v}\n" for k, v in receiver.items())
            text = text.replace("[receiver]\n", "[receiver]\n" + lines)
        if delivery:
            lines = "".join(f"{k} = {v}\n" for k, v in delivery.items())
            text = text.replace("[delivery]\n", "[delivery]\n" + lines)
        if storage:
            text += "\n[storage]\n" + "".join(f"{k} = {v}\n" for k, v in storage.items())
        path.write_text(text)
        return path


@contextlib.contextmanager
def mail_bed(
    directory: Path,
    *sink_options: str,
    port: int | None = None,
    remotes: Mapping[str, str] | None = None,
    backlog: int = 16,
    dns_ttl: int | None = None,
) -> Iterator[Bed]:
    """smtp-sink (with ``sink_options``) as the MX of ok.test and src.test; each domain of
    ``remotes`` gets an MX record pointing at its address (on the same port), or at the
    sink's for :data:`SINK`.  The DNS answers carry ``dns_ttl`` (dnsmasq's 0 if None)."""
    sink_ip = loopback_ip()
    with run_smtp_sink(*sink_options, host=sink_ip, port=port, backlog=backlog) as sink:
        records = []
        hosts = {"ok.test": sink_ip, "src.test": sink_ip, **(remotes or {})}
        for n, (domain, ip) in enumerate(hosts.items()):
            address = sink_ip if ip == SINK else ip
            records += [
                f"mx-host={domain},mx{n}.{domain},10",
                f"host-record=mx{n}.{domain},{address}",
            ]
        with running_dnsmasq(records, directory / "dns", ttl=dns_ttl) as dns:
            yield Bed(sink, dns, directory)


@dataclass
class QueueState:
    messages: int
    counters: dict[bytes, int]
    recount: dict[bytes, int]
    quarantined: int


def inspect_queue(config: Path) -> QueueState:
    """The queue of ``config`` as a fresh store sees it (``zoneq serve`` must be stopped)."""

    async def read() -> QueueState:
        store = QueueStore.open(data_dir_of(config))
        store.recover()
        try:
            for zone in store.zones():
                store.lease(zone, 1_000_000, "inspect")  # decodes every ready record
            counters = {k: v for k, v in store.counters().items() if v}
            recount = {k: v for k, v in store.recount().items() if v}
            return QueueState(store.message_count(), counters, recount, len(store.quarantined))
        finally:
            await store.close()

    return asyncio.run(read())


def data_dir_of(config: Path) -> Path:
    match = re.search(r'^data_dir = "(.*)"$', config.read_text(), flags=re.M)
    assert match, f"no data_dir in {config}"
    return Path(match.group(1))
