"""A per-MX connection limit shared by several domains (issue 5), on the whole product.

Six recipient domains have one MX host, ``mx.shared.test`` (dnsmasq), as many small domains
hosted by one provider do.  A real ``zoneq serve`` with two worker processes of ten
connections each delivers 300 queued messages to them.  Each domain alone may have ten
connections (``domain_connections``), sixty in all; ``mx_limits`` allows the shared host
three.  The MX is the project's fault server in counting mode
(``tests/support/countingsink.py``): it answers each final dot after a pause, so that
transactions overlap, and records when each one was open.

The learning window (``zoneq/queue/scheduler.py``): the core does not resolve MX, it learns a
domain's MX host from the first report about that domain; until then that domain's jobs count
against its own limit only.  Seen from the MX, the window closes when every transaction that
may have been leased before the last domain was learnt has ended: :func:`learning_window_end`.
After that, at most three transactions may be open at once.  The control runs the same
without ``mx_limits`` and must see more than three, or the test could not fail.

The limit counts open connections, not only jobs in flight: each worker process keeps idle
connections for reuse (``zoneq/delivery/transport/cache.py``), and the core counts each one
as a held slot of its domain and MX host until the worker says it is closed
(``zoneq/queue/slots.py``).  So after the window the MX sees at most three connections open
at once, idle ones included, and still sees them reused.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.storage.conftest import queue_message
from tests.support.countingsink import (
    CountingServer,
    Span,
    Transaction,
    peak,
    running_counting_sink,
    timeline,
)
from tests.support.dnsmasq import running_dnsmasq
from tests.support.serve import running_serve, write_serve_config
from zoneq.storage.store import QueueStore

MX_HOST = "mx.shared.test"
DOMAINS = tuple(f"customer{n}.test" for n in range(6))
MX_LIMIT = 3
DOMAIN_CONNECTIONS = 10  # per domain: 60 for the six, far above the MX's 3
PROCESSES = 2
CONNECTIONS = 10  # per worker process: 20 delivery loops compete for the MX
MESSAGES = 300  # 50 per domain, one recipient each
END_DELAY = 0.15  # s the MX takes to answer a final dot: 300 / 3 * 0.15 = 15 s at the limit
DEADLINE_S = 45.0

REPORT_GRACE = 1.0
"""Seconds from a transaction's end at the MX to the core having learnt from its report, and
from a job's lease to its DATA at the MX, on a busy machine (both are milliseconds when
idle): transactions begun this long after the last domain's first one ended may still have
been leased before the core knew that domain's MX host."""


def domain_of(transaction: Transaction) -> str:
    domains = {address.rpartition("@")[2].lower() for address in transaction.recipients}
    assert len(domains) == 1, f"one job is one domain: {transaction.recipients}"
    return domains.pop()


def learning_window_end(transactions: list[Transaction], grace: float = REPORT_GRACE) -> float:
    """When, at the MX, the last transaction that may have escaped the MX limit ended.

    The core has learnt every domain's MX host once the first transaction of each domain has
    ended (and its report arrived); a transaction that began up to ``grace`` later may have
    been leased before that, counted against its domain only.
    """
    first_end: dict[str, float] = {}
    for transaction in sorted(transactions, key=lambda t: t.span.end):
        first_end.setdefault(domain_of(transaction), transaction.span.end)
    learnt = max(first_end.values())
    early = [t.span.end for t in transactions if t.span.start < learnt + grace]
    return max([learnt, *early])


# --- the measurement itself ------------------------------------------------------------------

INF = float("inf")


@pytest.mark.parametrize(
    ("spans", "since", "expected"),
    [
        ([], -INF, 0),
        ([(0, 1)], -INF, 1),
        ([(0, 1), (1, 2)], -INF, 1),  # one ends as the next starts: never two at once
        ([(0, 2), (1, 3)], -INF, 2),
        ([(0, 10), (1, 2), (3, 4), (5, 6)], -INF, 2),
        ([(0, 5), (1, 5), (2, 5), (6, 7)], -INF, 3),
        ([(0, 5), (1, 5), (2, 5), (6, 7)], 5.0, 1),  # the three ended at 5: not counted after
        ([(0, 5), (1, 5), (2, 5), (6, 7)], 4.9, 3),  # still open at 4.9
        ([(0, INF), (1, 2)], 3.0, 1),  # still open
    ],
)
def test_peak_counts_spans_open_at_the_same_instant(
    spans: list[tuple[float, float]], since: float, expected: int
) -> None:
    assert peak([Span(a, b) for a, b in spans], since) == expected


