"""The walk over a domain's MX hosts when a host refuses, lacks TLS or is out of step.

Real parts only: ``attempt`` with the real ``MxResolver`` asking dnsmasq (one per module,
every MX host on its own 127.0.0.0/8 address), the real transport, and ``FaultServer`` as
each MX host.  MX records carry no port, so the servers of one test share one: the first
binds an ephemeral port, the others bind the same port on their own addresses.
"""

from __future__ import annotations

import contextlib
import random
import ssl
import time
from collections.abc import AsyncIterator, Iterator, Sequence

import pytest

from tests.receiver.conftest import HOSTNAME, TlsFiles, tls_files
from tests.storage.conftest import async_test
from tests.support.dnsmasq import Dnsmasq, running_dnsmasq
from tests.support.faultserver import Faults, FaultServer
from zoneq.delivery.attempt import Settings, attempt
from zoneq.delivery.hostcache import DeadHostCache
from zoneq.delivery.mx import MxResolver
from zoneq.delivery.transport import Timeouts, TlsPolicy
from zoneq.ipc.messages import Job, JobRecipient, Outcome, RecipientReport

pytestmark = pytest.mark.integration
__all__ = ["tls_files"]  # the fixture, imported for pytest

HELO = "client.zoneq.test"  # not the TLS host's name, or that MX would be taken for us
FAST = Timeouts(greeting=5, ehlo=5, starttls=5, mail=5, rcpt=5, data_init=5, data_end=5)

# name -> address of every MX host below.
HOSTS = {
    "mx.shared.test": "127.0.40.1",  # the one MX of greet.test and of other.test
    "mx1.backup.test": "127.0.40.2",
    "mx2.backup.test": "127.0.40.3",
    "mx1.tls.test": "127.0.40.4",  # offers no STARTTLS
    HOSTNAME: "127.0.40.5",  # offers STARTTLS with the certificate of tls_files
    "mx2.tls.test": "127.0.40.6",  # offers no STARTTLS either
    "mx.data.test": "127.0.40.7",
}
RECORDS = [
    "mx-host=greet.test,mx.shared.test,10",
    "mx-host=other.test,mx.shared.test,10",
    "mx-host=backup.test,mx1.backup.test,10",
    "mx-host=backup.test,mx2.backup.test,20",
    "mx-host=tls.test,mx1.tls.test,10",
    f"mx-host=tls.test,{HOSTNAME},20",
    "mx-host=notls.test,mx1.tls.test,10",
    "mx-host=notls.test,mx2.tls.test,20",
    "mx-host=data.test,mx.data.test,10",
    *(f"host-record={name},{address}" for name, address in HOSTS.items()),
]
REFUSALS = [
    b"421 4.7.0 Too many connections from your IP, try again later",
    b"554 5.7.1 Client host blocked",
]


@pytest.fixture(scope="module")
def dns(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Dnsmasq]:
    with running_dnsmasq(RECORDS, tmp_path_factory.mktemp("dns")) as server:
        yield server


@contextlib.asynccontextmanager
async def mx_hosts(
    *servers: tuple[str, Faults, ssl.SSLContext | None],
) -> AsyncIterator[tuple[int, list[FaultServer]]]:
    """A FaultServer for each (MX name, faults, TLS), all on one port: (port, servers)."""
    async with contextlib.AsyncExitStack() as stack:
        port, started = 0, []
        for name, faults, tls in servers:
            server = FaultServer(faults, tls, host=HOSTS[name], port=port)
            started.append(await stack.enter_async_context(server))
            port = server.port
        yield port, started


def job(domain: str, *locals_: str) -> Job:
    return Job(
        msg_id=1,
        sender="s@src.test",
        size=24,
        chunks=1,
        domain=domain,
        recipients=tuple(
            JobRecipient(token=n, address=f"{local}@{domain}") for n, local in enumerate(locals_)
        ),
    )


class Walker:
    """``attempt`` as a zone worker runs it: one resolver and one dead-host cache for every
    attempt, so what one attempt learns about a host the next one sees."""

    def __init__(self, dns: Dnsmasq, port: int, tls: TlsPolicy = TlsPolicy.NONE) -> None:
        self.dead_hosts = DeadHostCache(clock=time.monotonic, base=60)
        self.resolver = MxResolver(
            nameservers=["127.0.0.1"],
            port=dns.port,
            clock=time.monotonic,
            rng=random.Random(0),
            timeout=2,
            lifetime=3,
            allow_loopback=True,
            own_names={HELO},
        )
        self.settings = Settings(helo_name=HELO, port=port, tls=tls, timeouts=FAST)

    async def attempt(self, domain: str, *locals_: str) -> Sequence[RecipientReport]:
        return await attempt(
            job(domain, *locals_),
            settings=self.settings,
            resolver=self.resolver,
            dead_hosts=self.dead_hosts,
            body=lambda: [b"Subject: walk\r\n\r\nhello\r\n"],
        )


def mail_sent(server: FaultServer) -> bool:
    return b"MAIL" in server.verbs()


# --- a host that answers with a refusal is alive -----------------------------------------


