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
a while, so the other delivery loops skip it too; one that worked marks it alive.  A
connection that failed because our own source address could not be bound (it left the
host) is our fault, not the host's: the host is not marked dead (``pool.bind_failure``),
the try does not count toward ``max_addresses`` (no address was reached), the pool rests
that source for the dead-host period (so the worker's other jobs stop picking it), and the
same MX address is tried again from another pool address of the family.  Only when the
family has none left does the walk skip that family's MX addresses, which would fail to
bind alike.  When every address was skipped as resting, the recipients are deferred with
the failure that put the first of them to rest (``<host>[<ip>] resting after: ...``), so a
bounce at expiry says what was wrong (RFC 3464 section 2.3.6).  Except on the job's last
attempt before expiry (``Job.last_attempt``): then no address rests, since a host back
within its dead period must be tried before its recipients bounce.

One attempt connects to at most ``max_addresses`` addresses (``[delivery]
max_mx_addresses``, Postfix's ``smtp_mx_address_limit``, 5); the rest wait for the next
attempt.  A recipient domain that is an address literal is its own one host, with no DNS
(``MxResolver.literal``).  The envelope carries an ASCII local part at a U-label domain as
the A-label (``envelope_address``), so a server without SMTPUTF8 can take it; SMTPUTF8 is
still required when a local part, or the header section, is not ASCII (RFC 6531 3.4).

Address families: the walk tries only the MX addresses of a family the zone's pool has
(an IPv4 source cannot connect to an IPv6 address, and failing to bind is no news about
the MX).  A pool with no IPv6 address turns IPv6 off for the zone, whatever ``ipv6`` says;
with no pool the system picks a source of either family.  When the MX hosts have addresses
only of families the pool lacks, the recipients are deferred with 4.4.4 (RFC 3463 section
3.5, "unable to route"): a local limit the operator can lift by adding a pool address, so
it must not bounce.  The source address is chosen once per family for the whole walk
(again only after it failed to bind).

A zone with a smarthost has no MX walk: its one host is the relay (host, port, TLS and
AUTH from the config).  An address literal is used as it is.  A name is resolved by the
worker's own resolver (``MxResolver.resolve_host``: the configured nameservers, the answer
cache), never by the system's, and as the host itself, never as an MX: the relay is the
next hop (Postfix's ``relayhost = [name]``).  A, and AAAA only when the zone can send over
IPv6 (``ipv6``, and an IPv6 address in the pool if it has one); the addresses then go
through the walk as one MX host's would (dead-host cache, families, reports naming the
smarthost), while TLS still checks the certificate against the configured name (RFC 6125
section 6.2.1: the reference identity is the name the client was given, not an address it
found).  A smarthost name that does not resolve defers every recipient, whatever DNS said:
it is the operator's configuration, not the recipients' fault, so it must never bounce them
(4.4.3 for a failed lookup, 4.4.4 for NXDOMAIN or no address: RFC 3463 section 3.5).

Each attempt binds one source address of the zone's pool (``pool.py``), skipping the ones
the core says are resting for the domain, and gives that address's EHLO name; the address
goes back in every report (``source_ip``), which is how the core learns which address a
"blocked" reply was about.

Plugins (issue 5): ``sender:headers`` is asked once per attempt, before any connection, and
the fields it adds go in front of the copy sent to every host of the walk (``headers.py``,
which also removes the routing header); ``sender:connect`` is asked before each host.
Either may refuse with a reply of its own (a 4xx defers, a 5xx bounces).  A plugin that
fails defers the recipients with 451 4.3.0 and a logged error: nothing is lost.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field

from zoneq.config.types import domain_lookup
from zoneq.delivery.headers import OutgoingBody
from zoneq.delivery.hostcache import DeadHostCache
from zoneq.delivery.mx import MxHost, MxKind, MxResolver, MxResult
from zoneq.delivery.pool import Source, SourcePool, bind_failure, family_of
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
from zoneq.delivery.transport.data import body_damaged
from zoneq.ipc.messages import Job, Outcome, RecipientReport
from zoneq.plugin import ConnectArgs, Hook, PluginFailure, PluginHost, SenderHeadersArgs
from zoneq.protocol.domains import ascii_address
from zoneq.protocol.dsn import Notify, Ret
from zoneq.protocol.ids import format_id
from zoneq.protocol.replies import DAMAGED_BODY, EnhancedStatus, Reply, Verdict
from zoneq.protocol.reply_rules import ReplyRule, first_match

log = logging.getLogger("zoneq.delivery")


@dataclass(frozen=True, slots=True)
class Relay:
    """A zone's smarthost: every recipient goes there, whatever its domain."""

    host: str
    """A host name, resolved at each attempt (A/AAAA, never MX), or an address (the
    config's ``[192.0.2.25]`` without brackets), used as it is."""
    port: int
    tls: TlsPolicy
    implicit_tls: bool = False
    """TLS from the first byte (port 465, RFC 8314 section 3.3) instead of STARTTLS."""
    auth: tuple[str, str] | None = None
    """(user, password) for AUTH (RFC 4954), sent only over TLS unless ``tls`` is NONE."""


@dataclass(frozen=True, slots=True)
class Settings:
    """How a zone delivers (from the config)."""

    helo_name: str
    port: int = 25  # MX records carry no port; tests point this at a high port
    ipv6: bool = True
    tls: TlsPolicy = TlsPolicy.OPPORTUNISTIC
    timeouts: Timeouts = RFC5321_TIMEOUTS
    # Per destination domain, overriding ``tls`` (RFC 3207 leaves the choice to the client).
    tls_policy: Mapping[str, TlsPolicy] = field(default_factory=dict)
    # The zone's source addresses; None (or an empty pool): the system picks, ``helo_name``.
    sources: SourcePool | None = None
    relay: Relay | None = None
    zone: str = ""
    # Removed from the copy that goes out (issue 5), unless the job names the field that
    # chose its zone (``Job.zone_header``: the config may have renamed it since).
    zone_header: str = "X-Sending-Zone"
    rules: tuple[ReplyRule, ...] = ()  # reply rules (config ``[reply_rules]``)
    max_addresses: int = 5  # addresses connected to per attempt (``max_mx_addresses``)

    def tls_for(self, domain: str) -> TlsPolicy:
        if self.relay is not None:
            return self.relay.tls
        # The config's own lookup: the exact name, then the closest ".parent" key.
        found = domain_lookup(self.tls_policy, domain)
        return self.tls if found is None else found

    @property
    def families(self) -> frozenset[int] | None:
        """The IP versions the zone can connect from (its pool's); None: any."""
        return self.sources.families if self.sources is not None else None

    def source_for(
        self, resting: Sequence[str], family: int | None = None, exclude: Collection[str] = ()
    ) -> Source:
        if self.sources is None:
            return Source(None, self.helo_name)
        return self.sources.choose(resting, family, exclude)


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
    plugins: PluginHost | None = None,
) -> list[RecipientReport]:
    """Try to deliver ``job`` once; one report per recipient, in the job's order.

    ``connections``: kept SMTP connections to reuse (and to keep this attempt's in).
    ``plugins``: the send-time hooks (``sender:headers``, ``sender:connect``).
    """
    if settings.relay is not None:
        mx = await _relay_hosts(job.domain, settings.relay, settings, resolver)
        if mx.kind is not MxKind.HOSTS:
            return _relay_unresolved(job, mx)
    else:
        mx = await resolver.resolve(job.domain, ipv6=settings.ipv6)  # a literal as it is
        if mx.kind is not MxKind.HOSTS:
            return _without_connection(job, mx)
    usable = _usable_hosts(mx, settings.families)
    if usable is None:
        return _no_usable_family(job, mx, settings.families or frozenset())
    mx = usable
    outgoing = OutgoingBody(body, job.zone_header or settings.zone_header)
    if plugins is not None and plugins.handles(Hook.SENDER_HEADERS):
        refused = await _sender_headers(job, settings.zone, plugins, outgoing)
        if refused is not None:
            return refused
    walk = _Walk(
        job,
        settings=settings,
        dead_hosts=dead_hosts,
        body=outgoing,
        send=send,
        connections=connections,
        plugins=plugins,
        smtputf8=await _needs_smtputf8(job, outgoing),
    )
    await walk.run(mx)
    for index in walk.pending:  # no host settled it: try again later
        token = job.recipients[index].token
        seen = walk.last.get(index)
        if seen is not None:
            outcome, host_name = seen
            report = _report(token, outcome, host_name, None, Outcome.DEFERRED)
        else:
            report = RecipientReport(
                token, Outcome.DEFERRED, reply=walk.resting_reason(), enhanced="4.4.1"
            )
        walk.settled[index] = report
    return [walk.settled[index] for index in range(len(job.recipients))]


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
        plugins: PluginHost | None = None,
        smtputf8: bool = False,
    ) -> None:
        self.connections = connections
        connect_hook = plugins is not None and plugins.handles(Hook.SENDER_CONNECT)
        self.plugins = plugins if connect_hook else None
        # One source per family for the whole walk: the address the core told us to avoid
        # stays avoided on every MX host, and the reports name the address the replies were
        # about.  Chosen when first needed, so a walk over IPv4 alone takes no IPv6 turn;
        # None: no address of the family could be bound.
        self._sources: dict[int | None, Source | None] = {}
        self._unbound: set[str] = set()  # pool addresses that failed to bind in this walk
        self._resting: tuple[str, str] | None = None  # (host, address) first skipped dead
        self.job = job
        self.settings = settings
        self.dead_hosts = dead_hosts
        self.body = body
        self.send = send
        # Keyed by the recipient's place in the job: two addresses of one job may be sent
        # as one (a U-label and its A-label, ``envelope_address``).
        self.recipients = [_recipient(r.address, r.notify, r.orcpt) for r in job.recipients]
        self.sender = envelope_address(job.sender)
        self.pending = list(range(len(job.recipients)))
        self.settled: dict[int, RecipientReport] = {}
        self.last: dict[int, tuple[RecipientResult, str]] = {}
        self.tried = 0  # addresses connected to in this walk
        ret = (job.ret or "").upper()
        self.options = MailOptions(
            ret=Ret(ret) if ret in ("FULL", "HDRS") else None,
            envid=job.envid,
            size=job.size,
            eight_bit=job.body_8bit,
            smtputf8=smtputf8,
        )

    async def run(self, mx: MxResult) -> None:
        # Postfix's smtp_mx_address_limit: a bound on addresses tried, not on hosts, since
        # one host may have a hundred addresses and each may take 300 s to time out
        # (RFC 5321 section 4.5.3.2).  Resting addresses cost nothing and do not count;
        # nor does a try whose source address could not be bound: it reached no address.
        # A family with no source left that binds has its addresses skipped (they would
        # fail alike), so an IPv4 pool that left the host does not keep every attempt from
        # the IPv6 ones.
        for host in mx.hosts:
            for address in host.addresses:
                if not self.pending or self.tried >= self.settings.max_addresses:
                    return
                if self._skip(host.name, address):
                    continue
                if await self._try(host.name, address):
                    self.tried += 1

    def _skip(self, host_name: str, address: str) -> bool:
        """Skip ``address`` in this walk: the dead-host cache rests it, or no source of its
        family can be bound.  The first one resting is remembered for the reports.  On the
        job's last attempt (``Job.last_attempt``) nothing rests: the recipients bounce
        after it, and a host back within its dead period must get its try first; a
        failure is still marked (``_mark``)."""
        if not self.job.last_attempt and self.dead_hosts.is_dead(address):
            self._resting = self._resting or (host_name, address)
            return True
        family = self._family(address)
        return family in self._sources and self._sources[family] is None

    def resting_reason(self) -> str:
        """Why recipients no host settled were never sent: the failure that put the first
        skipped address to rest (the reason a bounce at expiry must give)."""
        if self._resting is None:
            return "no MX host could be reached"
        host_name, address = self._resting
        why = self.dead_hosts.why_dead(address) or "earlier failures"
        return f"{host_name}[{address}] resting after: {why}"

    def _family(self, address: str) -> int | None:
        """The key of ``address``'s source: its family, or None when the system picks."""
        return family_of(address) if self.settings.families is not None else None

    def _source(self, family: int | None) -> Source | None:
        """The walk's source for ``family``; None when none of its addresses binds."""
        if family not in self._sources:
            try:
                source: Source | None = self.settings.source_for(
                    self.job.rested, family, exclude=self._unbound
                )
            except LookupError:  # every address of the family failed to bind
                source = None
            self._sources[family] = source
        return self._sources[family]

    def _cannot_bind(self, source: Source, family: int | None) -> bool:
        """Did the connection fail because ``source`` cannot be bound here (our fault)?
        Then the pool rests it for the dead-host period, so this worker's other jobs pick
        another address meanwhile, and this walk picks another of the family at once."""
        if source.address is None or self.settings.sources is None:
            return False  # the system picked, and it picks one that binds
        why = bind_failure(source.address)
        if why is None:
            return False
        log.error("source address %s cannot be bound: %s", source.address, why)
        self.settings.sources.rest_unbindable(source.address, self.dead_hosts.base)
        self._unbound.add(source.address)
        del self._sources[family]
        return True

    async def _try(self, host_name: str, address: str) -> bool:
        """One address, from the first source of its family that binds; False when none
        does (no connection was made, so it does not count toward ``max_addresses``)."""
        family = self._family(address)
        while self.pending and (source := self._source(family)) is not None:
            if self.plugins is not None and not await self._may_connect(host_name, address, source):
                return True  # every recipient is settled: the walk ends either way
            result = await self._send(host_name, address, source)
            bound = result.peer is not None or not self._cannot_bind(source, family)
            if bound:
                self._mark(address, result)
            self._settle(result, host_name, source)
            if bound:
                return True
        return False

    def _mark(self, address: str, result: TransactionResult) -> None:
        """Tell the dead-host cache how ``address`` did, with the failure's text."""
        if result.peer is not None:
            self.dead_hosts.mark_alive(address)
            return
        # Every recipient met the same failed connection: the first one's text is it.
        reason = _reply_text(result.recipients[0]) if result.recipients else ""
        self.dead_hosts.mark_dead(address, reason)

    async def _send(self, host_name: str, address: str, source: Source) -> TransactionResult:
        relay = self.settings.relay
        return await self.send(
            host=address,
            port=relay.port if relay is not None else self.settings.port,
            helo_name=source.helo_name,
            sender=self.sender,
            recipients=[self.recipients[index] for index in self.pending],
            body=self.body,
            source_address=source.address,
            tls=self.settings.tls_for(self.job.domain),
            tls_server_name=host_name,
            timeouts=self.settings.timeouts,
            options=self.options,
            cache=self.connections,
            slot=self.job.slot,
            **(_relay_options(relay) if relay is not None else {}),
        )

    def _settle(self, result: TransactionResult, host_name: str, source: Source) -> None:
        """Settle the recipients ``result`` decided; the others wait for the next address."""
        still: list[int] = []
        for index, outcome in zip(self.pending, result.recipients, strict=True):
            rcpt = self.recipients[index]
            if outcome.verdict is Verdict.NEXT_HOST and not self._ruled(outcome):
                self.last[index] = (outcome, host_name)
                still.append(index)
            else:
                token = self.job.recipients[index].token
                local = result.local or source.address
                report = _report(token, outcome, host_name, local)
                if rcpt.notify and owes_relayed_notice(report.outcome, rcpt.notify, result):
                    report = dataclasses.replace(report, relayed=True)
                self.settled[index] = report
        self.pending = still

    def _ruled(self, outcome: RecipientResult) -> bool:
        """Does a reply rule claim this reply (a provider's "slow down" or "blocked" under
        a 421)?  Then it settles here, deferred: the provider's other MX hosts throttle and
        block alike, and asking each in turn is what it asked us not to do (the core reads
        the rule again from the report, ``reply_rules.py``)."""
        reply = outcome.reply
        if reply is None or not self.settings.rules:
            return False
        status = str(reply.enhanced) if reply.enhanced is not None else None
        return first_match(self.settings.rules, reply.code, status, str(reply)) is not None

    async def _may_connect(self, host_name: str, address: str, source: Source) -> bool:
        """Ask ``sender:connect``; False when a plugin refused or failed (all settled)."""
        assert self.plugins is not None
        args = ConnectArgs(
            zone=self.settings.zone,
            domain=self.job.domain,
            mx_host=host_name,
            mx_address=address,
            source_address=source.address,
        )
        try:
            result = await self.plugins.call(Hook.SENDER_CONNECT, args)
        except PluginFailure as exc:
            log.error("%s: %s to %s deferred", exc, format_id(self.job.msg_id), self.job.domain)
            refusal = _plugin_failed(exc)
        else:
            if result.reply is None:
                return True
            refusal = result.reply
        for index in self.pending:
            token = self.job.recipients[index].token
            self.settled[index] = _refused(token, refusal, host_name, source.address)
        self.pending = []
        return False


