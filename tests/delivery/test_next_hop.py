"""The next hop: our own addresses as a loop, address literals, the bound on addresses one
attempt walks (a source that cannot be bound uses none of it), and the A-label envelope for
a server without SMTPUTF8.

Integration tests run the real resolver against dnsmasq and the real attempt against
smtp-sink or a fault server, all on 127.0.0.0/8; the pure parts are table-driven, with
Hypothesis properties for the envelope form of an address.
"""

from __future__ import annotations

import contextlib
import errno
import random
import socket
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import psutil
import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import ValidationError

from tests.receiver.conftest import TlsFiles, tls_files
from tests.storage.conftest import async_test
from tests.support.dnsmasq import Dnsmasq, running_dnsmasq
from tests.support.faultserver import Faults, FaultServer
from tests.support.smtpsink import run_smtp_sink
from zoneq.config import Config
from zoneq.config.zones import PoolAddress
from zoneq.delivery.attempt import Settings, attempt, envelope_address
from zoneq.delivery.hostcache import DeadHostCache
from zoneq.delivery.mx import MxKind, MxResolver, address_literal
from zoneq.delivery.ourselves import ourselves
from zoneq.delivery.pool import SourcePool
from zoneq.delivery.results import TransactionResult
from zoneq.delivery.transport import Timeouts, deliver
from zoneq.delivery.worker import resolver_for
from zoneq.ipc.messages import Job, JobRecipient, Outcome, RecipientReport
from zoneq.protocol.domains import a_label

__all__ = ["tls_files"]  # the fixture, imported for pytest

HELO = "client.zoneq.test"
FAST = Timeouts(greeting=5, ehlo=5, starttls=5, mail=5, rcpt=5, data_init=5, data_end=5)
BODY = b"Subject: next hop\r\n\r\nhello\r\n"
MANY = [f"127.0.42.{n}" for n in range(1, 21)]  # the 20 A records of many.test's one MX
BIND = [f"127.0.44.{n}" for n in range(1, 6)]  # bind.test's MX: these 5 A records, and ::1
RECORDS = [
    "local-ttl=300",
    "mx-host=own.test,mx.own.test,10",
    "host-record=mx.own.test,127.0.41.1",
    "mx-host=pool.test,mx.pool.test,10",
    "host-record=mx.pool.test,192.0.2.7",
    "mx-host=many.test,mx.many.test,10",
    *(f"host-record=mx.many.test,{address}" for address in MANY),
    "host-record=xn--bcher-kva.test,127.0.43.1",
    "mx-host=bind.test,mx.bind.test,10",
    *(f"host-record=mx.bind.test,{address}" for address in BIND),
    "host-record=mx.bind.test,::1",
    "mx-host=zero.test,mx.zero.test,10",
    "host-record=mx.zero.test,0.0.0.0",
    "mx-host=zero6.test,mx.zero6.test,10",
    "host-record=mx.zero6.test,::",
]


@pytest.fixture(scope="module")
def dns(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dnsmasq]:
    with running_dnsmasq(RECORDS, tmp_path_factory.mktemp("dns")) as server:
        yield server


def config(dns: Dnsmasq, **receiver: Any) -> Config:
    """A config of the test bed's kind (loopback MX allowed, MX port 2500)."""
    return Config.model_validate(
        {
            "receiver": receiver,
            "zones": {"default": {}, "bounces": {}},
            "delivery": {
                "nameservers": ["127.0.0.1"],
                "dns_port": dns.port,
                "mx_port": 2500,
                "allow_loopback_mx": True,
            },
        }
    )


def resolver(dns: Dnsmasq, **overrides: Any) -> MxResolver:
    settings: dict[str, Any] = {
        "nameservers": ["127.0.0.1"],
        "port": dns.port,
        "clock": time.monotonic,
        "rng": random.Random(0),
        "timeout": 2,
        "lifetime": 3,
        "allow_loopback": True,
        "own_names": {HELO},
    }
    return MxResolver(**(settings | overrides))


def job(domain: str, *addresses: str, smtputf8: bool = False, body: bytes = BODY) -> Job:
    return Job(
        msg_id=1,
        sender="s@src.test",
        size=len(body),
        chunks=1,
        domain=domain,
        smtputf8=smtputf8,
        recipients=tuple(JobRecipient(token=n, address=a) for n, a in enumerate(addresses)),
    )


async def run(
    the_job: Job, res: MxResolver, port: int, body: bytes = BODY, **settings: Any
) -> Sequence[RecipientReport]:
    return await attempt(
        the_job,
        settings=Settings(helo_name=HELO, port=port, timeouts=FAST, **settings),
        resolver=res,
        dead_hosts=DeadHostCache(clock=time.monotonic, base=60),
        body=lambda: [body],
    )


