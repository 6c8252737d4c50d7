"""MX resolution: from a recipient domain to an ordered list of hosts and their addresses.

This is the only module that imports dnspython.  Everything dnspython can raise is turned
into an ``MxResult`` here, a value the delivery loop branches on; nothing from ``dns`` leaks
out, and no DNS failure is raised as an exception.

Theory of operation
-------------------
``MxResolver.resolve(domain)`` does, in order:

1. One MX query.  NXDOMAIN is ``NO_DOMAIN`` (bounce).  An empty answer (NODATA) means there
   is no MX, so the domain itself is the only host, at preference 0: the implicit MX of
   RFC 5321 section 5.1.  A single MX whose exchange is the root (``0 .``) is a null MX,
   RFC 7505: the domain accepts no mail, bounce at once without connecting.  SERVFAIL,
   REFUSED, a timeout or anything else that says nothing about the domain is ``TEMPORARY``:
   defer, never bounce, because a resolver outage must not turn into a wave of bounces.

2. A and (unless IPv6 is off for the zone) AAAA queries for every MX host, all at once.
   A host whose name has no address is skipped (RFC 5321 section 5.1 asks only that some
   host be usable); whether its lookup failed temporarily is remembered for step 4.

3. Loop detection, RFC 5321 section 5.1: "The relay host MUST then inspect the list for any
   of the names or addresses by which it might be known in mail transactions.  If a matching
   record is found, all records at that preference level and higher-numbered ones MUST be
   discarded".  Our names and addresses are given to the resolver; loopback addresses
   count as ours too (connecting to them reaches this machine) unless ``allow_loopback``
   is set, as the tests do.  The unspecified address (``0.0.0.0``, ``::``, also mapped as
   ``::ffff:0.0.0.0``) is ours always: a connection to it reaches this host's listeners,
   loopback ones included, so it is never a remote server.  IPv4-mapped addresses are
   judged as the IPv4 address they reach.  Link-local and multicast addresses are not
   SMTP destinations and are dropped as unusable.

4. What is left is ordered by preference, equal preferences in random order (RFC 5321
   section 5.1: the client "SHOULD randomize them to spread the load"), with the injected
   ``random.Random`` so tests are deterministic.  If nothing is left: ``LOOP`` if hosts were
   discarded as ourselves, else ``TEMPORARY`` if any address lookup failed temporarily,
   else ``UNROUTABLE`` (RFC 5321 section 5.1: "If MX records are present, but none of them
   are usable, or the implicit MX is unusable, this situation MUST be reported as an error").

The result lists every usable host, so the caller can walk it and try a second host when the
first one fails.  MX records carry no port: the port to connect to is a setting of the
caller (25 unless a zone says otherwise).

``MxResolver.resolve`` hands an address literal to ``literal`` (``[192.0.2.1]``,
``[IPv6:2001:db8::1]``): RFC 5321 sections 2.3.5 and 4.1.3 make it a destination without
DNS, so it is never looked up (a resolver would ask for ``[192.0.2.1].`` and bounce the
mail as NXDOMAIN).  Its one host is the address itself, through the same loop check as an
MX host's addresses (our own address, and loopback unless allowed, is ``LOOP``).  A literal
that is not an IPv4 or tagged IPv6 address (``[2001:db8::1]`` without its tag, a general
address literal, garbage) is ``BAD_LITERAL``, 5.1.3: no host could ever take it.

``MxResolver.resolve_host(name)`` is step 2 alone, for a host that is the next hop itself
rather than a mail domain: a smarthost given by name (Postfix's ``relayhost = [name]``: no
MX lookup).  Its one host comes back as an ``MxHost`` at preference 0, addresses ordered as
above, through the same cache and shared questions; there is no loop check (the operator
named the host, and a filter on loopback is a usual relay).  NXDOMAIN is ``NO_DOMAIN``, no
address ``UNROUTABLE``, a failure ``TEMPORARY``: what to make of them is the caller's call.

Caching
-------
Each DNS answer (per name and record type) is cached for its TTL in an ``AnswerCache``:
positive answers for the TTL of their RRset, negative ones (NXDOMAIN and NODATA) for
min(SOA TTL, SOA MINIMUM) as RFC 2308 section 5 says, or ``DEFAULT_NEGATIVE_TTL`` when the
response carries no SOA.  Temporary failures are not cached: the next delivery attempt asks
again.  The cache reads time only through the injected clock (monotonic seconds), holds a
bounded number of answers and evicts the least recently used.  dnspython's own cache is not
used, because it reads the wall clock itself.

A question already on its way is not asked again: every lookup of the same name and type
that comes while it is out waits for its answer (or its failure).  A bulk send opens many
connections to one new domain at once, and an answer with a TTL of 0 is never cached, so
without this each of them would ask the same three questions.  The price: a lookup that
joins a question late shares its failure (a timeout counted from when it was asked) and
does not ask again itself; its delivery is deferred and retried on the zone's schedule,
as failures are never cached.
"""