def owes_relayed_notice(
    outcome: Outcome, notify: Collection[Notify], result: TransactionResult
) -> bool:
    """Whether a recipient's report must say ``relayed``: delivered, with NOTIFY=SUCCESS,
    by a server whose EHLO did not offer DSN (or that only took HELO).  RFC 3461 section
    5.2.2: NOTIFY was not passed on, so the remote owes the sender nothing, and zoneq, the
    last MTA that knew, must send the "relayed" notice itself (the core composes it).  A
    server that offers DSN got NOTIFY, ORCPT, RET and ENVID, and owes any notice itself."""
    return (
        outcome is Outcome.DELIVERED and Notify.SUCCESS in notify and "DSN" not in result.extensions
    )


def _recipient(address: str, notify: Sequence[str], orcpt: str | None) -> Recipient:
    keywords = frozenset(Notify(n.upper()) for n in notify if n.upper() in Notify.__members__)
    return Recipient(envelope_address(address), notify=keywords, orcpt=orcpt)


def envelope_address(address: str) -> str:
    """``address`` as the envelope carries it: an ASCII local part at a U-label domain with
    the domain's A-label (``bob@bücher.example`` as ``bob@xn--bcher-kva.example``).

    RFC 5890 section 2.3.2.1: the two forms are one domain, so the same mailbox, and the
    A-label form is ASCII: it goes to a server without SMTPUTF8 instead of bouncing 5.6.7
    (RFC 6531 section 3.4 forbids only sending non-ASCII to it).  A non-ASCII local part
    has no ASCII form (RFC 6530 section 4.2: no downgrade), and a domain IDNA refuses is
    kept as it is (the server judges it): both stay non-ASCII, and the transport bounces
    them at such a server.
    """
    try:
        return ascii_address(address)
    except ValueError:
        return address


