"""MX resolution against a real dnsmasq, and the answer cache with a moved clock.

The integration tests share one dnsmasq (module scope) serving the zone below; the cache
test starts its own, because it stops the server half-way to prove answers come from the
cache.  Loopback addresses stand in for real servers, so most tests pass
``allow_loopback=True``; one test checks that without it they count as a loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import random
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dns.message
import dns.rcode
import dns.rrset
import pytest

from tests.support.dnsmasq import Dnsmasq, running_dnsmasq, silent_udp_port
from zoneq.delivery.mx import (
    DEFAULT_NEGATIVE_TTL,
    AnswerCache,
    DnsAnswer,
    DnsOutcome,
    MxHost,
    MxKind,
    MxResolver,
    MxResult,
    negative_ttl,
)
from zoneq.protocol.replies import EnhancedStatus

EQUAL = ("a.eq.test", "b.eq.test", "c.eq.test")


def zone(silent_port: int) -> list[str]:
    return [
        "local-ttl=300",
        # Two MX at different preferences.
        "mx-host=ok.test,mx1.ok.test,10",
        "mx-host=ok.test,mx2.ok.test,20",
        "host-record=mx1.ok.test,127.0.0.11",
        "host-record=mx2.ok.test,127.0.0.12",
        # No MX: implicit MX via the domain's own A record.
        "host-record=amx.test,127.0.0.13",
        # No MX and no address at all (a TXT record so the name exists).
        'txt-record=txtonly.test,"no mail here"',
        # RFC 7505 null MX: preference 0, exchange the root.
        "dns-rr=nullmx.test,15,000000",
        # NXDOMAIN.
        "address=/nx.test/",
        # A dead upstream: queries under tempfail.test time out.
        f"server=/tempfail.test/127.0.0.1#{silent_port}",
        # Three MX at one preference and a backup.
        *(f"mx-host=eq.test,{name},10" for name in EQUAL),
        "mx-host=eq.test,backup.eq.test,20",
        "host-record=a.eq.test,127.0.0.21",
        "host-record=b.eq.test,127.0.0.22",
        "host-record=c.eq.test,127.0.0.23",
        "host-record=backup.eq.test,127.0.0.24",
        # The best MX host has no address; the second has one.
        "mx-host=partial.test,nothing.partial.test,10",
        "mx-host=partial.test,mx.partial.test,20",
        "host-record=mx.partial.test,127.0.0.31",
        # No MX host has an address.
        "mx-host=noaddr.test,nothing.noaddr.test,10",
        # Loops: the best host is us; or a better host exists and the worse ones are dropped.
        "mx-host=loop.test,self.loop.test,10",
        "mx-host=loop.test,other.loop.test,20",
        "host-record=self.loop.test,127.0.0.41",
        "host-record=other.loop.test,127.0.0.42",
        "mx-host=backup.test,primary.backup.test,10",
        "mx-host=backup.test,self.backup.test,20",
        "mx-host=backup.test,worse.backup.test,30",
        "host-record=primary.backup.test,127.0.0.51",
        "host-record=self.backup.test,127.0.0.41",
        "host-record=worse.backup.test,127.0.0.52",
        # IPv4 and IPv6; IPv6 only.
        "host-record=v6.test,127.0.0.14,::1",
        "host-record=v6only.test,::1",
        # One MX host times out, the other answers; every MX host times out.
        "mx-host=slowmx.test,dead.tempfail.test,10",
        "mx-host=slowmx.test,mx1.ok.test,20",
        "mx-host=allslow.test,dead.tempfail.test,10",
    ]


class FakeClock:
    """Monotonic seconds that move only when the test says so."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture(scope="module")
def dns_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dnsmasq]:
    with (
        silent_udp_port() as silent,
        running_dnsmasq(zone(silent), tmp_path_factory.mktemp("dnsmasq")) as server,
    ):
        yield server


def make_resolver(port: int, **overrides: Any) -> MxResolver:
    settings: dict[str, Any] = {
        "nameservers": ["127.0.0.1"],
        "port": port,
        "clock": FakeClock(),
        "rng": random.Random(0),
        "timeout": 1.0,
        "lifetime": 1.0,
        "allow_loopback": True,
    }
    settings.update(overrides)
    return MxResolver(**settings)


def resolve(resolver: MxResolver, domain: str, *, ipv6: bool = True) -> MxResult:
    return asyncio.run(resolver.resolve(domain, ipv6=ipv6))


# --- against dnsmasq -------------------------------------------------------------------