from __future__ import annotations

import asyncio
import enum
import ipaddress
import random
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final

import dns.asyncresolver
import dns.exception
import dns.message
import dns.name
import dns.rdatatype
import dns.resolver

from zoneq.protocol.domains import normal_domain
from zoneq.protocol.replies import EnhancedStatus

__all__ = [
    "DEFAULT_MAX_NEGATIVE_TTL",
    "DEFAULT_MAX_TTL",
    "DEFAULT_NEGATIVE_TTL",
    "AnswerCache",
    "DnsAnswer",
    "DnsOutcome",
    "MxHost",
    "MxKind",
    "MxResolver",
    "MxResult",
    "address_literal",
    "negative_ttl",
]

DEFAULT_NEGATIVE_TTL: Final = 60.0
"""Seconds to cache NXDOMAIN/NODATA when the response has no SOA to take the TTL from."""

DEFAULT_MAX_TTL: Final = 86_400.0
"""Upper bound on how long any positive answer is cached, whatever its TTL says."""

DEFAULT_MAX_NEGATIVE_TTL: Final = 10_800.0
"""Upper bound for negative answers: RFC 2308 section 5 suggests one to three hours."""

# RFC 3463 / RFC 7505 enhanced status codes for each permanent or temporary outcome.
_NULL_MX_STATUS: Final = EnhancedStatus(5, 1, 10)  # RFC 7505 section 4.1: 556 5.1.10
_NO_DOMAIN_STATUS: Final = EnhancedStatus(5, 1, 2)  # RFC 3463: bad destination system address
_UNROUTABLE_STATUS: Final = EnhancedStatus(5, 4, 4)  # RFC 3463: unable to route
_TEMPORARY_STATUS: Final = EnhancedStatus(4, 4, 3)  # RFC 3463: directory server failure
_LOOP_STATUS: Final = EnhancedStatus(5, 4, 6)  # RFC 3463: routing loop detected
_BAD_LITERAL_STATUS: Final = EnhancedStatus(5, 1, 3)  # RFC 3463: bad destination syntax


class MxKind(enum.Enum):
    """What an MX lookup came to; the delivery loop branches on this."""

    HOSTS = "hosts"
    """``MxResult.hosts`` holds at least one host with at least one address: connect."""
    NULL_MX = "null-mx"
    """RFC 7505 null MX: the domain accepts no mail.  Bounce at once, do not connect."""
    NO_DOMAIN = "no-domain"
    """NXDOMAIN (or a name that is not a valid domain name): bounce at once."""
    UNROUTABLE = "unroutable"
    """The domain exists but no MX host (or implicit MX) has an address: bounce."""
    TEMPORARY = "temporary"
    """The resolver failed (SERVFAIL, timeout, no reply): defer, do not bounce."""
    LOOP = "loop"
    """Every remaining MX host is this machine: bounce, mail would loop back to us."""
    BAD_LITERAL = "bad-literal"
    """An address literal that is no address (RFC 5321 section 4.1.3): bounce."""


@dataclass(frozen=True, slots=True)
class MxHost:
    """One candidate host: its name, MX preference and usable addresses (IPv4 first)."""

    name: str
    """Host name, lower case, without the trailing dot."""
    preference: int
    """MX preference; 0 for the implicit MX."""
    addresses: tuple[str, ...]
    """Addresses to try in order: IPv4 then IPv6, each in the order DNS gave them."""