async def _needs_smtputf8(job: Job, outgoing: OutgoingBody) -> bool:
    """Whether the message itself (not its envelope) needs SMTPUTF8: it came with it (the
    client said SMTPUTF8, or the API saw a non-ASCII address) and its header section is
    not ASCII (RFC 6532 UTF-8 fields, which must not go raw to a server without it).

    The envelope is judged by the transport, address by address, after
    ``envelope_address``: a job flagged only for ``bob@bücher.example`` goes as ASCII.
    """
    if not job.smtputf8:
        return False
    try:
        header = await outgoing.header()
    except Exception:  # the body's fault: it shows again at DATA, and is reported there
        return True
    return not (header.isascii() and outgoing.added.isascii())


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
    return RecipientReport(
        token,
        force or _OUTCOME[result.verdict],
        reply=_reply_text(result),
        code=reply.code if reply is not None else None,
        enhanced=str(result.status) if result.status is not None else None,
        mx=mx,
        source_ip=source_ip,
        possible_duplicate=result.possible_duplicate,
    )


def _reply_text(result: RecipientResult) -> str:
    """The server's reply, or what went wrong without one (a refused connection)."""
    if result.reply is not None:
        return str(result.reply)
    return result.detail or str(result.stage)


async def _relay_hosts(
    domain: str, relay: Relay, settings: Settings, resolver: MxResolver
) -> MxResult:
    """The smarthost in place of the domain's MX hosts: an address literal as it is, a name
    as its addresses (the relay routes: no MX lookup)."""
    if family_of(relay.host) is None:
        families = settings.families
        # A pool without IPv6 cannot connect to an IPv6 address: do not ask for any.
        pool_without_ipv6 = families is not None and 6 not in families
        result = await resolver.resolve_host(
            relay.host, ipv6=settings.ipv6 and not pool_without_ipv6
        )
        if settings.ipv6 and pool_without_ipv6 and result.kind is MxKind.UNROUTABLE:
            # The resolver would say "IPv6 is turned off": here the pool is why.
            reason = (
                f"host {result.domain} has no IPv4 address, "
                "and the zone's source pool has no IPv6 address"
            )
            return dataclasses.replace(result, reason=reason)
        return result
    host = MxHost(name=relay.host, preference=0, addresses=(relay.host,))
    return MxResult(MxKind.HOSTS, domain, "smarthost", None, hosts=(host,))


