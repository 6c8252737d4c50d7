"""One delivery attempt's decisions: MX answers, the walk over hosts, dead hosts, reports.

The resolver and the SMTP transaction are stand-ins here (their own tests use dnsmasq and
real servers); what is checked is how their answers become per-recipient reports.
"""

from __future__ import annotations

import asyncio
from dataclasses import replace
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zoneq.delivery.attempt import Settings, attempt, owes_relayed_notice
from zoneq.delivery.hostcache import DeadHostCache
from zoneq.delivery.mx import MxHost, MxKind, MxResult
from zoneq.delivery.results import RecipientResult, TransactionResult
from zoneq.delivery.transport import TlsPolicy
from zoneq.ipc.messages import Job, JobRecipient, Outcome
from zoneq.protocol.dsn import Notify
from zoneq.protocol.replies import EnhancedStatus, Reply, Stage, Verdict

SETTINGS = Settings(helo_name="mx.zoneq.test", port=2525)


class Resolver:
    def __init__(self, result: MxResult) -> None:
        self.result = result

    async def resolve(self, domain: str, *, ipv6: bool = True) -> MxResult:
        return self.result


def job(*addresses: str) -> Job:
    return Job(
        msg_id=1,
        sender="s@src.test",
        size=10,
        chunks=1,
        domain="ok.test",
        recipients=tuple(JobRecipient(token=n, address=a) for n, a in enumerate(addresses)),
    )


def hosts(*specs: tuple[str, tuple[str, ...]]) -> MxResult:
    return MxResult(
        MxKind.HOSTS,
        "ok.test",
        "",
        None,
        hosts=tuple(MxHost(name, 10 * n, addrs) for n, (name, addrs) in enumerate(specs)),
    )


class Server:
    """Answers each connection by address: a verdict per recipient, or no connection."""

    def __init__(self, plan: dict[str, Any]) -> None:
        self.plan = plan
        self.calls: list[tuple[str, list[str]]] = []

    async def __call__(self, *, host: str, recipients: list[Any], **_: Any) -> TransactionResult:
        names = [r.address for r in recipients]
        self.calls.append((host, names))
        verdict = self.plan[host]
        if verdict is None:  # connection refused
            results = tuple(
                RecipientResult(n, Verdict.NEXT_HOST, Stage.CONNECT, None, EnhancedStatus(4, 4, 1))
                for n in names
            )
            return TransactionResult(host, 25, results)
        results = tuple(
            RecipientResult(
                n,
                verdict(n),
                Stage.END_OF_DATA,
                Reply(250 if verdict(n) is Verdict.DONE else 550, ("x",)),
            )
            for n in names
        )
        return TransactionResult(host, 25, results, peer=host, local="127.0.0.9")


def run(
    job_: Job, resolver: Resolver, server: Server, dead: DeadHostCache | None = None
) -> list[Any]:
    return asyncio.run(
        attempt(
            job_,
            settings=SETTINGS,
            resolver=resolver,  # type: ignore[arg-type]
            dead_hosts=dead if dead is not None else DeadHostCache(clock=lambda: 0.0),
            body=lambda: [b"x"],
            send=server,
        )
    )


def test_null_mx_bounces_everyone_without_a_connection() -> None:
    server = Server({})
    result = MxResult(MxKind.NULL_MX, "ok.test", "no mail", EnhancedStatus(5, 1, 10))
    reports = run(job("a@ok.test", "b@ok.test"), Resolver(result), server)
    assert [r.outcome for r in reports] == [Outcome.BOUNCED, Outcome.BOUNCED]
    assert reports[0].reply.startswith("556 5.1.10")
    assert server.calls == []


def test_temporary_dns_failure_defers_without_a_bounce() -> None:
    result = MxResult(MxKind.TEMPORARY, "ok.test", "timeout", EnhancedStatus(4, 4, 3))
    reports = run(job("a@ok.test"), Resolver(result), Server({}))
    assert reports[0].outcome is Outcome.DEFERRED
    assert reports[0].enhanced == "4.4.3"