@dataclass(frozen=True, slots=True)
class MxResult:
    """The outcome of resolving one domain."""

    kind: MxKind
    domain: str
    reason: str
    """Human-readable, for logs and the diagnostic text of a DSN."""
    status: EnhancedStatus | None
    """RFC 3463 status for a bounce or deferral; None for ``HOSTS``."""
    hosts: tuple[MxHost, ...] = ()
    """Candidates in the order to try them; empty unless ``kind`` is ``HOSTS``."""
    implicit: bool = False
    """True when the domain had no MX and its own address records are used."""

    @property
    def permanent(self) -> bool:
        """True when the recipient should be bounced now rather than retried."""
        return self.kind not in (MxKind.HOSTS, MxKind.TEMPORARY)


class DnsOutcome(enum.Enum):
    """A cacheable answer to one question: records, no such name, or no such records."""

    ANSWER = "answer"
    NXDOMAIN = "nxdomain"
    NODATA = "nodata"


@dataclass(frozen=True, slots=True)
class DnsAnswer:
    """One cached answer.  ``mx`` holds (preference, exchange) pairs for MX questions,
    ``addresses`` the address texts for A/AAAA questions; the other one stays empty."""

    outcome: DnsOutcome
    ttl: float
    mx: tuple[tuple[int, str], ...] = ()
    addresses: tuple[str, ...] = ()


@dataclass(slots=True)
class _Entry:
    answer: DnsAnswer
    expires: float


@dataclass(slots=True)
class AnswerCache:
    """DNS answers keyed by (name, record type), kept for their TTL, LRU-bounded.

    ``clock`` returns monotonic seconds; it is the only source of time here.
    """

    clock: Callable[[], float]
    max_entries: int = 10_000
    _entries: OrderedDict[tuple[str, str], _Entry] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if self.max_entries < 1:
            raise ValueError(f"max_entries must be at least 1, not {self.max_entries}")

    def get(self, name: str, rdtype: str) -> DnsAnswer | None:
        """The cached answer, or None if there is none or it has expired."""
        key = (name.lower(), rdtype)
        entry = self._entries.get(key)
        if entry is None:
            return None
        if self.clock() >= entry.expires:
            del self._entries[key]
            return None
        self._entries.move_to_end(key)
        return entry.answer

    def put(self, name: str, rdtype: str, answer: DnsAnswer) -> None:
        """Remember ``answer`` for ``answer.ttl`` seconds; a TTL of 0 is not cached."""
        key = (name.lower(), rdtype)
        if answer.ttl <= 0:
            self._entries.pop(key, None)
            return
        self._entries[key] = _Entry(answer, self.clock() + answer.ttl)
        self._entries.move_to_end(key)
        while len(self._entries) > self.max_entries:
            self._entries.popitem(last=False)

    def __len__(self) -> int:
        return len(self._entries)


class _Temporary(Exception):
    """Internal: a lookup said nothing about the name (timeout, SERVFAIL...)."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason


@dataclass(frozen=True, slots=True)
class _HostLookup:
    """Addresses found for one MX host, and whether some lookup for it failed temporarily."""

    addresses: tuple[str, ...]
    temporary: str | None
    nxdomain: bool = False
    """Some question said the name does not exist (a clearer reason than "no address")."""


def negative_ttl(response: dns.message.Message | None, default: float, cap: float) -> float:
    """RFC 2308 section 5: a negative answer lives for min(SOA TTL, SOA MINIMUM).

    The SOA is in the authority section of the negative response; without one, ``default``.
    """
    if response is not None:
        for rrset in response.authority:
            if rrset.rdtype == dns.rdatatype.SOA and len(rrset) > 0:
                soa = rrset[0]
                return float(min(rrset.ttl, soa.minimum, cap))
    return min(default, cap)


def _host_text(name: dns.name.Name) -> str:
    """Lower case, no trailing dot; the root (a null MX exchange) becomes ``""``."""
    if name == dns.name.root:
        return ""
    return name.to_text(omit_final_dot=True).lower()


def _parse_name(domain: str) -> dns.name.Name | MxResult:
    """``domain`` (lower case, no trailing dot) as a DNS name, or why it is not one."""
    try:
        if not domain:
            raise ValueError("empty name")
        # Jobs carry A-labels; one queued before domains were normalised may carry a
        # U-label, which dnspython would encode by IDNA 2003 ("ß" as "ss": another name).
        return dns.name.from_text(normal_domain(domain))
    except (ValueError, dns.exception.DNSException) as exc:
        reason = f"{domain!r} is not a valid domain name: {exc}"
        return MxResult(MxKind.NO_DOMAIN, domain, reason, _NO_DOMAIN_STATUS)


def _family_text(ipv6: bool) -> str:
    return "address" if ipv6 else "IPv4 address (IPv6 is turned off)"


def _is_unusable(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Addresses that are never an SMTP server elsewhere: link-local, multicast."""
    return ip.is_link_local or ip.is_multicast