def _relay_unresolved(job: Job, mx: MxResult) -> list[RecipientReport]:
    """Every recipient deferred: the smarthost's name has no address now.  Never bounced,
    even for NXDOMAIN: the name is the operator's, and fixing it should deliver the mail.
    RFC 3463 section 3.5: 4.4.3 "directory server failure" for a lookup that failed, 4.4.4
    "unable to route" for an answer without an address."""
    status = "4.4.3" if mx.kind is MxKind.TEMPORARY else "4.4.4"
    reply = f"451 {status} the zone's smarthost cannot be resolved: {mx.reason}"
    return _settle_all(job, Outcome.DEFERRED, reply, status)


def _usable_hosts(mx: MxResult, families: frozenset[int] | None) -> MxResult | None:
    """``mx`` with only the addresses the pool can connect from (``families``; None: all),
    hosts left with none dropped; None when no host is left."""
    if families is None:
        return mx
    hosts = []
    for host in mx.hosts:
        kept = tuple(a for a in host.addresses if family_of(a) in families)
        if kept:
            hosts.append(MxHost(host.name, host.preference, kept))
    if not hosts:
        return None
    return dataclasses.replace(mx, hosts=tuple(hosts))


def _no_usable_family(job: Job, mx: MxResult, families: frozenset[int]) -> list[RecipientReport]:
    """Every recipient deferred: the MX hosts have addresses only of families the pool
    lacks.  4.4.4, RFC 3463 section 3.5 "unable to route"; 451 because the limit is ours
    (RFC 5321 section 4.2.5 asks a client to treat its own faults as temporary)."""
    have = " and ".join(f"IPv{f}" for f in sorted(families)) or "no"
    reply = (
        f"451 4.4.4 no usable address family: the zone's source pool has {have} "
        f"addresses only, and no MX host of {mx.domain} has one of that family"
    )
    return _settle_all(job, Outcome.DEFERRED, reply, "4.4.4")


