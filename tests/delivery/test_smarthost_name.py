"""A smarthost given by name is resolved by zoneq's own resolver, as a host, never as an MX.

dnsmasq (``tests/support/dnsmasq.py``, with ``log-queries``) is the only place the names
below exist: they are in no /etc/hosts and no public DNS, so a connection left to the
system's resolver could not reach the relay.  The relay is Postfix's smtp-sink, or zoneq's
own receiver where TLS is checked.  The recipients' domains are ``.invalid``: nobody could
resolve them, and nobody asks (the relay routes).
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.delivery.inproc import config_for, running
from tests.delivery.test_address_family import ipv6_loopback
from tests.delivery.test_mx import servfail_server
from tests.delivery.test_smarthost import RECIPIENT, first_deferral, relay
from tests.receiver.conftest import HOSTNAME, TlsFiles, tls_files
from tests.storage.conftest import async_test
from tests.support.dnsmasq import Dnsmasq, running_dnsmasq, silent_udp_port
from tests.support.smtpsink import Sink, run_smtp_sink
from zoneq.config import Config
from zoneq.config.zones import Smarthost
from zoneq.delivery.mx import MxHost, MxKind, MxResolver
from zoneq.delivery.worker import relay_for
from zoneq.protocol.replies import EnhancedStatus

pytestmark = pytest.mark.integration
__all__ = ["tls_files"]  # the fixture, imported for pytest

RELAY = "relay.smarthost.test"
QUESTION = re.compile(r"query\[(\w+)\] (\S+) from ")


def questions(dns: Dnsmasq, at_least: int = 0) -> Counter[str]:
    """The questions dnsmasq logged, as ``"A relay.smarthost.test"``, its start-up probe
    left out; once there are ``at_least`` of them or a second went by."""
    deadline = time.monotonic() + 1.0
    while True:
        text = dns.log.read_text(errors="replace")
        asked = Counter(f"{t} {n}" for t, n in QUESTION.findall(text) if n != "probe.test")
        if asked.total() >= at_least or time.monotonic() > deadline:
            return asked
        time.sleep(0.02)


def smarthost(host: str, port: int, **zone: Any) -> dict[str, Any]:
    """``[zones.default]`` relaying through ``host`` without TLS (smtp-sink offers none)."""
    return {"smarthost": {"host": host, "port": port, "tls": "none"}, **zone}


def named_config(directory: Path, dns: Dnsmasq, zone: dict[str, Any], **delivery: Any) -> Config:
    return config_for(directory, dns, 1, zone, delivery=delivery)


@pytest.fixture
def sink() -> Iterator[Sink]:
    with run_smtp_sink() as running_sink:
        yield running_sink


async def deliver_one_by_one(config: Config, count: int) -> list[str | None]:
    """Queue ``count`` messages to as many domains, each once the one before is delivered
    (so each is its own attempt, after the answer of the first was cached); their MX."""
    async with running(config) as core:
        for number in range(count):
            await core.queue([f"user{number}@domain{number}.invalid"])
            await core.until(lambda done=number + 1: len(core.events("delivered")) == done)
        assert core.events("deferred") == core.events("bounced") == []
        return [event.mx for event in core.events("delivered")]


def test_a_named_smarthost_is_asked_of_zoneqs_resolver_once_and_reached(
    tmp_path: Path, sink: Sink
) -> None:
    """Three attempts through ``relay.smarthost.test``: A and AAAA are asked once (the
    answers carry a TTL of 300 s and are cached), no MX ever, and the sink has all three."""
    records = ["log-queries", f"host-record={RELAY},{sink.host}"]
    with running_dnsmasq(records, tmp_path / "dns", ttl=300) as dns:
        config = named_config(tmp_path, dns, smarthost(RELAY, sink.port))
        assert asyncio.run(deliver_one_by_one(config, 3)) == [RELAY] * 3
        assert questions(dns, 2) == Counter({f"A {RELAY}": 1, f"AAAA {RELAY}": 1})
    received = sink.messages(3)
    assert sorted(m.rcpt_args[0] for m in received) == [
        f"<user{n}@domain{n}.invalid>" for n in range(3)
    ]


@pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6 loopback here")
def test_an_ipv4_pool_never_asks_for_or_dials_the_smarthosts_ipv6_address(
    tmp_path: Path,
) -> None:
    """The relay's name has only an IPv6 address, where a sink listens.  A zone whose pool
    is IPv4 only does not ask for it and defers (4.4.4, the operator's to fix); the same
    zone without a pool asks and delivers there over IPv6, so the address was reachable."""
    with (
        run_smtp_sink(host="::1") as sink,
        running_dnsmasq(["log-queries", f"host-record={RELAY},::1"], tmp_path / "dns") as dns,
    ):
        pool = [{"address": "127.0.0.2"}]
        ipv4_only = named_config(tmp_path, dns, smarthost(RELAY, sink.port, pool=pool))
        event = asyncio.run(first_deferral(ipv4_only))
        assert questions(dns, 1) == Counter({f"A {RELAY}": 1})
        assert sink.messages(0) == []
        assert event.enhanced == "4.4.4" and event.mx is None
        pool_says = "and the zone's source pool has no IPv6 address"
        assert f"host {RELAY} has no IPv4 address, {pool_says}" in (event.text or ""), event

        (tmp_path / "again").mkdir()
        any_family = named_config(tmp_path / "again", dns, smarthost(RELAY, sink.port))
        assert asyncio.run(deliver_one_by_one(any_family, 1)) == [RELAY]
        assert questions(dns, 3)[f"AAAA {RELAY}"] == 1
        assert [m.client_addr for m in sink.messages(1)] == ["ipv6:::1"]


@pytest.mark.parametrize("failure", ["timeout", "SERVFAIL"])
def test_a_smarthost_lookup_that_fails_defers_every_recipient_with_4_4_3(
    tmp_path: Path, sink: Sink, failure: str
) -> None:
    """A resolver that times out or answers SERVFAIL says nothing about the relay: the
    recipient waits in the queue (4.4.3), the reply names the smarthost, the sink has
    nothing."""
    with (
        silent_udp_port() as silent,
        servfail_server() as servfail,
        running_dnsmasq([f"server=/{RELAY}/127.0.0.1#{silent}"], tmp_path / "dns") as dns,
    ):
        zone = smarthost(RELAY, sink.port)
        delivery: dict[str, Any] = {"dns_timeout": "1s"}
        if failure == "SERVFAIL":
            delivery["dns_port"] = servfail
        event = asyncio.run(first_deferral(named_config(tmp_path, dns, zone, **delivery)))
    assert event.enhanced == "4.4.3" and event.code is None
    text = event.text or ""
    assert RELAY in text and "smarthost" in text, event
    assert ("timed out" if failure == "timeout" else "SERVFAIL") in text, event
    assert sink.messages(0) == []


@pytest.mark.parametrize(
    ("records", "says"),
    [
        ([], f"host {RELAY} does not exist (NXDOMAIN)"),
        ([f'txt-record={RELAY},"a name without an address"'], f"host {RELAY} has no address"),
    ],
    ids=["nxdomain", "no-address"],
)
def test_a_smarthost_name_without_an_address_defers_and_never_bounces(
    tmp_path: Path, sink: Sink, records: list[str], says: str
) -> None:
    """The smarthost's name is the operator's configuration, not the recipient's fault:
    NXDOMAIN or no address record defers (4.4.4, unable to route) and keeps the mail."""
    with running_dnsmasq(records, tmp_path / "dns") as dns:
        config = named_config(tmp_path, dns, smarthost(RELAY, sink.port))
        event = asyncio.run(first_deferral(config))
    assert event.enhanced == "4.4.4" and event.code is None
    assert event.text == f"451 4.4.4 the zone's smarthost cannot be resolved: {says}"
    assert sink.messages(0) == []


@pytest.mark.parametrize(
    "family",
    [4, pytest.param(6, marks=pytest.mark.skipif(not ipv6_loopback(), reason="no IPv6"))],
)
def test_an_address_literal_smarthost_asks_no_dns_at_all(tmp_path: Path, family: int) -> None:
    """``[127.0.0.x]`` and ``[IPv6:::1]`` (RFC 5321 section 4.1.3) are connected to as they
    are: the sink has the mail, reported under the address, and dnsmasq was asked nothing."""
    host = "::1" if family == 6 else None
    with (
        run_smtp_sink(host=host) as sink,
        running_dnsmasq(["log-queries"], tmp_path / "dns") as dns,
    ):
        literal = f"[IPv6:{sink.host}]" if family == 6 else f"[{sink.host}]"
        config = named_config(tmp_path, dns, smarthost(literal, sink.port))
        assert asyncio.run(deliver_one_by_one(config, 2)) == [sink.host] * 2
        assert questions(dns) == Counter()
        assert len(sink.messages(2)) == 2


@pytest.mark.parametrize(
    ("name", "delivered"),
    [(HOSTNAME, True), ("other.smarthost.test", False)],
    ids=["certificate-name", "another-name"],
)
@async_test
async def test_required_tls_checks_the_certificate_against_the_smarthosts_name(
    tmp_path: Path,
    tls_files: TlsFiles,
    monkeypatch: pytest.MonkeyPatch,
    name: str,
    delivered: bool,
) -> None:
    """Both names resolve to 127.0.0.1, which the relay's certificate also lists (as an IP
    subjectAltName), and the certificate is trusted here: only a check against the
    configured name (RFC 6125 section 6) tells the two apart."""
    monkeypatch.setenv("SSL_CERT_FILE", str(tls_files.cert))
    records = [f"host-record={name},127.0.0.1"]
    async with relay(tmp_path, tls_files) as (port, relayed):
        with running_dnsmasq(records, tmp_path / "dns") as dns:
            zone = {"smarthost": {"host": name, "port": port, "tls": "required"}}
            server = {"hostname": "client.zoneq.test"}
            config = config_for(tmp_path, dns, 1, zone, server=server)
            if not delivered:
                event = await first_deferral(config)
                assert event.enhanced == "4.7.5", event
                assert "Hostname mismatch" in (event.text or ""), event  # OpenSSL's reason
                assert relayed.message_count() == 0
                return
            async with running(config) as core:
                await core.queue([RECIPIENT])
                await core.until(lambda: core.store.message_count() == 0)
                (event,) = core.events("delivered")
        assert event.mx == HOSTNAME
        (lease,) = relayed.lease("default", 10, "test")
        assert relayed.message(lease.recipient.msg_id).source["tls"] in ("TLSv1.2", "TLSv1.3")


@pytest.fixture(scope="module")
def zone_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dnsmasq]:
    records = [
        "local-ttl=300",
        "host-record=both.host.test,127.0.0.7,::1",
        "host-record=v6.host.test,::1",
        "host-record=link.host.test,169.254.0.1",
        "host-record=link.host.test,127.0.0.8",
        'txt-record=txt.host.test,"no address"',
        # An MX record is no address: the host's own A is what counts, never its MX.
        "mx-host=mxonly.host.test,both.host.test,10",
    ]
    with running_dnsmasq(records, tmp_path_factory.mktemp("dns")) as server:
        yield server


@pytest.mark.parametrize(
    ("name", "ipv6", "kind", "addresses"),
    [
        ("both.host.test", True, MxKind.HOSTS, ("127.0.0.7", "::1")),
        ("Both.Host.Test.", True, MxKind.HOSTS, ("127.0.0.7", "::1")),
        ("both.host.test", False, MxKind.HOSTS, ("127.0.0.7",)),
        ("v6.host.test", True, MxKind.HOSTS, ("::1",)),
        ("v6.host.test", False, MxKind.UNROUTABLE, ()),
        ("link.host.test", True, MxKind.HOSTS, ("127.0.0.8",)),  # link-local is unusable
        ("txt.host.test", True, MxKind.UNROUTABLE, ()),
        ("mxonly.host.test", True, MxKind.UNROUTABLE, ()),
        ("missing.host.test", True, MxKind.NO_DOMAIN, ()),
        ("", True, MxKind.NO_DOMAIN, ()),
    ],
)
def test_resolve_host_gives_one_hosts_addresses_and_no_mx(
    zone_server: Dnsmasq, name: str, ipv6: bool, kind: MxKind, addresses: tuple[str, ...]
) -> None:
    """``MxResolver.resolve_host``: IPv4 then IPv6, as for an MX host; loopback is allowed
    (no loop check: the operator named the host) even without ``allow_loopback``."""
    resolver = MxResolver(
        nameservers=["127.0.0.1"],
        port=zone_server.port,
        clock=time.monotonic,
        rng=random.Random(0),
        lifetime=2.0,
    )
    result = asyncio.run(resolver.resolve_host(name, ipv6=ipv6))
    assert result.kind is kind, result
    if kind is MxKind.HOSTS:
        host = name.rstrip(".").lower()
        assert result.hosts == (MxHost(host, 0, addresses),) and result.status is None
    else:
        assert result.hosts == () and result.permanent
        assert result.status in (EnhancedStatus(5, 1, 2), EnhancedStatus(5, 4, 4))


@pytest.mark.parametrize(
    ("configured", "host"),
    [
        ("relay.example", "relay.example"),
        ("[relay.example]", "relay.example"),  # Postfix's [name]: no MX, still a name
        ("[192.0.2.25]", "192.0.2.25"),
        ("192.0.2.25", "192.0.2.25"),
        ("[IPv6:2001:db8::25]", "2001:db8::25"),
        ("[ipv6:2001:db8::25]", "2001:db8::25"),  # RFC 5234: ABNF strings ignore case
        ("[::1]", "::1"),
    ],
)
def test_the_configured_smarthost_reaches_the_attempt_as_a_name_or_an_address(
    configured: str, host: str
) -> None:
    smart = relay_for(Smarthost.model_validate({"host": configured}))
    assert smart is not None and smart.host == host