# --- 1: our own addresses are a loop ------------------------------------------------------


@pytest.mark.integration
@pytest.mark.parametrize(
    ("receiver", "kind"),
    [
        # The receiver listens where the MX points, at the port delivery connects to.
        ({"listen": "127.0.41.1:2500"}, MxKind.LOOP),
        ({"listen": "127.0.0.1:2525", "tls_listen": "127.0.41.1:2500"}, MxKind.LOOP),
        # A wildcard at the delivery port takes every loopback address.
        ({"listen": "0.0.0.0:2500"}, MxKind.LOOP),
        # Another port on that address is another server (the test bed's sinks).
        ({"listen": "127.0.41.1:2525"}, MxKind.HOSTS),
        ({"listen": "127.0.0.1:2500"}, MxKind.HOSTS),
    ],
)
@async_test
async def test_resolver_for_a_config_listening_where_the_mx_points(
    dns: Dnsmasq, tls_files: TlsFiles, receiver: dict[str, str], kind: MxKind
) -> None:
    if "tls_listen" in receiver:  # implicit TLS needs a certificate in the config
        receiver = receiver | {"tls_cert": str(tls_files.cert), "tls_key": str(tls_files.key)}
    result = await resolver_for(config(dns, **receiver)).resolve("own.test")
    assert result.kind is kind
    if kind is MxKind.LOOP:
        assert str(result.status) == "5.4.6" and "loops back to myself" in result.reason


@pytest.mark.integration
@async_test
async def test_resolver_for_a_config_with_the_mx_address_in_a_pool(dns: Dnsmasq) -> None:
    cfg = config(dns).model_copy(deep=True)
    plain = await resolver_for(cfg).resolve("pool.test")
    assert plain.kind is MxKind.HOSTS
    pooled = Config.model_validate(
        cfg.model_dump()
        | {"zones": {"default": {"pool": [{"address": "192.0.2.7"}]}, "bounces": {}}}
    )
    assert (await resolver_for(pooled).resolve("pool.test")).kind is MxKind.LOOP


class _Addr(NamedTuple):
    family: int
    address: str


def _interfaces() -> Mapping[str, Sequence[_Addr]]:
    return {
        "lo": [_Addr(socket.AF_INET, "127.0.0.1"), _Addr(socket.AF_INET6, "::1")],
        "eth0": [
            _Addr(socket.AF_INET, "198.51.100.4"),
            _Addr(socket.AF_INET6, "fe80::4%eth0"),
            _Addr(socket.AF_PACKET, "52:54:00:12:34:56"),
        ],
    }


@pytest.mark.parametrize(
    ("listen", "allow_loopback", "addresses", "loopback_allowed"),
    [
        ("127.0.0.1:2500", True, {"127.0.0.1"}, True),
        ("127.0.0.1:2525", True, set(), True),
        ("127.0.0.1:2525", False, {"127.0.0.1"}, False),
        ("198.51.100.9:2525", True, {"198.51.100.9"}, True),
        ("0.0.0.0:2525", False, {"127.0.0.1", "198.51.100.4"}, False),
        ("0.0.0.0:2525", True, {"198.51.100.4"}, True),
        ("0.0.0.0:2500", True, {"127.0.0.1", "198.51.100.4"}, False),
        ("[::]:2525", False, {"127.0.0.1", "::1", "198.51.100.4", "fe80::4"}, False),
        ("localhost:2500", False, set(), False),
    ],
)
def test_ourselves_from_listeners(
    tmp_path: Path, listen: str, allow_loopback: bool, addresses: set[str], loopback_allowed: bool
) -> None:
    cfg = Config.model_validate(
        {
            "receiver": {"listen": listen},
            "zones": {"default": {}, "bounces": {}},
            "delivery": {"mx_port": 2500, "allow_loopback_mx": allow_loopback},
        }
    )
    us = ourselves(cfg, _interfaces)
    assert us.addresses == addresses
    assert us.allow_loopback is loopback_allowed