def _unmapped(
    ip: ipaddress.IPv4Address | ipaddress.IPv6Address,
) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An IPv4-mapped IPv6 address (``::ffff:127.0.0.1``) as the IPv4 address it reaches."""
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


class MxResolver:
    """Resolves recipient domains to ``MxResult`` values, with an answer cache.

    ``nameservers`` and ``port`` say which resolver to ask (the machine's resolv.conf is not
    read: a mail server should name its resolver explicitly).  ``timeout`` bounds one query
    to one server, ``lifetime`` the whole of one lookup including retries.
    ``own_addresses`` and ``own_names`` are the addresses and names this MTA is known by,
    for loop detection; ``allow_loopback`` lets MX hosts resolve to loopback addresses.
    ``max_hosts`` bounds how many MX records of one domain are looked at (best first), so a
    hostile zone cannot make us resolve thousands of names.
    """

    def __init__(
        self,
        *,
        nameservers: Sequence[str],
        clock: Callable[[], float],
        rng: random.Random,
        port: int = 53,
        timeout: float = 5.0,
        lifetime: float = 10.0,
        own_addresses: Iterable[str] = (),
        own_names: Iterable[str] = (),
        allow_loopback: bool = False,
        cache_size: int = 10_000,
        max_hosts: int = 10,
        default_negative_ttl: float = DEFAULT_NEGATIVE_TTL,
        max_ttl: float = DEFAULT_MAX_TTL,
        max_negative_ttl: float = DEFAULT_MAX_NEGATIVE_TTL,
    ) -> None:
        if not nameservers:
            raise ValueError("at least one nameserver is needed")
        resolver = dns.asyncresolver.Resolver(configure=False)
        resolver.nameservers = list(nameservers)
        resolver.port = port
        resolver.timeout = timeout
        resolver.lifetime = lifetime
        resolver.cache = None  # we cache ourselves, on the injected clock
        self._resolver = resolver
        self._rng = rng
        self.cache = AnswerCache(clock, cache_size)
        self._asking: dict[tuple[str, str], asyncio.Future[DnsAnswer]] = {}
        self._own_addresses = frozenset(_unmapped(ipaddress.ip_address(a)) for a in own_addresses)
        self._own_names = frozenset(n.rstrip(".").lower() for n in own_names)
        self._allow_loopback = allow_loopback
        self._max_hosts = max_hosts
        self._negative_ttl = default_negative_ttl
        self._max_ttl = max_ttl
        self._max_negative_ttl = max_negative_ttl

    async def resolve(self, domain: str, *, ipv6: bool = True) -> MxResult:
        """Resolve ``domain`` (an A-label domain name) to hosts, or to why there are none.

        ``ipv6`` False leaves out AAAA lookups and IPv6 addresses, for zones without IPv6.
        """
        domain = domain.rstrip(".").lower()
        if domain.startswith("["):  # an address literal (RFC 5321 section 4.1.3)
            return self.literal(domain, ipv6=ipv6)  # RFC 5321 section 2.3.5: no DNS
        qname = _parse_name(domain)
        if isinstance(qname, MxResult):
            return qname
        candidates = await self._candidates(domain, qname)
        if isinstance(candidates, MxResult):
            return candidates
        records, implicit = candidates
        lookups = await asyncio.gather(*(self._addresses(name, ipv6) for _, name in records))
        return self._choose(domain, records, lookups, implicit=implicit, ipv6=ipv6)

    async def resolve_host(self, name: str, *, ipv6: bool = True) -> MxResult:
        """The addresses of the host ``name`` (A, and AAAA unless ``ipv6`` is False), asked
        as for an MX host and cached alike; no MX lookup, no loop check.

        ``HOSTS`` holds the one host, at preference 0; else ``TEMPORARY`` (a lookup failed),
        ``NO_DOMAIN`` (NXDOMAIN) or ``UNROUTABLE`` (the name has no usable address).
        """
        name = name.rstrip(".").lower()
        parsed = _parse_name(name)
        if isinstance(parsed, MxResult):
            return parsed
        lookup = await self._addresses(name, ipv6)
        if lookup.addresses:
            host = MxHost(name, 0, lookup.addresses)
            return MxResult(MxKind.HOSTS, name, f"addresses of {name}", None, (host,))
        if lookup.temporary is not None:
            return self._temporary(name, f"address lookup for {name} failed: {lookup.temporary}")
        if lookup.nxdomain:
            reason = f"host {name} does not exist (NXDOMAIN)"
            return MxResult(MxKind.NO_DOMAIN, name, reason, _NO_DOMAIN_STATUS)
        reason = f"host {name} has no {_family_text(ipv6)}"
        return MxResult(MxKind.UNROUTABLE, name, reason, _UNROUTABLE_STATUS)

    def literal(self, domain: str, *, ipv6: bool = True) -> MxResult:
        """An address literal as its one host, or why it cannot be one: ``BAD_LITERAL``
        (no address), ``LOOP`` (ourselves), ``UNROUTABLE`` (IPv6 with ``ipv6`` False)."""
        parsed = address_literal(domain)
        if isinstance(parsed, str):
            reason = f"{domain} is not a valid address literal: {parsed}"
            return MxResult(MxKind.BAD_LITERAL, domain, reason, _BAD_LITERAL_STATUS)
        address = str(parsed)
        if self._is_own(parsed):
            reason = f"mail for {domain} loops back to myself (address {address})"
            return MxResult(MxKind.LOOP, domain, reason, _LOOP_STATUS)
        if _is_unusable(parsed):
            reason = f"address literal {domain} is link-local or multicast, not a mail server"
            return MxResult(MxKind.UNROUTABLE, domain, reason, _UNROUTABLE_STATUS)
        if parsed.version == 6 and not ipv6:
            reason = f"address literal {domain} is IPv6, and IPv6 is turned off"
            return MxResult(MxKind.UNROUTABLE, domain, reason, _UNROUTABLE_STATUS)
        host = MxHost(address, 0, (address,))
        return MxResult(MxKind.HOSTS, domain, f"address literal {domain}", None, (host,))

    async def _candidates(
        self, domain: str, qname: dns.name.Name
    ) -> MxResult | tuple[list[tuple[int, str]], bool]:
        """Step 1: the MX records to try and whether they are implicit, or a final result."""
        try:
            answer = await self._query(qname, "MX")
        except _Temporary as exc:
            return self._temporary(domain, f"MX lookup for {domain} failed: {exc.reason}")

        if answer.outcome is DnsOutcome.NXDOMAIN:
            reason = f"domain {domain} does not exist (NXDOMAIN)"
            return MxResult(MxKind.NO_DOMAIN, domain, reason, _NO_DOMAIN_STATUS)
        if answer.outcome is DnsOutcome.NODATA:
            # RFC 5321 section 5.1: no MX records, so the domain is its own implicit MX.
            return [(0, domain)], True
        if len(answer.mx) == 1 and answer.mx[0][1] == "":
            # RFC 7505 section 3: a single MX with an empty exchange ("0 .") says the domain
            # takes no mail; section 4.1 asks for 556 5.1.10 and no connection attempt.
            reason = f"domain {domain} does not accept mail (null MX, RFC 7505)"
            return MxResult(MxKind.NULL_MX, domain, reason, _NULL_MX_STATUS)
        records = _best_records(answer.mx, self._max_hosts)
        if not records:
            # Several root exchanges and nothing else: not a valid null MX (RFC 7505
            # section 3 wants it alone), and nothing to connect to either.
            reason = f"no usable MX host for {domain}"
            return MxResult(MxKind.UNROUTABLE, domain, reason, _UNROUTABLE_STATUS)
        return records, False

    def _choose(
        self,
        domain: str,
        records: list[tuple[int, str]],
        lookups: Sequence[_HostLookup],
        *,
        implicit: bool,
        ipv6: bool,
    ) -> MxResult:
        """Steps 3 and 4 of the theory of operation: drop ourselves, order, or explain."""
        self_preference: int | None = None
        self_host = ""
        for (preference, name), lookup in zip(records, lookups, strict=True):
            if self._is_self(name, lookup.addresses) and (
                self_preference is None or preference < self_preference
            ):
                self_preference, self_host = preference, name

        hosts: list[MxHost] = []
        temporary: list[str] = []
        for (preference, name), lookup in zip(records, lookups, strict=True):
            # RFC 5321 section 5.1: discard our own record and every one at the same or a
            # higher preference number; only better hosts may take the message from us.
            if self_preference is not None and preference >= self_preference:
                continue
            if lookup.addresses:
                hosts.append(MxHost(name, preference, lookup.addresses))
            elif lookup.temporary is not None:
                temporary.append(f"{name}: {lookup.temporary}")

        if hosts:
            # Shuffle, then a stable sort by preference: random order within a preference.
            self._rng.shuffle(hosts)
            hosts.sort(key=lambda host: host.preference)
            return MxResult(
                MxKind.HOSTS,
                domain,
                f"{len(hosts)} host(s) for {domain}",
                None,
                tuple(hosts),
                implicit,
            )
        if temporary:
            return self._temporary(
                domain, f"address lookup failed for {domain}: {'; '.join(temporary)}"
            )
        if self_preference is not None:
            return MxResult(
                MxKind.LOOP,
                domain,
                f"mail for {domain} loops back to myself (MX host {self_host})",
                _LOOP_STATUS,
            )
        family = _family_text(ipv6)
        what = (
            f"{domain} has no MX and no {family}"
            if implicit
            else (f"no MX host of {domain} has an {family}")
        )
        return MxResult(MxKind.UNROUTABLE, domain, what, _UNROUTABLE_STATUS, (), implicit)

    def _is_self(self, name: str, addresses: Sequence[str]) -> bool:
        if name in self._own_names:
            return True
        return any(self._is_own(ipaddress.ip_address(text)) for text in addresses)

    def _is_own(self, ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
        """One of our addresses, the unspecified address, or loopback (unless allowed)."""
        ip = _unmapped(ip)
        if ip.is_unspecified:
            # Never a remote server, whatever ``allow_loopback`` says: on Linux a connect()
            # to 0.0.0.0 or :: goes to this host (it reaches a 127.0.0.1 listener), so mail
            # would come back into our own receiver.
            return True
        return ip in self._own_addresses or (not self._allow_loopback and ip.is_loopback)

    @staticmethod
    def _temporary(domain: str, reason: str) -> MxResult:
        return MxResult(MxKind.TEMPORARY, domain, reason, _TEMPORARY_STATUS)

    async def _addresses(self, name: str, ipv6: bool) -> _HostLookup:
        """A then AAAA for one host, usable addresses only; temporary failures noted."""
        qname = dns.name.from_text(name)
        rdtypes = ("A", "AAAA") if ipv6 else ("A",)
        results = await asyncio.gather(
            *(self._query(qname, rdtype) for rdtype in rdtypes), return_exceptions=True
        )
        addresses: list[str] = []
        temporary: str | None = None
        nxdomain = False
        # IPv4 before IPv6: large receivers hold IPv6 senders to stricter checks (PTR,
        # authentication), so IPv4 is the likelier first success; IPv6 stays as fallback.
        for rdtype, result in zip(rdtypes, results, strict=True):
            if isinstance(result, _Temporary):
                temporary = f"{rdtype} lookup failed: {result.reason}"
            elif isinstance(result, BaseException):
                raise result
            else:
                nxdomain = nxdomain or result.outcome is DnsOutcome.NXDOMAIN
                for text in result.addresses:
                    if not _is_unusable(ipaddress.ip_address(text)) and text not in addresses:
                        addresses.append(text)
        return _HostLookup(tuple(addresses), temporary, nxdomain)

    async def _query(self, qname: dns.name.Name, rdtype: str) -> DnsAnswer:
        """One question, from the cache or the resolver.  Raises only ``_Temporary``."""
        key = qname.to_text()
        cached = self.cache.get(key, rdtype)
        if cached is not None:
            return cached
        question = (key, rdtype)
        asking = self._asking.get(question)
        # A question left pending on a loop that has since closed (a caller that ran its own
        # loop) can never be answered: ask anew on this one.
        if asking is None or asking.get_loop() is not asyncio.get_running_loop():
            asking = asyncio.ensure_future(self._ask_and_cache(qname, key, rdtype))
            self._asking[question] = asking
            asking.add_done_callback(lambda done: self._answered(question, done))
        # Shielded: one waiter given up (its delivery cancelled) must not fail the others.
        return await asyncio.shield(asking)

    async def _ask_and_cache(self, qname: dns.name.Name, key: str, rdtype: str) -> DnsAnswer:
        answer = await self._ask(qname, rdtype)
        self.cache.put(key, rdtype, answer)
        return answer

    def _answered(self, question: tuple[str, str], done: asyncio.Future[DnsAnswer]) -> None:
        if self._asking.get(question) is done:  # not a newer question for the same name
            del self._asking[question]
        if not done.cancelled():
            done.exception()  # retrieved, even when every waiter has gone

    async def _ask(self, qname: dns.name.Name, rdtype: str) -> DnsAnswer:
        try:
            result = await self._resolver.resolve(qname, rdtype, search=False)
        except dns.resolver.NXDOMAIN as exc:
            # dnspython leaves these accessors unannotated.
            response = exc.responses().get(qname)  # type: ignore[no-untyped-call]
            ttl = negative_ttl(response, self._negative_ttl, self._max_negative_ttl)
            return DnsAnswer(DnsOutcome.NXDOMAIN, ttl)
        except dns.resolver.NoAnswer as exc:
            response = exc.response()  # type: ignore[no-untyped-call]
            ttl = negative_ttl(response, self._negative_ttl, self._max_negative_ttl)
            return DnsAnswer(DnsOutcome.NODATA, ttl)
        except dns.resolver.LifetimeTimeout:
            raise _Temporary("timed out") from None
        except dns.resolver.NoNameservers as exc:
            # Every server answered SERVFAIL/REFUSED or could not be reached.
            raise _Temporary(f"no nameserver gave an answer ({exc})") from None
        except dns.exception.DNSException as exc:
            raise _Temporary(f"{type(exc).__name__}: {exc}") from None
        except OSError as exc:
            raise _Temporary(f"network error: {exc}") from None

        rrset = result.rrset
        if rrset is None:  # not reached with raise_on_no_answer, but typed as optional
            return DnsAnswer(DnsOutcome.NODATA, min(self._negative_ttl, self._max_negative_ttl))
        ttl = float(min(rrset.ttl, self._max_ttl))
        if rdtype == "MX":
            mx = tuple((int(r.preference), _host_text(r.exchange)) for r in rrset)
            return DnsAnswer(DnsOutcome.ANSWER, ttl, mx=mx)
        return DnsAnswer(DnsOutcome.ANSWER, ttl, addresses=tuple(r.address for r in rrset))


def _best_records(mx: Iterable[tuple[int, str]], limit: int) -> list[tuple[int, str]]:
    """MX records sorted by preference, root exchanges dropped, each host once (at its best
    preference), at most ``limit`` of them."""
    best: dict[str, int] = {}
    for preference, name in mx:
        if name and (name not in best or preference < best[name]):
            best[name] = preference
    # Sorted on preference alone (stable), so a cut inside a preference keeps DNS order
    # rather than favouring names early in the alphabet.
    ordered = sorted(((preference, name) for name, preference in best.items()), key=_first)
    return ordered[:limit]


def address_literal(domain: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | str:
    """The address in ``[192.0.2.1]`` or ``[IPv6:2001:db8::1]`` (the tag in any case, RFC
    5321 section 4.1.3), or a text saying why ``domain`` is not such a literal."""
    if not (domain.startswith("[") and domain.endswith("]")):
        return "not enclosed in [ ]"
    inner = domain[1:-1]
    tag, colon, rest = inner.partition(":")
    if colon and tag.lower() == "ipv6":
        try:
            return ipaddress.IPv6Address(rest)
        except ValueError:
            return f"{rest!r} is not an IPv6 address"
    if colon:
        # An IPv6 address without its tag, or a general address literal (a tag of some
        # other registered kind): RFC 5321 defines no way to deliver to either.
        return "only IPv4 and IPv6: addresses are supported"
    try:
        return ipaddress.IPv4Address(inner)
    except ValueError:
        return f"{inner!r} is not an IPv4 address"


def _first(record: tuple[int, str]) -> int:
    return record[0]


def system_nameservers() -> list[str]:
    """The resolvers named in the machine's /etc/resolv.conf (for a config that names none)."""
    try:
        return [str(server) for server in dns.resolver.Resolver(configure=True).nameservers]
    except (dns.exception.DNSException, OSError):
        return []