def _settle_all(
    job: Job, outcome: Outcome, reply: str, enhanced: str | None
) -> list[RecipientReport]:
    """One report per recipient, all alike: settled before any connection (no code: the
    reply is ours, not a server's)."""
    return [
        RecipientReport(r.token, outcome, reply=reply, code=None, enhanced=enhanced)
        for r in job.recipients
    ]


def _relay_options(relay: Relay) -> dict[str, object]:
    return {"implicit_tls": relay.implicit_tls, "auth": relay.auth}


async def _sender_headers(
    job: Job, zone: str, plugins: PluginHost, outgoing: OutgoingBody
) -> list[RecipientReport] | None:
    """Ask ``sender:headers`` once for this attempt and put the added fields in front of
    ``outgoing``; the reports of a refusal or a failure, else None."""
    args = SenderHeadersArgs(
        zone=zone,
        message_id=format_id(job.msg_id),
        sender=job.sender,
        recipients=tuple(r.address for r in job.recipients),
        domain=job.domain,
        headers=await outgoing.header(),
        body=outgoing.body,
    )
    try:
        result = await plugins.call(Hook.SENDER_HEADERS, args)
    except PluginFailure as exc:
        log.error("%s: %s to %s deferred", exc, format_id(job.msg_id), job.domain)
        if exc.__cause__ is not None and body_damaged(exc.__cause__):
            # The plugin read the body (DKIM signs it) and met the damage: the message's
            # fault, not the plugin's, reported as sending the body would have.
            return [_damaged(r.token, exc.__cause__) for r in job.recipients]
        return [_refused(r.token, _plugin_failed(exc), None, None) for r in job.recipients]
    if result.reply is not None:
        return [_refused(r.token, result.reply, None, None) for r in job.recipients]
    outgoing.added = b"".join(result.headers)
    return None