@pytest.mark.parametrize(
    "refusal",
    [
        PermissionError(errno.EPERM, "Operation not permitted"),  # getifaddrs, locked down
        psutil.AccessDenied(msg="Operation not permitted"),
    ],
)
@pytest.mark.parametrize(
    ("receiver", "addresses"),
    [
        (
            {"listen": "0.0.0.0:2525", "tls_listen": "198.51.100.9:465"},
            {"198.51.100.9", "192.0.2.8"},
        ),
        ({"listen": "[::]:2525", "tls_listen": "0.0.0.0:465"}, {"192.0.2.8"}),  # one warning
    ],
)
def test_ourselves_without_an_interface_list_keeps_listeners_and_pools(
    caplog: pytest.LogCaptureFixture,
    refusal: Exception,
    tls_files: TlsFiles,
    receiver: dict[str, str],
    addresses: set[str],
) -> None:
    # A worker that raised here died at start, on every restart: its zone delivered nothing.
    receiver = receiver | {"tls_cert": str(tls_files.cert), "tls_key": str(tls_files.key)}
    cfg = Config.model_validate(
        {
            "receiver": receiver,
            "zones": {"default": {"pool": [{"address": "192.0.2.8"}]}, "bounces": {}},
            "delivery": {"mx_port": 2500},
        }
    )

    def refused() -> Mapping[str, Sequence[_Addr]]:
        raise refusal

    with caplog.at_level("WARNING", logger="zoneq.delivery"):
        us = ourselves(cfg, refused)
    assert us.addresses == addresses
    assert us.allow_loopback is False
    [warning] = [r for r in caplog.records if "interface addresses" in r.getMessage()]
    assert "Operation not permitted" in warning.getMessage()


# --- 2: address literals ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("literal", "expected"),
    [
        ("[192.0.2.1]", "192.0.2.1"),
        ("[IPv6:2001:db8::1]", "2001:db8::1"),
        ("[ipv6:2001:DB8::1]", "2001:db8::1"),
        ("[IPv6:::ffff:192.0.2.1]", "::ffff:c000:201"),
    ],
)
def test_address_literal(literal: str, expected: str) -> None:
    parsed = address_literal(literal)
    assert not isinstance(parsed, str), parsed  # an address, not a refusal
    assert str(parsed) == expected


@pytest.mark.parametrize(
    ("literal", "expected"),
    [
        ("[2001:db8::1]", "only IPv4 and IPv6"),
        ("[x400:some-thing]", "only IPv4 and IPv6"),
        ("[192.0.2.256]", "is not an IPv4 address"),
        ("[192.0.2]", "is not an IPv4 address"),
        ("[IPv6:192.0.2.1]", "is not an IPv6 address"),
        ("[]", "is not an IPv4 address"),
        ("192.0.2.1", "not enclosed"),
    ],
)
def test_a_bad_address_literal_is_refused(literal: str, expected: str) -> None:
    parsed = address_literal(literal)
    assert isinstance(parsed, str) and expected in parsed


@pytest.mark.parametrize("allow_loopback", [False, True])
@pytest.mark.parametrize(
    ("literal", "kind"),
    [
        # The unspecified address reaches this host's listeners (a connect() to 0.0.0.0
        # is taken by a 127.0.0.1 listener on Linux): ours, even with loopback allowed.
        ("[0.0.0.0]", MxKind.LOOP),
        ("[IPv6:::]", MxKind.LOOP),
        ("[IPv6:::ffff:0.0.0.0]", MxKind.LOOP),
        ("[IPv6:0:0:0:0:0:0:0:0]", MxKind.LOOP),
        # Our own address, also as IPv4-mapped.
        ("[127.0.0.1]", MxKind.LOOP),
        ("[IPv6:::ffff:127.0.0.1]", MxKind.LOOP),
        ("[192.0.2.8]", MxKind.LOOP),
        ("[IPv6:::ffff:192.0.2.8]", MxKind.LOOP),
        # Someone else.
        ("[192.0.2.9]", MxKind.HOSTS),
        ("[IPv6:2001:db8::9]", MxKind.HOSTS),
        ("[IPv6:::ffff:192.0.2.9]", MxKind.HOSTS),
    ],
)
def test_which_literals_are_ourselves(literal: str, kind: MxKind, allow_loopback: bool) -> None:
    res = MxResolver(
        nameservers=["127.0.0.1"],  # never asked: a literal needs no DNS
        clock=time.monotonic,
        rng=random.Random(0),
        own_addresses={"127.0.0.1", "::ffff:192.0.2.8"},
        allow_loopback=allow_loopback,
    )
    result = res.literal(literal)
    assert result.kind is kind, result.reason
    if kind is MxKind.LOOP:
        assert str(result.status) == "5.4.6"


@pytest.mark.integration
@pytest.mark.parametrize("domain", ["zero.test", "zero6.test"])
@async_test
async def test_an_mx_host_at_the_unspecified_address_is_a_loop(dns: Dnsmasq, domain: str) -> None:
    result = await resolver(dns).resolve(domain)  # loopback allowed, as in the test bed
    assert result.kind is MxKind.LOOP, result.reason
    assert "loops back to myself" in result.reason