@pytest.mark.integration
def test_hosts_in_preference_order(dns_server: Dnsmasq) -> None:
    result = resolve(make_resolver(dns_server.port), "ok.test")
    assert result.kind is MxKind.HOSTS
    assert result.hosts == (
        MxHost("mx1.ok.test", 10, ("127.0.0.11",)),
        MxHost("mx2.ok.test", 20, ("127.0.0.12",)),
    )
    assert not result.implicit and not result.permanent and result.status is None


@pytest.mark.integration
def test_domain_is_case_and_dot_insensitive(dns_server: Dnsmasq) -> None:
    result = resolve(make_resolver(dns_server.port), "OK.Test.")
    assert result.domain == "ok.test"
    assert [host.name for host in result.hosts] == ["mx1.ok.test", "mx2.ok.test"]


@pytest.mark.integration
def test_implicit_mx_when_there_is_no_mx_record(dns_server: Dnsmasq) -> None:
    result = resolve(make_resolver(dns_server.port), "amx.test")
    assert result.kind is MxKind.HOSTS and result.implicit
    assert result.hosts == (MxHost("amx.test", 0, ("127.0.0.13",)),)


@pytest.mark.integration
def test_no_mx_and_no_address_is_unroutable(dns_server: Dnsmasq) -> None:
    result = resolve(make_resolver(dns_server.port), "txtonly.test")
    assert result.kind is MxKind.UNROUTABLE and result.permanent and result.implicit
    assert result.status == EnhancedStatus(5, 4, 4)
    assert "no MX and no address" in result.reason


@pytest.mark.integration
def test_null_mx_bounces_without_hosts(dns_server: Dnsmasq) -> None:
    result = resolve(make_resolver(dns_server.port), "nullmx.test")
    assert result.kind is MxKind.NULL_MX and result.permanent
    assert result.hosts == ()
    assert result.status == EnhancedStatus(5, 1, 10)
    assert "RFC 7505" in result.reason


@pytest.mark.integration
def test_nxdomain_is_no_domain(dns_server: Dnsmasq) -> None:
    result = resolve(make_resolver(dns_server.port), "nx.test")
    assert result.kind is MxKind.NO_DOMAIN and result.permanent
    assert result.status == EnhancedStatus(5, 1, 2)
    assert "NXDOMAIN" in result.reason


@pytest.mark.integration
def test_timeout_is_temporary(dns_server: Dnsmasq) -> None:
    result = resolve(make_resolver(dns_server.port), "tempfail.test")
    assert result.kind is MxKind.TEMPORARY and not result.permanent
    assert result.status == EnhancedStatus(4, 4, 3)
    assert "timed out" in result.reason


