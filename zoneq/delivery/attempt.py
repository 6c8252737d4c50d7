"""One delivery attempt for one job: MX lookup, the walk over hosts, and the reports.

Theory of operation
-------------------
A job is the recipients of one message for one domain.  Its MX answer decides first: a
domain that takes no mail (null MX, RFC 7505), does not exist, has no usable host, or whose
MX points back at us bounces every recipient without a connection; a temporary DNS failure
defers them all.  Otherwise the hosts are tried in MX order (RFC 5321 section 5.1), each
address of a host in turn, skipping addresses the dead-host cache remembers.  A recipient
leaves the walk as soon as a server settles it (accepted, refused for good, or deferred by
a 4xx); recipients left with NEXT_HOST (the host would not talk, the connection failed) go
on to the next address.  Whatever is still unsettled after the last address is deferred
with the last reason seen.  A connection that could not be made marks its address dead for
a while, so the other delivery loops skip it too; one that worked marks it alive.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field

from zoneq.delivery.hostcache import DeadHostCache
from zoneq.delivery.mx import MxKind, MxResolver, MxResult
from zoneq.delivery.results import RecipientResult, TransactionResult
from zoneq.delivery.transport import (
    RFC5321_TIMEOUTS,
    BodySource,
    ConnectionCache,
    MailOptions,
    Recipient,
    Timeouts,
    TlsPolicy,
    deliver,
)
from zoneq.ipc.messages import Job, Outcome, RecipientReport
from zoneq.protocol.dsn import Notify, Ret
from zoneq.protocol.replies import Verdict


@dataclass(frozen=True, slots=True)
class Settings:
    """How a zone delivers (from the config)."""

    helo_name: str
    port: int = 25  # MX records carry no port; tests point this at a high port
    ipv6: bool = True
    tls: TlsPolicy = TlsPolicy.OPPORTUNISTIC
    timeouts: Timeouts = RFC5321_TIMEOUTS
    source_address: str | None = None
    # Per destination domain, overriding ``tls`` (RFC 3207 leaves the choice to the client).
    tls_policy: Mapping[str, TlsPolicy] = field(default_factory=dict)

    def tls_for(self, domain: str) -> TlsPolicy:
        return self.tls_policy.get(domain.lower(), self.tls)


Send = Callable[..., Awaitable[TransactionResult]]


async def attempt(
    job: Job,
    *,
    settings: Settings,
    resolver: MxResolver,
    dead_hosts: DeadHostCache,
    body: BodySource,
    send: Send = deliver,
    connections: ConnectionCache | None = None,
) -> list[RecipientReport]:
    """Try to deliver ``job`` once; one report per recipient, in the job's order.

    ``connections``: kept SMTP connections to reuse (and to keep this attempt's in).
    """
    mx = await resolver.resolve(job.domain, ipv6=settings.ipv6)
    if mx.kind is not MxKind.HOSTS:
        return _without_connection(job, mx)
    tokens = {r.address: r.token for r in job.recipients}
    walk = _Walk(
        job,
        settings=settings,
        dead_hosts=dead_hosts,
        body=body,
        send=send,
        connections=connections,
    )
    await walk.run(mx)
    for rcpt in walk.pending:  # no host settled it: try again later
        seen = walk.last.get(rcpt.address)
        if seen is not None:
            outcome, host_name = seen
            report = _report(tokens[rcpt.address], outcome, host_name, None, Outcome.DEFERRED)
        else:
            report = RecipientReport(
                tokens[rcpt.address],
                Outcome.DEFERRED,
                reply="no MX host could be reached (all are resting after failures)",
                enhanced="4.4.1",
            )
        walk.settled[rcpt.address] = report
    return [walk.settled[r.address] for r in job.recipients]


class _Walk:
    """The walk over a job's MX hosts, address by address, until every recipient settles."""

    def __init__(
        self,
        job: Job,
        *,
        settings: Settings,
        dead_hosts: DeadHostCache,
        body: BodySource,
        send: Send,
        connections: ConnectionCache | None,
    ) -> None:
        self.connections = connections
        self.job = job
        self.settings = settings
        self.dead_hosts = dead_hosts
        self.body = body
        self.send = send
        self.tokens = {r.address: r.token for r in job.recipients}
        self.pending = [_recipient(r.address, r.notify, r.orcpt) for r in job.recipients]
        self.settled: dict[str, RecipientReport] = {}
        self.last: dict[str, tuple[RecipientResult, str]] = {}
        ret = (job.ret or "").upper()
        self.options = MailOptions(
            ret=Ret(ret) if ret in ("FULL", "HDRS") else None,
            envid=job.envid,
            size=job.size,
            eight_bit=job.body_8bit,
            smtputf8=job.smtputf8,
        )

    async def run(self, mx: MxResult) -> None:
        for host in mx.hosts:
            for address in host.addresses:
                if not self.pending:
                    return
                if not self.dead_hosts.is_dead(address):
                    await self._try(host.name, address)

    async def _try(self, host_name: str, address: str) -> None:
        result = await self.send(
            host=address,
            port=self.settings.port,
            helo_name=self.settings.helo_name,
            sender=self.job.sender,
            recipients=self.pending,
            body=self.body,
            source_address=self.settings.source_address,
            tls=self.settings.tls_for(self.job.domain),
            tls_server_name=host_name,
            timeouts=self.settings.timeouts,
            options=self.options,
            cache=self.connections,
        )
        if result.peer is None:
            self.dead_hosts.mark_dead(address)
        else:
            self.dead_hosts.mark_alive(address)
        still: list[Recipient] = []
        for rcpt, outcome in zip(self.pending, result.recipients, strict=True):
            if outcome.verdict is Verdict.NEXT_HOST:
                self.last[rcpt.address] = (outcome, host_name)
                still.append(rcpt)
            else:
                token = self.tokens[rcpt.address]
                self.settled[rcpt.address] = _report(token, outcome, host_name, result.local)
        self.pending = still


def _recipient(address: str, notify: Sequence[str], orcpt: str | None) -> Recipient:
    keywords = frozenset(Notify(n.upper()) for n in notify if n.upper() in Notify.__members__)
    return Recipient(address, notify=keywords, orcpt=orcpt)


_OUTCOME = {
    Verdict.DONE: Outcome.DELIVERED,
    Verdict.DEFER: Outcome.DEFERRED,
    Verdict.BOUNCE: Outcome.BOUNCED,
    Verdict.NEXT_HOST: Outcome.DEFERRED,
}


def _report(
    token: int,
    result: RecipientResult,
    mx: str,
    source_ip: str | None,
    force: Outcome | None = None,
) -> RecipientReport:
    reply = result.reply
    text = str(reply) if reply is not None else (result.detail or str(result.stage))
    return RecipientReport(
        token,
        force or _OUTCOME[result.verdict],
        reply=text,
        code=reply.code if reply is not None else None,
        enhanced=str(result.status) if result.status is not None else None,
        mx=mx,
        source_ip=source_ip,
        possible_duplicate=result.possible_duplicate,
    )


def _without_connection(job: Job, mx: MxResult) -> list[RecipientReport]:
    """Every recipient settled by the MX answer alone (bounce or defer, no connection)."""
    outcome = Outcome.DEFERRED if mx.kind is MxKind.TEMPORARY else Outcome.BOUNCED
    code = 451 if outcome is Outcome.DEFERRED else 550
    if mx.kind is MxKind.NULL_MX:
        code = 556  # RFC 7505 section 4.1
    status = str(mx.status) if mx.status is not None else None
    reply = f"{code} {status + ' ' if status else ''}{mx.reason}"
    return [
        RecipientReport(r.token, outcome, reply=reply, code=None, enhanced=status)
        for r in job.recipients
    ]