@pytest.mark.integration
@async_test
async def test_a_literal_recipient_is_delivered_to_its_address(dns: Dnsmasq) -> None:
    with run_smtp_sink() as sink:
        domain = f"[{sink.host}]"
        reports = await run(job(domain, f"u@{domain}"), resolver(dns), sink.port)
        assert [r.outcome for r in reports] == [Outcome.DELIVERED]
        assert reports[0].mx == sink.host
        [message] = sink.messages(1)
        assert message.rcpt_args == [f"<u@{domain}>"]


@pytest.mark.integration
@async_test
async def test_a_literal_of_our_own_address_is_a_loop(dns: Dnsmasq) -> None:
    with run_smtp_sink() as sink:
        domain = f"[{sink.host}]"
        own = resolver(dns, own_addresses={sink.host})
        [report] = await run(job(domain, f"u@{domain}"), own, sink.port)
        assert report.outcome is Outcome.BOUNCED and report.enhanced == "5.4.6"
        assert "loops back to myself" in (report.reply or "")
        # Without allow_loopback every loopback literal is ourselves too.
        [report] = await run(job(domain, f"u@{domain}"), resolver(dns, allow_loopback=False), 1)
        assert report.enhanced == "5.4.6"
        assert not list(sink.dump_dir.glob("msg.*"))


@pytest.mark.integration
@pytest.mark.parametrize("domain", ["[127.0.0.300]", "[::1]", "[tag:x]"])
@async_test
async def test_a_malformed_literal_bounces_5_1_3(dns: Dnsmasq, domain: str) -> None:
    [report] = await run(job(domain, f"u@{domain}"), resolver(dns), 1)
    assert report.outcome is Outcome.BOUNCED and report.enhanced == "5.1.3"
    assert "not a valid address literal" in (report.reply or "")


@pytest.mark.integration
@async_test
async def test_an_ipv6_literal_goes_to_its_address(dns: Dnsmasq) -> None:
    # Test servers listen on 127.0.0.0/8 only: an IPv4-mapped IPv6 address reaches one.
    async with FaultServer(Faults(), host="127.0.43.2", port=0) as server:
        domain = "[IPv6:::ffff:127.0.43.2]"
        [report] = await run(job(domain.lower(), f"u@{domain}"), resolver(dns), server.port)
        assert report.outcome is Outcome.DELIVERED
        assert f"RCPT TO:<u@{domain}>".encode() in server.commands()
        [refused] = await run(
            job(domain.lower(), f"u@{domain}"), resolver(dns), server.port, ipv6=False
        )
        assert refused.outcome is Outcome.BOUNCED
        assert "IPv6 is turned off" in (refused.reply or "")
        assert len(server.sessions) == 1


# --- 3: the addresses one attempt walks are bounded ---------------------------------------


@contextlib.asynccontextmanager
async def refusing_hosts(addresses: Sequence[str]) -> AsyncIterator[tuple[int, list[FaultServer]]]:
    """A fault server greeting 421 at each address, all on one port: a live host that will
    not talk, so the walk goes on to the next address and the dead-host cache stays out."""
    async with contextlib.AsyncExitStack() as stack:
        port, started = 0, []
        for address in addresses:
            server = FaultServer(Faults(greeting=b"421 4.3.2 busy"), host=address, port=port)
            started.append(await stack.enter_async_context(server))
            port = server.port
        yield port, started


@pytest.mark.integration
@pytest.mark.parametrize("bound", [5, 2])
@async_test
async def test_one_mx_with_20_addresses_is_tried_at_most_the_bound(
    dns: Dnsmasq, bound: int
) -> None:
    async with refusing_hosts(MANY) as (port, servers):
        [report] = await run(
            job("many.test", "a@many.test"), resolver(dns), port, max_addresses=bound
        )
        assert report.outcome is Outcome.DEFERRED
        assert sum(len(server.sessions) for server in servers) == bound