def _plugin_failed(exc: PluginFailure) -> Reply:
    """451 4.3.0 (our own fault, RFC 3463 section 3.4) naming the plugin, for the event."""
    return Reply(451, (f"plugin {exc.plugin} failed at {exc.hook}",), EnhancedStatus(4, 3, 0))


def _damaged(token: int, exc: BaseException) -> RecipientReport:
    """A recipient deferred because its stored message is damaged (no remote reply)."""
    return RecipientReport(
        token,
        Outcome.DEFERRED,
        reply=f"reading the message body failed: {type(exc).__name__}: {exc}",
        enhanced=str(DAMAGED_BODY),
    )


def _refused(token: int, reply: Reply, mx: str | None, source_ip: str | None) -> RecipientReport:
    """A recipient settled by a plugin's reply: 4xx defers, 5xx bounces.

    ``mx`` is the host the plugin was asked about (for events and per-MX limits); no
    connection was made, so the report says the reply is ours (``local_reply``) and a
    notice names no Remote-MTA for it (RFC 3464 sections 2.3.5 and 2.3.6)."""
    return RecipientReport(
        token,
        Outcome.BOUNCED if reply.is_permanent else Outcome.DEFERRED,
        reply=str(reply),
        code=reply.code,
        enhanced=str(reply.enhanced) if reply.enhanced is not None else None,
        mx=mx,
        source_ip=source_ip,
        local_reply=True,
    )


def _without_connection(job: Job, mx: MxResult) -> list[RecipientReport]:
    """Every recipient settled by the MX answer alone (bounce or defer, no connection)."""
    outcome = Outcome.DEFERRED if mx.kind is MxKind.TEMPORARY else Outcome.BOUNCED
    code = 451 if outcome is Outcome.DEFERRED else 550
    if mx.kind is MxKind.NULL_MX:
        code = 556  # RFC 7505 section 4.1
    status = str(mx.status) if mx.status is not None else None
    reply = f"{code} {status + ' ' if status else ''}{mx.reason}"
    return _settle_all(job, outcome, reply, status)