@contextlib.contextmanager
def servfail_server() -> Iterator[int]:
    """A one-thread DNS server on loopback that answers every query with SERVFAIL."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(0.1)
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            try:
                data, peer = sock.recvfrom(4096)
            except TimeoutError:
                continue
            response = dns.message.make_response(dns.message.from_wire(data))
            response.set_rcode(dns.rcode.SERVFAIL)
            sock.sendto(response.to_wire(), peer)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield sock.getsockname()[1]
    finally:
        stop.set()
        thread.join(timeout=5)
        sock.close()


@pytest.mark.integration
def test_servfail_is_temporary() -> None:
    with servfail_server() as port:
        result = resolve(make_resolver(port, lifetime=5.0), "ok.test")
    assert result.kind is MxKind.TEMPORARY
    assert result.status == EnhancedStatus(4, 4, 3)
    assert "SERVFAIL" in result.reason


@pytest.mark.integration
def test_temporary_failures_are_not_cached(dns_server: Dnsmasq) -> None:
    resolver = make_resolver(dns_server.port)
    resolve(resolver, "tempfail.test")
    assert len(resolver.cache) == 0


@pytest.mark.integration
def test_equal_preferences_in_seeded_random_order(dns_server: Dnsmasq) -> None:
    def order(seed: int) -> list[str]:
        result = resolve(make_resolver(dns_server.port, rng=random.Random(seed)), "eq.test")
        assert result.kind is MxKind.HOSTS
        return [host.name for host in result.hosts]

    assert order(7) == order(7)
    firsts = set()
    for seed in range(40):
        names = order(seed)
        assert sorted(names[:3]) == sorted(EQUAL)
        assert names[3] == "backup.eq.test"
        firsts.add(names[0])
    assert firsts == set(EQUAL)


@pytest.mark.integration
def test_each_call_reshuffles_equal_preferences(dns_server: Dnsmasq) -> None:
    resolver = make_resolver(dns_server.port, rng=random.Random(3))
    firsts = {resolve(resolver, "eq.test").hosts[0].name for _ in range(40)}
    assert firsts == set(EQUAL)


@pytest.mark.integration
def test_host_without_address_is_skipped(dns_server: Dnsmasq) -> None:
    result = resolve(make_resolver(dns_server.port), "partial.test")
    assert result.kind is MxKind.HOSTS
    assert result.hosts == (MxHost("mx.partial.test", 20, ("127.0.0.31",)),)


@pytest.mark.integration
def test_no_host_with_address_is_unroutable(dns_server: Dnsmasq) -> None:
    result = resolve(make_resolver(dns_server.port), "noaddr.test")
    assert result.kind is MxKind.UNROUTABLE and result.permanent
    assert not result.implicit
    assert "no MX host of noaddr.test" in result.reason


@pytest.mark.integration
def test_host_that_times_out_is_skipped(dns_server: Dnsmasq) -> None:
    result = resolve(make_resolver(dns_server.port), "slowmx.test")
    assert result.kind is MxKind.HOSTS
    assert result.hosts == (MxHost("mx1.ok.test", 20, ("127.0.0.11",)),)


@pytest.mark.integration
def test_only_host_timing_out_is_temporary(dns_server: Dnsmasq) -> None:
    result = resolve(make_resolver(dns_server.port), "allslow.test")
    assert result.kind is MxKind.TEMPORARY
    assert "dead.tempfail.test" in result.reason


@pytest.mark.integration
def test_mx_host_at_our_address_is_a_loop(dns_server: Dnsmasq) -> None:
    resolver = make_resolver(dns_server.port, own_addresses={"127.0.0.41"})
    result = resolve(resolver, "loop.test")
    # RFC 5321 section 5.1: other.loop.test (20) is worse than us (10), so it goes too.
    assert result.kind is MxKind.LOOP and result.permanent
    assert result.status == EnhancedStatus(5, 4, 6)
    assert "loops back to myself" in result.reason


@pytest.mark.integration
def test_mx_host_with_our_name_is_a_loop(dns_server: Dnsmasq) -> None:
    resolver = make_resolver(dns_server.port, own_names={"Self.Loop.Test."})
    assert resolve(resolver, "loop.test").kind is MxKind.LOOP


@pytest.mark.integration
def test_backup_mx_keeps_only_better_hosts(dns_server: Dnsmasq) -> None:
    resolver = make_resolver(dns_server.port, own_addresses={"127.0.0.41"})
    result = resolve(resolver, "backup.test")
    assert result.kind is MxKind.HOSTS
    assert result.hosts == (MxHost("primary.backup.test", 10, ("127.0.0.51",)),)


@pytest.mark.integration
def test_loopback_is_a_loop_unless_allowed(dns_server: Dnsmasq) -> None:
    result = resolve(make_resolver(dns_server.port, allow_loopback=False), "ok.test")
    assert result.kind is MxKind.LOOP
    assert resolve(make_resolver(dns_server.port), "ok.test").kind is MxKind.HOSTS


@pytest.mark.integration
def test_ipv4_and_ipv6_addresses(dns_server: Dnsmasq) -> None:
    resolver = make_resolver(dns_server.port)
    with_v6 = resolve(resolver, "v6.test")
    assert with_v6.hosts == (MxHost("v6.test", 0, ("127.0.0.14", "::1")),)
    without_v6 = resolve(resolver, "v6.test", ipv6=False)
    assert without_v6.hosts == (MxHost("v6.test", 0, ("127.0.0.14",)),)


@pytest.mark.integration
def test_ipv6_only_host_with_ipv6_off(dns_server: Dnsmasq) -> None:
    resolver = make_resolver(dns_server.port)
    assert resolve(resolver, "v6only.test").hosts == (MxHost("v6only.test", 0, ("::1",)),)
    result = resolve(resolver, "v6only.test", ipv6=False)
    assert result.kind is MxKind.UNROUTABLE
    assert "IPv6 is turned off" in result.reason


@pytest.mark.integration
def test_ipv6_loopback_is_a_loop_unless_allowed(dns_server: Dnsmasq) -> None:
    resolver = make_resolver(dns_server.port, allow_loopback=False)
    assert resolve(resolver, "v6only.test").kind is MxKind.LOOP


def test_invalid_domain_names_are_no_domain() -> None:
    # No server is needed: the name is refused before any query (the port is never used).
    resolver = make_resolver(9)
    for bad in ("", ".", "a..b", "x" * 64 + ".test"):
        result = resolve(resolver, bad)
        assert result.kind is MxKind.NO_DOMAIN, bad
        assert "not a valid domain name" in result.reason


def test_resolver_needs_a_nameserver() -> None:
    with pytest.raises(ValueError, match="nameserver"):
        make_resolver(53, nameservers=[])


# --- caching -----------------------------------------------------------------------------


@pytest.mark.integration
def test_answers_are_served_from_cache_until_their_ttl(tmp_path: Path) -> None:
    records = [
        "local-ttl=300",
        "mx-host=ok.test,mx1.ok.test,10",
        "host-record=mx1.ok.test,127.0.0.11",
        "address=/nx.test/",
    ]
    clock = FakeClock()
    with running_dnsmasq(records, tmp_path) as server:
        resolver = make_resolver(server.port, clock=clock, lifetime=0.5)
        assert resolve(resolver, "ok.test").kind is MxKind.HOSTS
        assert resolve(resolver, "nx.test").kind is MxKind.NO_DOMAIN
        server.stop()
        pid = server.pid

    # dnsmasq is gone: every answer now comes from the cache.
    clock.advance(DEFAULT_NEGATIVE_TTL - 1)
    assert resolve(resolver, "ok.test").hosts == (MxHost("mx1.ok.test", 10, ("127.0.0.11",)),)
    assert resolve(resolver, "nx.test").kind is MxKind.NO_DOMAIN

    # The negative answer carried no SOA, so it lived for the default negative TTL.
    clock.advance(1)
    assert resolve(resolver, "nx.test").kind is MxKind.TEMPORARY
    clock.now = 1000.0 + 299
    assert resolve(resolver, "ok.test").kind is MxKind.HOSTS
    clock.now = 1000.0 + 300
    assert resolve(resolver, "ok.test").kind is MxKind.TEMPORARY
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # stopped and reaped


@pytest.mark.integration
def test_max_ttl_caps_positive_answers(tmp_path: Path) -> None:
    records = ["local-ttl=300", "host-record=amx.test,127.0.0.13"]
    clock = FakeClock()
    with running_dnsmasq(records, tmp_path) as server:
        resolver = make_resolver(server.port, clock=clock, lifetime=0.5, max_ttl=10.0)
        assert resolve(resolver, "amx.test").kind is MxKind.HOSTS
        server.stop()
    clock.advance(9.5)
    assert resolve(resolver, "amx.test").kind is MxKind.HOSTS
    clock.advance(0.5)
    assert resolve(resolver, "amx.test").kind is MxKind.TEMPORARY


@pytest.mark.integration
def test_zero_ttl_is_not_cached(tmp_path: Path) -> None:
    # dnsmasq's default local-ttl is 0.
    with running_dnsmasq(["host-record=amx.test,127.0.0.13"], tmp_path) as server:
        resolver = make_resolver(server.port)
        assert resolve(resolver, "amx.test").kind is MxKind.HOSTS
        assert resolver.cache.get("amx.test.", "A") is None
        # The negative answers (no MX, no AAAA) carry no TTL of their own: the default.
        assert resolver.cache.get("amx.test.", "MX") is not None


def asked(server: Dnsmasq, question: str, at_least: int) -> int:
    """How often dnsmasq logged ``question`` (``query[MX] amx.test``), once it logged it at
    least ``at_least`` times or a second went by."""
    deadline = time.monotonic() + 1.0
    while True:
        count = server.log.read_text(errors="replace").count(f"{question} from ")
        if count >= at_least or time.monotonic() > deadline:
            return count
        time.sleep(0.02)


@pytest.mark.integration
def test_a_question_on_its_way_is_asked_once(tmp_path: Path) -> None:
    # TTL 0: nothing is cached, so only sharing the question in flight keeps it to one.
    records = ["log-queries", "host-record=amx.test,127.0.0.13"]
    with running_dnsmasq(records, tmp_path) as server:
        resolver = make_resolver(server.port)

        async def together() -> list[MxResult]:
            return await asyncio.gather(*(resolver.resolve("amx.test") for _ in range(20)))

        results = asyncio.run(together())
        assert {r.hosts for r in results} == {(MxHost("amx.test", 0, ("127.0.0.13",)),)}
        for question in ("query[MX] amx.test", "query[A] amx.test", "query[AAAA] amx.test"):
            assert asked(server, question, 2) == 1, question
        # Once answered it is asked again: the A answer (TTL 0) was not kept.  The negative
        # MX and AAAA answers carry the default TTL and are.
        assert resolve(resolver, "amx.test").kind is MxKind.HOSTS
        assert asked(server, "query[A] amx.test", 2) == 2
        assert asked(server, "query[MX] amx.test", 2) == 1


@pytest.mark.integration
def test_a_waiter_given_up_leaves_the_others_their_answer(dns_server: Dnsmasq) -> None:
    resolver = make_resolver(dns_server.port)  # tempfail.test times out after 1 s

    async def one_cancelled() -> tuple[MxResult, MxResult]:
        first = asyncio.ensure_future(resolver.resolve("tempfail.test"))
        second = asyncio.ensure_future(resolver.resolve("tempfail.test"))
        third = asyncio.ensure_future(resolver.resolve("tempfail.test"))
        await asyncio.sleep(0.2)
        first.cancel()
        with pytest.raises(asyncio.CancelledError):
            await first
        return await second, await third

    second, third = asyncio.run(one_cancelled())
    assert second.kind is third.kind is MxKind.TEMPORARY
    assert "timed out" in second.reason and "timed out" in third.reason
    assert not resolver._asking  # nothing left behind for the next lookup


@pytest.mark.integration
def test_a_question_left_pending_on_another_loop_is_asked_anew(dns_server: Dnsmasq) -> None:
    resolver = make_resolver(dns_server.port, lifetime=5.0)  # tempfail.test never answers
    loop = asyncio.new_event_loop()
    try:
        with contextlib.suppress(TimeoutError):
            loop.run_until_complete(asyncio.wait_for(resolver.resolve("tempfail.test"), 0.05))
        # The loop stops with its question pending, never answered, never cancelled: what a
        # caller that closes its own loop leaves behind.
        assert list(resolver._asking) == [("tempfail.test.", "MX")]
        short = make_resolver(dns_server.port, lifetime=0.3)
        short._asking = resolver._asking  # the same dead question
        result = asyncio.run(short.resolve("tempfail.test"))
        assert result.kind is MxKind.TEMPORARY and "timed out" in result.reason
        assert not short._asking
    finally:
        # Unwound here (closed at once, the garbage collector would do it in a later test).
        pending = asyncio.all_tasks(loop)
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        loop.close()


def answer(ttl: float, *addresses: str) -> DnsAnswer:
    return DnsAnswer(DnsOutcome.ANSWER, ttl, addresses=addresses)


def test_cache_expiry_with_clock() -> None:
    clock = FakeClock()
    cache = AnswerCache(clock)
    cache.put("Host.Test.", "A", answer(30, "192.0.2.1"))
    assert cache.get("host.test.", "A") == answer(30, "192.0.2.1")
    assert cache.get("host.test.", "AAAA") is None
    clock.advance(29.9)
    assert cache.get("host.test.", "A") is not None
    clock.advance(0.1)
    assert cache.get("host.test.", "A") is None
    assert len(cache) == 0


def test_cache_is_bounded_lru() -> None:
    cache = AnswerCache(FakeClock(), max_entries=2)
    cache.put("a.test.", "A", answer(60, "192.0.2.1"))
    cache.put("b.test.", "A", answer(60, "192.0.2.2"))
    assert cache.get("a.test.", "A") is not None  # a is now the most recently used
    cache.put("c.test.", "A", answer(60, "192.0.2.3"))
    assert len(cache) == 2
    assert cache.get("b.test.", "A") is None
    assert cache.get("a.test.", "A") is not None
    assert cache.get("c.test.", "A") is not None


def test_cache_zero_ttl_replaces_nothing() -> None:
    cache = AnswerCache(FakeClock())
    cache.put("a.test.", "A", answer(60, "192.0.2.1"))
    cache.put("a.test.", "A", answer(0, "192.0.2.9"))
    assert cache.get("a.test.", "A") is None


def test_cache_needs_room() -> None:
    with pytest.raises(ValueError, match="max_entries"):
        AnswerCache(FakeClock(), max_entries=0)


def negative_response(soa_ttl: int, minimum: int) -> dns.message.Message:
    response = dns.message.make_response(dns.message.make_query("nx.test.", "MX"))
    response.authority.append(
        dns.rrset.from_text(
            "test.",
            soa_ttl,
            "IN",
            "SOA",
            f"ns.test. hostmaster.test. 1 3600 600 86400 {minimum}",
        )
    )
    return response


def test_negative_ttl_is_the_smaller_of_soa_ttl_and_minimum() -> None:
    # RFC 2308 section 5.
    assert negative_ttl(negative_response(900, 300), 60, 10_800) == 300
    assert negative_ttl(negative_response(120, 300), 60, 10_800) == 120


def test_negative_ttl_default_and_cap() -> None:
    assert negative_ttl(None, 60, 10_800) == 60
    empty = dns.message.make_response(dns.message.make_query("nx.test.", "MX"))
    assert negative_ttl(empty, 60, 10_800) == 60
    assert negative_ttl(negative_response(86_400, 86_400), 60, 10_800) == 10_800