@given(
    st.lists(
        st.tuples(st.integers(0, 100), st.integers(1, 30)).map(lambda t: (t[0], t[0] + t[1])),
        max_size=30,
    ),
    st.integers(-1, 130),
)
def test_peak_is_the_most_open_at_any_instant(spans: list[tuple[int, int]], since: int) -> None:
    """Against brute force: integer ends, so the half-integers are every distinct instant."""
    instants = [since + k / 2 for k in range(0, 2 * 140)]
    brute = max((sum(1 for a, b in spans if a <= t < b) for t in instants), default=0)
    assert peak([Span(a, b) for a, b in spans], since) == brute


def test_timeline_gives_the_peak_of_each_slot() -> None:
    spans = [Span(0.0, 1.5), Span(0.5, 1.2), Span(1.1, 3.0), Span(2.5, 2.6)]
    assert timeline(spans, 0.0, 1.0) == [2, 3, 2]


def tx(start: float, end: float, domain: str) -> Transaction:
    return Transaction(Span(start, end), (f"r@{domain}",))


@pytest.mark.parametrize(
    ("transactions", "expected"),
    [
        # Both domains' first transactions end by 1.0; one begun at 1.5 (< 1.0 + grace) may
        # have been leased before the core knew; it ends at 4.0.  The one at 2.5 is after.
        (
            [tx(0, 1, "a.test"), tx(0, 0.5, "b.test"), tx(1.5, 4, "a.test"), tx(2.5, 3, "b.test")],
            4.0,
        ),
        # Only once the slower domain is learnt (at 5.0) is the MX limit whole.
        ([tx(0, 1, "a.test"), tx(0, 5, "b.test"), tx(1, 2, "a.test"), tx(5.5, 6, "a.test")], 6.0),
        ([tx(0, 1, "a.test"), tx(3, 4, "a.test")], 1.0),
    ],
)
def test_the_learning_window_ends_with_the_last_transaction_that_may_have_escaped(
    transactions: list[Transaction], expected: float
) -> None:
    assert learning_window_end(transactions, grace=1.0) == expected


# --- the whole product ----------------------------------------------------------------------


@dataclass
class Run:
    """What the MX saw of one run."""

    sink: CountingServer
    began: float  # when serve was started

    @property
    def transactions(self) -> list[Transaction]:
        return self.sink.transactions

    def delivered(self) -> list[str]:
        return [address for t in self.transactions for address in t.recipients]

    def report(self, label: str, window_end: float) -> str:
        spans = [t.span for t in self.transactions]
        ends = max(s.end for s in spans)
        connections = [c for c in self.sink.open_connections() if c.start < ends]
        return (
            f"{label}: {len(self.delivered())} delivered in {ends - self.began:.1f} s; "
            f"learning window closed at {window_end - self.began:.2f} s; "
            f"transactions at once after it {peak(spans, window_end)} "
            f"(in it {peak(spans)}); connections open at once after it "
            f"{peak(connections, window_end)} (in it {peak(connections)}); "
            f"transactions per second {timeline(spans, self.began, 1.0)}, "
            f"connections per second {timeline(connections, self.began, 1.0)}"
        )


async def queue_for_domains(directory: Path, domains: tuple[str, ...], count: int) -> set[str]:
    """``count`` one-recipient messages, spread over ``domains`` in turn; the recipients."""
    store = QueueStore.open(directory)
    store.recover()
    recipients = set()
    try:
        for n in range(count):
            address = f"r{n}@{domains[n % len(domains)]}"
            now = time.time_ns() // 1_000_000
            await queue_message(store, [(address, "default")], now_ms=now, received_ms=now)
            recipients.add(address)
    finally:
        await store.close()
    return recipients


def shared_mx_config(directory: Path, mx_port: int, dns_port: int, mx_limits: str) -> Path:
    config = write_serve_config(
        directory, mx_port=mx_port, dns_port=dns_port, connections=CONNECTIONS, processes=PROCESSES
    )
    text = config.read_text()
    delivery = f"[delivery]\ndomain_connections = {DOMAIN_CONNECTIONS}\nmx_limits = {mx_limits}\n"
    assert text.count("[delivery]\n") == 1
    config.write_text(text.replace("[delivery]\n", delivery))
    return config