def test_refused_first_host_falls_back_and_marks_it_dead() -> None:
    dead = DeadHostCache(clock=lambda: 0.0)
    server = Server({"10.0.0.1": None, "10.0.0.2": lambda n: Verdict.DONE})
    mx = hosts(("mx1.ok.test", ("10.0.0.1",)), ("mx2.ok.test", ("10.0.0.2",)))
    reports = run(job("a@ok.test"), Resolver(mx), server, dead)
    assert reports[0].outcome is Outcome.DELIVERED
    assert reports[0].mx == "mx2.ok.test" and reports[0].source_ip == "127.0.0.9"
    assert dead.is_dead("10.0.0.1") and not dead.is_dead("10.0.0.2")
    # The next attempt skips the resting host altogether.
    server.calls.clear()
    run(job("b@ok.test"), Resolver(mx), server, dead)
    assert [host for host, _ in server.calls] == ["10.0.0.2"]


def test_settled_recipients_are_never_sent_to_the_next_host() -> None:
    server = Server(
        {
            "10.0.0.1": lambda n: Verdict.DONE if n.startswith("a") else Verdict.NEXT_HOST,
            "10.0.0.2": lambda n: Verdict.DONE,
        }
    )
    mx = hosts(("mx1.ok.test", ("10.0.0.1",)), ("mx2.ok.test", ("10.0.0.2",)))
    reports = run(job("a@ok.test", "b@ok.test"), Resolver(mx), server)
    assert [r.outcome for r in reports] == [Outcome.DELIVERED, Outcome.DELIVERED]
    assert server.calls == [("10.0.0.1", ["a@ok.test", "b@ok.test"]), ("10.0.0.2", ["b@ok.test"])]


def test_mixed_outcomes_keep_their_own_verdicts() -> None:
    server = Server({"10.0.0.1": lambda n: Verdict.BOUNCE if n.startswith("b") else Verdict.DONE})
    reports = run(job("a@ok.test", "b@ok.test"), Resolver(hosts(("mx", ("10.0.0.1",)))), server)
    assert [r.outcome for r in reports] == [Outcome.DELIVERED, Outcome.BOUNCED]
    assert [r.token for r in reports] == [0, 1]


def test_when_no_host_will_talk_everyone_is_deferred_with_the_last_reason() -> None:
    server = Server({"10.0.0.1": None, "10.0.0.2": None})
    mx = hosts(("mx1", ("10.0.0.1",)), ("mx2", ("10.0.0.2",)))
    reports = run(job("a@ok.test"), Resolver(mx), server)
    assert reports[0].outcome is Outcome.DEFERRED
    assert reports[0].mx == "mx2" and reports[0].enhanced == "4.4.1"
    assert [host for host, _ in server.calls] == ["10.0.0.1", "10.0.0.2"]  # both tried


def test_all_hosts_resting_defers_without_connecting() -> None:
    dead = DeadHostCache(clock=lambda: 0.0)
    dead.mark_dead("10.0.0.1")
    server = Server({})
    reports = run(job("a@ok.test"), Resolver(hosts(("mx1", ("10.0.0.1",)))), server, dead)
    assert reports[0].outcome is Outcome.DEFERRED
    assert server.calls == []


def test_a_domain_that_requires_tls_gets_the_required_policy() -> None:
    from dataclasses import replace

    from zoneq.delivery.transport import TlsPolicy

    seen: list[Any] = []

    async def send(**kwargs: Any) -> TransactionResult:
        seen.append(kwargs["tls"])
        return TransactionResult(
            kwargs["host"],
            25,
            tuple(
                RecipientResult(r.address, Verdict.DONE, Stage.END_OF_DATA, Reply(250, ("ok",)))
                for r in kwargs["recipients"]
            ),
            peer=kwargs["host"],
        )

    settings = replace(SETTINGS, tls_policy={"ok.test": TlsPolicy.REQUIRED})
    asyncio.run(
        attempt(
            job("a@ok.test"),
            settings=settings,
            resolver=Resolver(hosts(("mx", ("10.0.0.1",)))),  # type: ignore[arg-type]
            dead_hosts=DeadHostCache(clock=lambda: 0.0),
            body=lambda: [b"x"],
            send=send,
        )
    )
    assert seen == [TlsPolicy.REQUIRED]
    assert settings.tls_for("OK.test") is TlsPolicy.REQUIRED
    assert settings.tls_for("other.test") is TlsPolicy.OPPORTUNISTIC