@pytest.mark.parametrize("greeting", REFUSALS)
@async_test
async def test_a_refusing_greeting_defers_this_attempt_and_leaves_the_host_alive(
    dns: Dnsmasq, greeting: bytes
) -> None:
    """RFC 5321 section 3.1: the host answered, so it is no dead host.  The attempt is
    deferred with the host's own reply (for the reply rules and the report), and the next
    attempt, for another domain with the same MX, connects again instead of skipping it."""
    async with mx_hosts(("mx.shared.test", Faults(greeting=greeting), None)) as (port, [mx]):
        walker = Walker(dns, port)
        for domain in ("greet.test", "other.test"):
            (report,) = await walker.attempt(domain, "a")
            assert report.outcome is Outcome.DEFERRED
            assert (report.reply, report.code) == (greeting.decode(), int(greeting[:3]))
            assert report.mx == "mx.shared.test"
            assert not walker.dead_hosts.is_dead(mx.host)
        assert len(mx.sessions) == 2  # one connection per attempt: never skipped
        assert not mail_sent(mx)


@pytest.mark.parametrize("greeting", REFUSALS)
@async_test
async def test_a_refusing_greeting_sends_the_recipients_on_to_the_next_mx(
    dns: Dnsmasq, greeting: bytes
) -> None:
    async with mx_hosts(
        ("mx1.backup.test", Faults(greeting=greeting), None),
        ("mx2.backup.test", Faults(), None),
    ) as (port, [mx1, mx2]):
        walker = Walker(dns, port)
        reports = await walker.attempt("backup.test", "a", "b")
        assert [(r.outcome, r.mx) for r in reports] == [(Outcome.DELIVERED, "mx2.backup.test")] * 2
        assert not walker.dead_hosts.is_dead(mx1.host)
        assert len(mx2.payloads) == 1 and not mail_sent(mx1)


# --- required TLS: each MX host in turn ----------------------------------------------------


def server_tls(files: TlsFiles) -> ssl.SSLContext:
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    context.load_cert_chain(files.cert, files.key)
    return context


@async_test
async def test_required_tls_goes_past_an_mx_without_starttls_to_one_with_it(
    dns: Dnsmasq, tls_files: TlsFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    """RFC 5321 section 5.1: the primary MX offers no STARTTLS; the backup does, with a
    certificate the client trusts (``SSL_CERT_FILE``: required TLS verifies it).  The mail
    goes to the backup under TLS, and nothing of it went to the primary in plaintext."""
    monkeypatch.setenv("SSL_CERT_FILE", str(tls_files.cert))
    async with mx_hosts(
        ("mx1.tls.test", Faults(), None),
        (HOSTNAME, Faults(starttls=True), server_tls(tls_files)),
    ) as (port, [mx1, mx2]):
        walker = Walker(dns, port, TlsPolicy.REQUIRED)
        (report,) = await walker.attempt("tls.test", "a")
        assert (report.outcome, report.mx) == (Outcome.DELIVERED, HOSTNAME)
        assert [s.tls for s in mx2.sessions] == [True] and len(mx2.payloads) == 1
        assert len(mx1.sessions) == 1 and not mail_sent(mx1)


@async_test
async def test_required_tls_that_no_mx_offers_defers_with_4_7_4(dns: Dnsmasq) -> None:
    async with mx_hosts(
        ("mx1.tls.test", Faults(), None),
        ("mx2.tls.test", Faults(), None),
    ) as (port, [mx1, mx2]):
        walker = Walker(dns, port, TlsPolicy.REQUIRED)
        (report,) = await walker.attempt("notls.test", "a")
        # RFC 3463 section 3.8: X.7.4 security features not supported; the last host's.
        assert (report.outcome, report.enhanced, report.mx) == (
            Outcome.DEFERRED,
            "4.7.4",
            "mx2.tls.test",
        )
        assert "STARTTLS" in report.reply
        for mx in (mx1, mx2):
            assert len(mx.sessions) == 1 and not mail_sent(mx)
            assert not walker.dead_hosts.is_dead(mx.host)


# --- replies that do not deliver ---------------------------------------------------------


@async_test
async def test_a_250_to_data_is_a_deferral_not_a_delivery(dns: Dnsmasq) -> None:
    """RFC 5321 section 4.3.2: only 354 lets the body go.  A 250 to DATA left the message
    unsent: reporting it delivered would lose it."""
    async with mx_hosts(("mx.data.test", Faults(data_reply=b"250 2.0.0 Ok"), None)) as (
        port,
        [mx],
    ):
        (report,) = await Walker(dns, port).attempt("data.test", "a")
        assert (report.outcome, report.enhanced) == (Outcome.DEFERRED, "4.5.0")
        assert not mx.payloads


@async_test
async def test_552_to_rcpt_delivers_in_a_second_transaction_or_defers(dns: Dnsmasq) -> None:
    """RFC 5321 section 4.5.3.1.10: 552 to RCPT is taken as 452, never a bounce."""
    too_many = b"552 5.5.3 Too many recipients"
    async with mx_hosts(("mx.data.test", Faults(rcpt_replies={2: too_many}), None)) as (
        port,
        [mx],
    ):
        walker = Walker(dns, port)
        reports = await walker.attempt("data.test", "a", "b")
        assert [r.outcome for r in reports] == [Outcome.DELIVERED] * 2
        assert len(mx.sessions) == 1 and len(mx.payloads) == 2
        mx.faults.rcpt_replies = {1: too_many}
        (report,) = await walker.attempt("data.test", "c")
        assert (report.outcome, report.code) == (Outcome.DEFERRED, 552)