@pytest.mark.integration
@async_test
async def test_a_source_that_cannot_be_bound_uses_none_of_the_bound(dns: Dnsmasq) -> None:
    """The zone's IPv4 source left the host (EADDRNOTAVAIL): its first bind failure ends
    IPv4 for the walk and counts for nothing, so the IPv6 address behind bind.test's 5 A
    records is still tried, though the bound is 5.  Every attempt used to spend the bound on
    5 failed binds, and the mail expired."""
    pool = SourcePool([PoolAddress(address="192.0.2.99"), PoolAddress(address="::1")], HELO)
    tried: list[tuple[str, str | None]] = []

    async def send(**kwargs: Any) -> TransactionResult:
        tried.append((kwargs["host"], kwargs["source_address"]))
        return await deliver(**kwargs)

    dead = DeadHostCache(clock=time.monotonic, base=60)
    with run_smtp_sink(host="::1") as sink:
        settings = Settings(
            helo_name=HELO, port=sink.port, timeouts=FAST, sources=pool, max_addresses=5
        )
        [report] = await attempt(
            job("bind.test", "a@bind.test"),
            settings=settings,
            resolver=resolver(dns),
            dead_hosts=dead,
            body=lambda: [BODY],
            send=send,
        )
        assert report.outcome is Outcome.DELIVERED, report.reply
        assert report.source_ip == "::1"
        assert len(sink.messages(1)) == 1
    [(first, source), last] = tried
    assert first in BIND and source == "192.0.2.99"
    assert last == ("::1", "::1")
    assert not any(dead.is_dead(address) for address in BIND)  # our fault, not theirs


def test_max_mx_addresses_defaults_to_5_and_must_be_positive() -> None:
    base = {"zones": {"default": {}, "bounces": {}}}
    assert Config.model_validate(base).delivery.max_mx_addresses == 5
    with pytest.raises(ValidationError, match="max_mx_addresses"):
        Config.model_validate(base | {"delivery": {"max_mx_addresses": 0}})


# --- 4: an ASCII local part at a U-label domain goes as an A-label ------------------------


@pytest.mark.parametrize(
    ("address", "sent"),
    [
        ("bob@bücher.test", "bob@xn--bcher-kva.test"),
        ("Bob@BÜCHER.test", "Bob@xn--bcher-kva.test"),
        ("bob@xn--bcher-kva.test", "bob@xn--bcher-kva.test"),
        ("jösé@bücher.test", "jösé@bücher.test"),  # no ASCII form of the local part
        ("bob@example.test", "bob@example.test"),
        ("bob@[192.0.2.1]", "bob@[192.0.2.1]"),
        ("bob@-bad-ü-.test", "bob@-bad-ü-.test"),  # IDNA refuses it: the server judges
        ("", ""),  # the null sender
        ("postmaster", "postmaster"),
    ],
)
def test_envelope_address(address: str, sent: str) -> None:
    assert envelope_address(address) == sent


@given(
    local=st.from_regex(r"[a-z0-9.+_-]{1,20}", fullmatch=True),
    label=st.text("abcüöäéß", min_size=1, max_size=10),
)
def test_envelope_address_is_ascii_for_an_ascii_local_part(local: str, label: str) -> None:
    address = f"{local}@{label}.test"
    sent = envelope_address(address)
    try:
        domain = a_label(f"{label}.test")
    except ValueError:
        assert sent == address
    else:
        assert sent == f"{local}@{domain}" and sent.isascii()
    assert envelope_address(sent) == sent  # a fixed point


@pytest.mark.integration
@async_test
async def test_a_u_label_domain_goes_as_its_a_label_to_a_server_without_smtputf8(
    dns: Dnsmasq,
) -> None:
    async with FaultServer(Faults(smtputf8=False), host="127.0.43.1", port=0) as server:
        # As the receiver queues it: the client had to say SMTPUTF8 for that address.
        the_job = job("xn--bcher-kva.test", "bob@bücher.test", "jösé@bücher.test", smtputf8=True)
        bob, jose = await run(the_job, resolver(dns), server.port)
        assert bob.outcome is Outcome.DELIVERED
        assert jose.outcome is Outcome.BOUNCED and jose.enhanced == "5.6.7"
        rcpts = [c for c in server.commands() if c.startswith(b"RCPT")]
        assert rcpts == [b"RCPT TO:<bob@xn--bcher-kva.test>"]
        assert not any(b"SMTPUTF8" in c for c in server.commands())


@pytest.mark.integration
@async_test
async def test_utf8_headers_still_need_smtputf8(dns: Dnsmasq) -> None:
    body = "Subject: grüße\r\n\r\nhello\r\n".encode()
    async with FaultServer(Faults(smtputf8=False), host="127.0.43.1", port=0) as server:
        the_job = job("xn--bcher-kva.test", "bob@bücher.test", smtputf8=True, body=body)
        [report] = await run(the_job, resolver(dns), server.port, body=body)
        assert report.outcome is Outcome.BOUNCED and report.enhanced == "5.6.7"
        assert b"MAIL" not in server.verbs()