@pytest.mark.parametrize(
    ("domain", "expected"),
    [
        ("sub.ok.test", TlsPolicy.REQUIRED),  # ".ok.test": every name below ok.test
        ("ok.test", TlsPolicy.NONE),  # but not ok.test itself
        ("open.ok.test", TlsPolicy.OPPORTUNISTIC),  # an exact key beats a parent's
        ("other.test", TlsPolicy.NONE),
    ],
)
def test_tls_for_takes_a_dotted_parent_key_as_the_config_does(
    domain: str, expected: TlsPolicy
) -> None:
    policy = {".ok.test": TlsPolicy.REQUIRED, "open.ok.test": TlsPolicy.OPPORTUNISTIC}
    settings = replace(SETTINGS, tls=TlsPolicy.NONE, tls_policy=policy)
    assert settings.tls_for(domain) is expected


def _taken(extensions: frozenset[str]) -> Any:
    """A server that takes every recipient (250 after the final dot), offering ``extensions``
    in its EHLO reply (none: it only spoke HELO)."""

    async def send(**kwargs: Any) -> TransactionResult:
        return TransactionResult(
            kwargs["host"],
            25,
            tuple(
                RecipientResult(
                    r.address, Verdict.DONE, Stage.END_OF_DATA, Reply(250, ("2.0.0 queued",))
                )
                for r in kwargs["recipients"]
            ),
            peer=kwargs["host"],
            extensions=extensions,
        )

    return send


@pytest.mark.parametrize(
    ("notify", "extensions", "relayed"),
    [
        # RFC 3461 section 5.2.2: NOTIFY=SUCCESS relayed where DSN is not offered.
        (("SUCCESS",), frozenset(), True),
        (("SUCCESS", "FAILURE"), frozenset({"PIPELINING", "8BITMIME"}), True),
        (("success",), frozenset(), True),  # keywords in any case (RFC 3461 section 4.1)
        # The server took NOTIFY itself: the notice is the remote's to send.
        (("SUCCESS",), frozenset({"DSN"}), False),
        # Nobody asked for a success notice.
        (("FAILURE",), frozenset(), False),
        (("NEVER",), frozenset(), False),
        ((), frozenset(), False),
    ],
)
def test_a_delivery_says_relayed_when_success_was_asked_of_a_server_without_dsn(
    notify: tuple[str, ...], extensions: frozenset[str], relayed: bool
) -> None:
    one = Job(
        msg_id=1,
        sender="s@src.test",
        size=10,
        chunks=1,
        domain="ok.test",
        recipients=(JobRecipient(token=5, address="a@ok.test", notify=notify),),
    )
    (report,) = asyncio.run(
        attempt(
            one,
            settings=SETTINGS,
            resolver=Resolver(hosts(("mx", ("10.0.0.1",)))),  # type: ignore[arg-type]
            dead_hosts=DeadHostCache(clock=lambda: 0.0),
            body=lambda: [b"x"],
            send=_taken(extensions),
        )
    )
    assert (report.outcome, report.relayed) == (Outcome.DELIVERED, relayed)
    assert report.reply == "250 2.0.0 queued"  # the reply to the final dot, for the notice


@given(
    outcome=st.sampled_from(Outcome),
    notify=st.frozensets(st.sampled_from(Notify)),
    extensions=st.frozensets(st.sampled_from(["DSN", "PIPELINING", "8BITMIME", "SIZE", "X-DSN"])),
)
def test_a_notice_is_owed_only_for_a_success_asked_and_not_passed_on(
    outcome: Outcome, notify: frozenset[Notify], extensions: frozenset[str]
) -> None:
    """A failure is the failure notice's business (or the retry's), never a "relayed" one;
    a server that offers DSN took NOTIFY on, whatever else it offers."""
    result = TransactionResult("10.0.0.1", 25, (), extensions=extensions)
    owed = owes_relayed_notice(outcome, notify, result)
    assert owed == (
        outcome is Outcome.DELIVERED and Notify.SUCCESS in notify and "DSN" not in extensions
    )
    with_dsn = TransactionResult("10.0.0.1", 25, (), extensions=extensions | {"DSN"})
    assert not owes_relayed_notice(outcome, notify, with_dsn)