def run_shared_mx(directory: Path, mx_limits: Mapping[str, int]) -> Run:
    """Queue the mail, run serve against the shared MX until every message is in (bounded),
    stop everything; what the MX saw."""
    host = f"127.0.{random.randint(1, 250)}.{random.randint(2, 250)}"
    with running_counting_sink(host, end_delay=END_DELAY) as sink:
        records = [f"host-record={MX_HOST},{host}"]
        records += [f"mx-host={domain},{MX_HOST},10" for domain in DOMAINS]
        with running_dnsmasq(records, directory / "dns") as dns:
            limits = "{ " + ", ".join(f'"{h}" = {n}' for h, n in mx_limits.items()) + " }"
            config = shared_mx_config(directory / "zoneq", sink.port, dns.port, limits)
            queued = asyncio.run(queue_for_domains(config.parent / "queue", DOMAINS, MESSAGES))
            began = time.monotonic()
            with running_serve(config, directory / "serve.log", expected_workers=PROCESSES + 1):
                deadline = began + DEADLINE_S
                while len(sink.transactions) < MESSAGES and time.monotonic() < deadline:
                    time.sleep(0.1)
    run = Run(sink, began)
    # Every message once: none lost, none twice.
    assert sorted(run.delivered()) == sorted(queued), (
        f"{len(run.delivered())} of {MESSAGES} delivered within {DEADLINE_S} s"
    )
    return run


@pytest.fixture(scope="module")
def limited(tmp_path_factory: pytest.TempPathFactory) -> Run:
    """One run with the MX limit, shared by the two tests of what the MX saw."""
    run = run_shared_mx(tmp_path_factory.mktemp("limited"), {MX_HOST: MX_LIMIT})
    print(run.report(f"mx_limits {MX_HOST} = {MX_LIMIT}", learning_window_end(run.transactions)))
    return run


@pytest.mark.integration
def test_six_domains_on_one_mx_get_no_more_transactions_at_once_than_its_limit(
    limited: Run,
) -> None:
    spans = [t.span for t in limited.transactions]
    window_end = learning_window_end(limited.transactions)
    after = [t for t in limited.transactions if t.span.start >= window_end]
    # The window is short: most of the mail went out under the MX limit ...
    assert len(after) >= 0.8 * MESSAGES
    assert peak(spans, window_end) <= MX_LIMIT
    # ... and used it: a ceiling, not one transaction at a time.
    assert peak(spans, window_end) == MX_LIMIT


@pytest.mark.integration
def test_six_domains_on_one_mx_get_no_more_connections_at_once_than_its_limit(
    limited: Run,
) -> None:
    """What a provider counts is connections, idle or not (the config calls ``mx_limits``
    "connections at once per MX host")."""
    window_end = learning_window_end(limited.transactions)
    last_end = max(t.span.end for t in limited.transactions)
    connections = [c for c in limited.sink.open_connections() if c.start < last_end]
    assert peak([Span(c.start, min(c.end, last_end)) for c in connections], window_end) <= MX_LIMIT


@pytest.mark.integration
def test_under_the_mx_limit_connections_are_still_reused(limited: Run) -> None:
    """Issue 3: a connection to an MX carries further messages to it.  The idle ones count
    against the limit, and the worker holding one is the one to get the host's next job, so
    after the window a connection carries many messages, not one each."""
    window_end = learning_window_end(limited.transactions)
    after = [t for t in limited.transactions if t.span.start >= window_end]
    opened = [c for c in limited.sink.open_connections() if c.start >= window_end]
    print(f"after the window: {len(after)} transactions on {len(opened)} new connections")
    assert len(opened) * 10 <= len(after)


@pytest.mark.integration
def test_control_without_an_mx_limit_the_domains_limits_alone_overload_the_mx(
    tmp_path: Path,
) -> None:
    run = run_shared_mx(tmp_path, {})
    window_end = learning_window_end(run.transactions)
    print(run.report("no mx_limits", window_end))
    after = [t for t in run.transactions if t.span.start >= window_end]
    assert len(after) >= 2 * PROCESSES * CONNECTIONS, "too little mail after the window to judge"
    assert peak([t.span for t in run.transactions], window_end) > MX_LIMIT
    # Each domain kept to its own limit all along: that limit alone is what overloads the MX.
    for domain in DOMAINS:
        spans = [t.span for t in run.transactions if domain_of(t) == domain]
        assert peak(spans) <= DOMAIN_CONNECTIONS
