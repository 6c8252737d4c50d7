"""One delivery attempt's decisions: MX answers, the walk over hosts, dead hosts, reports.

The resolver and the SMTP transaction are stand-ins here (their own tests use dnsmasq and
real servers); what is checked is how their answers become per-recipient reports.
"""

from __future__ import annotations

import asyncio
from typing import Any

from zoneq.delivery.attempt import Settings, attempt
from zoneq.delivery.hostcache import DeadHostCache
from zoneq.delivery.mx import MxHost, MxKind, MxResult
from zoneq.delivery.results import RecipientResult, TransactionResult
from zoneq.ipc.messages import Job, JobRecipient, Outcome
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
