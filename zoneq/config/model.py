"""The configuration schema: one frozen pydantic model per TOML table.

Every model refuses unknown keys (``extra="forbid"``): a misspelt key that is silently
ignored leaves the default in force, which in a mail server shows up days later as a
wrong retry policy or an unexpected EHLO name.  Models are also strict: TOML already has
integers, booleans and strings, so ``connections = "10"`` or ``ipv6 = "yes"`` is a mistake
worth reporting rather than a value worth coercing.

Durations are kept as the strings the operator wrote (so an effective-config dump reads
back like the file) and exposed in milliseconds through ``*_ms`` properties, the unit the
queue and the retry code work in.

Problems that involve more than one key (a max age against its retry schedule, routing
names against the defined zones) are found by model-level validators, whose errors pydantic
places at the model rather than at a key.  Those validators raise ``problems_error`` with
the keys spelt out, and the loader turns each one back into its own dotted key.

Adding a section (IP pools, rate limits, routing rules, plugins) means adding a model here
and a field on ``Config``; the loader's error mapping is generic over the model tree.
"""

from __future__ import annotations

import ipaddress
import re
import socket
import ssl
from pathlib import Path
from typing import Annotated, Final, Literal, Self

from pydantic import (
    AfterValidator,
    ByteSize,
    Field,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from zoneq.config.listen import ListenAddress, same_listener, split_listen
from zoneq.config.plugins import PluginConfig, PluginName
from zoneq.config.reply_rules import ReplyRulesConfig
from zoneq.config.routing import HeaderName, RoutingRule, unknown_rule_zones
from zoneq.config.types import (
    MAX_DURATION,
    PROBLEMS_ERROR_TYPE,
    Duration,
    EhloName,
    HostName,
    Network,
    NonEmptyPath,
    Size,
    SocketPath,
    ZoneName,
    address_literal,
    domain_keys,
    domain_lookup,
    duration_ceiling_problem,
    problems_error,
)
from zoneq.config.types import Section as _Section
from zoneq.config.zones import ConnectionLimits, IpAddress, Pool, Rate, Smarthost, parse_rate
from zoneq.protocol.dsn import check_from_address
from zoneq.protocol.retry import (
    BOUNCE_MAX_AGE,
    DEFAULT_MAX_AGE,
    DEFAULT_SCHEDULE,
    RetrySchedule,
    format_duration,
    parse_duration,
)

__all__ = [
    "PROBLEMS_ERROR_TYPE",
    "ApiConfig",
    "Config",
    "Duration",
    "HostName",
    "ReceiverConfig",
    "RoutingConfig",
    "ServerConfig",
    "StorageConfig",
    "ZoneConfig",
    "ZoneName",
    "problems_error",
    "split_listen",
]

# The longest max age any key takes, so a retry spec can be checked on its own without its
# max age interfering (its intervals are held to the same ceiling first).
_UNBOUNDED_MAX_AGE: Final = MAX_DURATION

# LevelDB's write buffer in zoneq.storage.leveldb (8 MiB): reopening a full queue flushes up
# to one memtable, so a smaller reserve frees too little to let the queue open and drain.
MIN_RESERVE: Final = 8 << 20
# A reopen replays at most two memtables (zoneq/storage/space.py: 4x the write buffer is
# safe), so 1 GiB is 32 times what recovery needs.  More only takes space from the queue,
# and is put in place only while twice as much is free: a typo like "64GiB" or a byte
# count with extra zeros would leave no reserve at all, silently.
MAX_RESERVE: Final = 1 << 30


def _check_reserve(value: ByteSize) -> ByteSize:
    reason = None
    if 0 < value < MIN_RESERVE:
        reason = f"{value} bytes is too small to recover with: 0 for none, or at least 8MiB"
    elif value > MAX_RESERVE:
        reason = f"{value} bytes is more than recovery can use: at most 1GiB (it needs ~32MiB)"
    if reason is not None:
        raise PydanticCustomError("reserve", "{reason}", {"reason": reason})
    return value


def _check_bounce_from(value: str) -> str:
    # The DSN builder's own rule, so an address it would refuse at bounce time is refused
    # here, at load, instead: ASCII (the notice to an ASCII sender stays 7-bit) addr-spec.
    try:
        check_from_address(value)
    except ValueError:
        reason = "must be an ASCII address like MAILER-DAEMON@mx.example.com"
        raise PydanticCustomError("bounce_from", "{reason}", {"reason": reason}) from None
    return value


# Names a machine calls itself that no other host can use for it: /etc/hosts often maps
# 127.0.0.1 to them first, so socket.getfqdn() answers one of them.
_LOCAL_NAMES: Final = frozenset({"localhost", "localhost.localdomain"})


def _qualified(name: str) -> bool:
    """Whether ``name`` can stand as an EHLO domain (RFC 5321 sections 2.3.5 and 4.1.1.1:
    a fully-qualified name): dotted and not the loopback's name.  An address literal
    (``[192.0.2.1]``) is the other form the RFC allows; a bare address (a machine's own
    name may be one) is neither."""
    name = name.lower().rstrip(".")
    if name.startswith("["):
        return name.endswith("]")
    return "." in name and name not in _LOCAL_NAMES and address_literal(name) is None


def machine_hostname() -> str:
    """This machine's own name for EHLO when ``[server] hostname`` is unset: the FQDN when
    it is one, else the host name when dotted, else the best of them (not "localhost" if
    there is another), which ``ServerConfig.hostname_warning`` then reports."""
    found = [socket.getfqdn(), socket.gethostname()]
    usable = [name for name in found if name and name.lower() not in _LOCAL_NAMES]
    return next((name for name in usable if _qualified(name)), (usable or found)[0])


class ServerConfig(_Section):
    """``[server]``: who we are and where the queue lives."""

    hostname: EhloName | None = None
    """EHLO and Reporting-MTA name; None means the machine's FQDN, looked up at start-up
    (``machine_hostname``: never "localhost" when the machine has a better name)."""

    bounce_from: Annotated[str, AfterValidator(_check_bounce_from)] | None = None
    """The From address of the notices (bounces, delay notices) zoneq sends; None means
    ``MAILER-DAEMON@<hostname>``.  Their envelope sender stays ``<>`` whatever this is."""

    data_dir: NonEmptyPath = Path("data/queue")
    """The LevelDB queue directory; a relative path is relative to the working directory."""

    ipc_socket: SocketPath = Path("data/zoneq.sock")
    """The Unix socket the core serves its zone workers on (mode 0600)."""

    def resolved_hostname(self) -> str:
        """The configured hostname, or the machine's FQDN when none is configured.

        Looked up here rather than at validation so that loading (and checking) a config
        never depends on the resolver of the machine doing the checking.
        """
        return self.hostname if self.hostname is not None else machine_hostname()

    def hostname_warning(self) -> str | None:
        """Why the EHLO name is a poor one, or None.  Not an error: tests and a laptop's
        set-up use such names; but receivers refuse or score a HELO that is not a FQDN
        (RFC 5321 section 4.1.1.1; Postfix's reject_non_fqdn_helo_hostname), and it is
        also the Reporting-MTA and the MAILER-DAEMON domain of the notices."""
        name = self.resolved_hostname()
        if _qualified(name):
            return None
        whose = "" if self.hostname is not None else " (unset: this machine's own name)"
        return (
            f"server.hostname {name!r}{whose} is not a fully-qualified domain name: remote"
            " MX hosts may refuse its EHLO; set [server] hostname to this host's public"
            " name, the one its address's PTR record gives"
        )


class StorageConfig(_Section):
    """``[storage]``: durability and housekeeping of the queue database."""

    sync_commits: bool = True
    """fsync the commit that precedes our SMTP 250, so an accepted message survives a crash."""

    chunk_size: Annotated[int, Field(ge=4096, le=1_048_576)] = 65_536
    """Bytes per stored body chunk."""

    event_retention: Duration = "30d"
    """How long delivery events are kept."""

    sweep_interval: Duration = "10m"
    """How often the sweeper looks for expired events and abandoned chunks."""

    receive_timeout: Duration = "10m"
    """Chunks of a message not committed within this time are swept."""

    min_free: Size = ByteSize(256 << 20)
    """New mail is refused (452 4.3.1) while the queue's file system has less free space than
    this, so intake never fills the disk and deliveries go on (Postfix's queue_minfree)."""

    reserve: Annotated[Size, AfterValidator(_check_reserve)] = ByteSize(64 << 20)
    """A file of this size kept in the queue directory and released if the disk fills anyway,
    so LevelDB can reopen and the queue can drain; 0 for none, otherwise 8 MiB (one LevelDB
    write buffer, the memtable that a reopen flushes) to 1 GiB (``_check_reserve``)."""

    @property
    def event_retention_ms(self) -> int:
        return parse_duration(self.event_retention)

    @property
    def sweep_interval_ms(self) -> int:
        return parse_duration(self.sweep_interval)

    @property
    def receive_timeout_ms(self) -> int:
        return parse_duration(self.receive_timeout)


class ZoneConfig(_Section):
    """``[zones.<name>]``: one delivery zone, served by its own worker processes."""

    processes: Annotated[int, Field(ge=1, le=64)] = 1
    """Worker processes for this zone (at most 64, as for ``receiver.processes``)."""

    connections: Annotated[int, Field(ge=1, le=1000)] = 10
    """Concurrent outbound SMTP connections per process.  At most 1000: each is a delivery
    loop (about 5 KiB of memory) and a socket, and the default soft limit of open files is
    1024 per process (zoneq does not raise it); more processes give more connections."""

    retry: str = DEFAULT_SCHEDULE
    """Retry intervals separated by ``|``; the last one repeats until ``max_age``."""

    max_age: Duration = DEFAULT_MAX_AGE
    """Age at which a still-undelivered recipient is bounced."""

    ehlo_name: EhloName | None = None
    """EHLO name for this zone; None means ``server.hostname``."""

    ipv6: bool = True
    """Whether to connect to IPv6 addresses of receiving servers.  IPv6 also needs an IPv6
    address in ``pool`` when the zone has one: a pool of IPv4 addresses only sends over
    IPv4 whatever this says (and a pool of IPv6 addresses only needs this on)."""

    pool: Pool = Field(default_factory=list)
    """Source addresses to send from, by ratio (``[[zones.<name>.pool]]``, zones.py)."""

    rate: Rate | None = None
    """Zone-wide deliveries per second, minute or hour (``"6000/min"``), spread evenly
    across the zone's processes; None: no limit."""

    smarthost: Smarthost | None = None
    """Relay everything through this host instead of the recipients' MX hosts."""

    @property
    def rate_limit(self) -> tuple[int, int] | None:
        """``rate`` as (count, period in ms), the form ``RateLimiter`` takes."""
        return parse_rate(self.rate) if self.rate is not None else None

    @field_validator("retry")
    @classmethod
    def _check_retry(cls, value: str) -> str:
        # Checked with a max age that cannot be too short, so that a fault reported here is
        # a fault of the spec itself; the pair is checked below and blamed on max_age.
        # An interval past that max age is one past the ceiling of every duration: said so
        # in the operator's words rather than as a max age of 3153600000000 ms.
        for index, entry in enumerate(value.split("|"), start=1):
            try:
                too_long = duration_ceiling_problem(entry, parse_duration(entry))
            except ValueError:
                continue  # RetrySchedule.parse says what is wrong with it
            if too_long is not None:
                reason = f"retry schedule {value!r}: entry {index}: {too_long}"
                raise PydanticCustomError("retry_schedule", "{reason}", {"reason": reason})
        try:
            RetrySchedule.parse(value, _UNBOUNDED_MAX_AGE)
        except ValueError as exc:
            raise PydanticCustomError("retry_schedule", "{reason}", {"reason": str(exc)}) from None
        return value

    # One validator for both checks: pydantic stops at the first after-validator that
    # raises, which would hide the second fault until the next run.
    @model_validator(mode="after")
    def _check_pairs(self) -> Self:
        problems = [*self._schedule_problems(), *self._family_problems()]
        if problems:
            raise problems_error(*problems)
        return self

    def _schedule_problems(self) -> list[tuple[tuple[str, ...], str]]:
        try:
            RetrySchedule.parse(self.retry, self.max_age)
        except ValueError as exc:
            return [(("max_age",), _max_age_problem(self.retry, self.max_age, exc))]
        return []

    def _family_problems(self) -> list[tuple[tuple[str, ...], str]]:
        # A pool of IPv6 addresses only with IPv6 off could never connect anywhere.
        if not self.ipv6 and self.pool and all(":" in entry.address for entry in self.pool):
            text = "is false, but every pool address is IPv6: the zone could not send at all"
            return [(("ipv6",), text)]
        return []

    # Parsed on each use rather than cached in a private attribute: parsing costs
    # microseconds, and a cache would go stale under model_copy(update=...), which does
    # not re-run validators.
    @property
    def schedule(self) -> RetrySchedule:
        """The parsed retry schedule (intervals and max age, in milliseconds)."""
        return RetrySchedule.parse(self.retry, self.max_age)

    @property
    def max_age_ms(self) -> int:
        return parse_duration(self.max_age)


def _max_age_problem(retry: str, max_age: str, exc: ValueError, whose: str = "") -> str:
    """Say why a max age does not fit a schedule, in the units the operator wrote."""
    first = RetrySchedule.parse(retry, _UNBOUNDED_MAX_AGE).intervals_ms[0]
    if parse_duration(max_age) < first:
        return (
            f"{max_age!r} is shorter than the first retry interval{whose} "
            f"({format_duration(first)}), so no retry could ever happen"
        )
    # Some other rule of the retry module; its own words are the best we have.
    return str(exc)


class DeliveryConfig(_Section):
    """``[delivery]``: how zone workers reach the recipients' servers."""

    mx_port: Annotated[int, Field(ge=1, le=65535)] = 25
    """Port of the MX hosts (MX records carry none; tests use a high port on 127.0.0.x)."""

    nameservers: list[IpAddress] = Field(default_factory=list)
    """Resolver addresses for MX lookups; empty: the ones in /etc/resolv.conf at start-up."""

    dns_port: Annotated[int, Field(ge=1, le=65535)] = 53
    dns_timeout: Duration = "10s"
    """How long one MX lookup may take, retries included; then the recipient is deferred."""

    allow_loopback_mx: bool = False
    """Let MX hosts resolve to loopback addresses (tests); otherwise that is a mail loop.
    A loopback address and port the receiver listens on stays a loop even then."""

    max_mx_addresses: Annotated[int, Field(ge=1, le=1000)] = 5
    """Addresses one delivery attempt connects to at most, over all MX hosts (Postfix's
    ``smtp_mx_address_limit``, also 5): a domain with a hundred A records behind
    blackholed addresses must not hold a delivery loop for hours of connect timeouts."""

    tls: Literal["opportunistic", "required", "none"] = "opportunistic"
    """STARTTLS policy: use when offered, insist (an MX without it is passed over for the
    next; deferred if none has it), or never."""

    tls_policy: dict[str, Literal["opportunistic", "required", "none"]] = Field(
        default_factory=dict
    )
    """Per destination domain, overriding ``tls``: e.g. ``"bank.example" = "required"``
    (then mail to it waits with 4.7.x rather than ever going in plaintext)."""

    def tls_for(self, domain: str) -> str:
        """The STARTTLS policy for mail to ``domain``: its own key, else the closest
        ``.parent`` key (``domain_lookup``), else ``tls``."""
        found = domain_lookup(self.tls_policy, domain)
        return self.tls if found is None else found

    @field_validator("tls_policy")
    @classmethod
    def _lower_domains(cls, value: dict[str, str]) -> dict[str, str]:
        return domain_keys(value)

    domain_connections: Annotated[int, Field(ge=1, le=10_000)] = 10
    """Connections at once per destination domain, across all of a zone's workers."""

    max_recipients: Annotated[int, Field(ge=1, le=1000)] = 50
    """Recipients per SMTP transaction (Postfix's default is 50)."""

    domain_limits: ConnectionLimits = Field(default_factory=dict)
    """Per recipient domain, overriding ``domain_connections``: ``{ "gmail.com" = 20 }``."""

    mx_limits: ConnectionLimits = Field(default_factory=dict)
    """Connections at once per MX host, whichever domains it serves (many domains share
    the big providers' MX hosts): ``{ ".google.com" = 40 }``."""

    dead_host_backoff: Duration = "60s"
    """How long an MX address that refused or dropped a connection is skipped the first
    time; each further failure doubles it, up to an hour, and it expires on its own
    (``zoneq/delivery/hostcache.py``)."""

    @property
    def dns_timeout_s(self) -> float:
        return parse_duration(self.dns_timeout) / 1000

    @property
    def dead_host_backoff_s(self) -> float:
        return parse_duration(self.dead_host_backoff) / 1000


class RoutingConfig(_Section):
    """``[routing]``: which zone a message goes to when nothing else decides."""

    default_zone: ZoneName = "default"
    """Zone for messages that no routing rule places elsewhere."""

    bounce_zone: ZoneName = "bounces"
    """Zone that delivers the bounces (DSNs) we generate."""

    bounce_max_age: Duration = BOUNCE_MAX_AGE
    """Max age of our own bounces; replaces the bounce zone's ``max_age`` for them."""

    delay_warning: Duration = "4h"
    """A recipient that asked for delay notices (RFC 3461 NOTIFY=DELAY) and is still queued
    after this long gets one, once (Postfix's delay_warning_time)."""

    rules: list[RoutingRule] = Field(default_factory=list)
    """``[[routing.rules]]``: zone by sender domain, recipient domain or client network."""

    zone_header: HeaderName = "X-Sending-Zone"
    """A header naming the zone, honoured only from authenticated or allowlisted clients
    and removed before delivery."""

    @property
    def bounce_max_age_ms(self) -> int:
        return parse_duration(self.bounce_max_age)

    @property
    def delay_warning_ms(self) -> int:
        return parse_duration(self.delay_warning)


# The stored form of receiver.auth_users values (scrypt, RFC 7914); the receiver reads the values.
_PASSWORD_HASH: Final = re.compile(
    r"scrypt\$ln=[0-9]{1,2},r=[0-9]{1,2},p=[0-9]{1,2}\$[A-Za-z0-9+/]+\$[A-Za-z0-9+/]+"
)


def _check_password_hash(value: str) -> str:
    if not _PASSWORD_HASH.fullmatch(value):
        reason = "not a password hash: make one with 'zoneq hash-password'"
        raise PydanticCustomError("password_hash", "{reason}", {"reason": reason})
    return value


def _check_postmaster(value: str) -> str:
    """An address to deliver ``<Postmaster>`` to: local@domain, no spaces or controls."""
    local, at, domain = value.rpartition("@")
    if not at or not local or not domain or any(c <= " " or c in "<>" for c in value):
        reason = "must be an address like admin@example.org"
        raise PydanticCustomError("postmaster", "{reason}", {"reason": reason})
    return value


class ReceiverConfig(_Section):
    """``[receiver]``: the SMTP server that accepts mail into the queue."""

    listen: ListenAddress = "127.0.0.1:2525"
    """Address and port the SMTP receiver listens on."""

    max_message_size: Annotated[Size, Field(gt=0)] = ByteSize(50 << 20)
    """Largest message accepted (announced as SIZE, RFC 1870); larger ones get 552 5.3.4.
    Not 0: "SIZE 0" in EHLO would tell clients there is no limit (RFC 1870 section 4)."""

    max_recipients: Annotated[int, Field(ge=1, le=100_000)] = 1000
    """Recipients per message; more are answered 452 4.5.3 (RFC 5321 4.5.3.1.10)."""

    max_errors: Annotated[int, Field(ge=1, le=10_000)] = 20
    """Error replies (4xx/5xx) a session may get before it is closed with 421 4.7.0 (Postfix's
    smtpd_hard_error_limit, also 20): bad commands or refused recipients (address
    harvesting) cannot hold a session for ever.  A message accepted starts the count again."""

    postmaster: Annotated[str, AfterValidator(_check_postmaster)] | None = None
    """Where ``RCPT TO:<Postmaster>`` (no domain; RFC 5321 section 4.5.1 requires accepting
    it) is delivered, from any client, relay or not, as Postfix delivers postmaster to its
    alias.  zoneq has no mailboxes of its own, so it needs an address here; unset (the
    default), ``<Postmaster>`` is refused with 550 5.1.1 saying so, rather than queued to
    an address without a domain that could only bounce."""

    allow_networks: list[Network] = Field(default_factory=lambda: ["127.0.0.0/8", "::1/128"])
    """Clients allowed to relay (send to any domain); others get 554 5.7.1 at RCPT."""

    idle_timeout: Duration = "5m"
    """A client silent this long while we wait for a command is disconnected with 421
    (RFC 5321 4.5.3.2.7 asks for at least 5 minutes)."""

    max_connections_per_client: Annotated[int, Field(ge=1)] = 50
    """Concurrent sessions from one client address; more are answered 421 4.7.0."""

    processes: Annotated[int, Field(ge=0, le=64)] = 0
    """SMTP receiver processes accepting on ``listen`` and handing mail to the core over a
    socket; 0 (the default) runs the receiver inside the core, one event loop for all.

    The in-core receiver uses the least CPU per message, but its one thread bounds the
    accept rate (about 1 / 0.5 ms in tools/bench/accept_bench.py); N processes spend ~30%
    (N=1) to ~60% (N=3) more CPU per message and bring the busiest thread down to about
    0.5 / 0.3 / 0.23 ms for N = 1 / 2 / 3.  On 2 cores, 1 was faster than 0 in 8 of 10
    paired runs (median +11%) and 2 or 3 were not; with cores to spare, use about one per
    core beyond the two that the core process and its syncs need."""

    min_data_rate: Annotated[int, Field(ge=0)] = 500
    """Octets per second of message text that earn a slow client more time: each request
    (a command, or the text after 354) must complete within ``idle_timeout`` plus this
    credit, so a trickle cannot hold a session for ever (Postfix's smtpd_min_data_rate)."""

    tls_cert: NonEmptyPath | None = None
    """PEM certificate chain for STARTTLS (RFC 3207); unset: STARTTLS is not offered."""

    tls_key: NonEmptyPath | None = None
    """PEM private key of ``tls_cert``."""

    tls_listen: ListenAddress | None = None
    """A second listener, for implicit TLS (RFC 8314 section 3.3: "submissions", port 465):
    the TLS handshake comes first, then the greeting; AUTH is offered at once and STARTTLS
    is not (RFC 3207: not on a connection already under TLS).  Unset (the default): none.

    A listener of its own next to ``listen``, not a switch that turns ``listen`` into
    implicit TLS, because an MTA serves both kinds at once: port 25 (and 587) with STARTTLS
    for MTAs and older clients, 465 for submission clients that RFC 8314 steers to implicit
    TLS (Postfix's ``smtpd_tls_wrappermode`` on a second master.cf service).  Needs
    ``tls_cert`` and ``tls_key``.  With ``processes`` > 0 the core binds it as it binds
    ``listen`` and every receiver process accepts on both, loading the certificate itself."""

    auth_users: dict[str, Annotated[str, AfterValidator(_check_password_hash)]] = Field(
        default_factory=dict
    )
    """AUTH PLAIN/LOGIN users (RFC 4954), offered only after STARTTLS: name -> scrypt hash
    as printed by ``zoneq hash-password``.  Authenticated clients may relay."""

    @model_validator(mode="after")
    def _check_tls(self) -> Self:
        problems: list[tuple[tuple[str, ...], str]] = []
        if (self.tls_cert is None) != (self.tls_key is None):
            problems.append((("tls_key",), "tls_cert and tls_key must be set together"))
        elif self.tls_cert is not None and self.tls_key is not None:
            try:
                ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(
                    self.tls_cert, self.tls_key
                )
            except FileNotFoundError:
                # ssl gives no file name (exc.filename is None): name the configured ones.
                for key, path in (("tls_cert", self.tls_cert), ("tls_key", self.tls_key)):
                    if not path.is_file():
                        problems.append(((key,), f"cannot read {path}: no such file"))
            except (OSError, ssl.SSLError) as exc:
                text = f"the certificate and key do not load as a pair: {exc}"
                problems.append((("tls_cert",), text))
        if self.auth_users and self.tls_cert is None:
            text = "AUTH is offered only after STARTTLS: set tls_cert and tls_key"
            problems.append((("auth_users",), text))
        if self.tls_listen is not None:
            problems += [(("tls_listen",), text) for text in self._tls_listen_problems()]
        if problems:
            raise problems_error(*problems)
        return self

    def _tls_listen_problems(self) -> list[str]:
        problems = []
        if self.tls_cert is None:
            problems.append("implicit TLS needs a certificate: set tls_cert and tls_key")
        if self.tls_listen_address is not None and same_listener(
            self.listen_address, self.tls_listen_address
        ):
            problems.append(f"the same address as listen ({self.listen}): use another port")
        return problems

    @property
    def listen_address(self) -> tuple[str, int]:
        return split_listen(self.listen)

    @property
    def tls_listen_address(self) -> tuple[str, int] | None:
        return None if self.tls_listen is None else split_listen(self.tls_listen)

    @property
    def idle_timeout_s(self) -> float:
        return parse_duration(self.idle_timeout) / 1000

    @property
    def networks(self) -> tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...]:
        return tuple(ipaddress.ip_network(network) for network in self.allow_networks)


MIN_API_TOKEN: Final = 16


class ApiConfig(_Section):
    """``[api]``: the HTTP admin and submission API (bearer-token auth on all but /health)."""

    enabled: bool = True
    """Run the API in ``zoneq serve``."""

    listen: ListenAddress = "127.0.0.1:8025"
    """Address and port of the API; loopback by default, since it can read and drop mail."""

    token: Annotated[str, Field(min_length=MIN_API_TOKEN)] | None = None
    """The bearer token clients must send.  Unset (and no ``token_file``): one is generated at
    first start into ``<server.data_dir>/api.token`` (mode 0600) and its path is logged."""

    token_file: NonEmptyPath | None = None
    """A file holding the token (its first line), instead of ``token`` in the config."""

    @field_validator("token")
    @classmethod
    def _printable_token(cls, value: str | None) -> str | None:
        # RFC 6750 section 2.1: b64token characters only, so it can travel in the header.
        if value is not None and not re.fullmatch(r"[A-Za-z0-9\-._~+/]+=*", value):
            raise PydanticCustomError(
                "api_token",
                "{reason}",
                {"reason": "use letters, digits and -._~+/ only (RFC 6750 b64token)"},
            )
        return value

    @model_validator(mode="after")
    def _one_token_source(self) -> Self:
        if self.token is not None and self.token_file is not None:
            raise problems_error((("token_file",), "set either token or token_file, not both"))
        return self

    @property
    def listen_address(self) -> tuple[str, int]:
        return split_listen(self.listen)


def _no_zones_is_an_error(zones: dict[str, ZoneConfig]) -> dict[str, ZoneConfig]:
    if not zones:
        raise PydanticCustomError(
            "no_zones", "no zones defined: add at least one [zones.<name>] table", {}
        )
    return zones


CROSS_CHECKED: Final = frozenset({"zones", "routing", "receiver", "api"})
"""The sections ``Config._check_references`` reads: the loader runs that check without the
other sections when only they are at fault (pydantic skips it after any fault)."""


class Config(_Section):
    """The whole configuration file."""

    server: ServerConfig = Field(default_factory=ServerConfig)
    storage: StorageConfig = Field(default_factory=StorageConfig)
    # A default (empty) rather than required, so that a file without [zones] gets the
    # specific message above instead of a bare "missing".
    zones: Annotated[
        dict[ZoneName, ZoneConfig],
        AfterValidator(_no_zones_is_an_error),
        Field(validate_default=True),
    ] = Field(default_factory=dict)
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    delivery: DeliveryConfig = Field(default_factory=DeliveryConfig)
    receiver: ReceiverConfig = Field(default_factory=ReceiverConfig)
    api: ApiConfig = Field(default_factory=ApiConfig)
    plugins: dict[PluginName, PluginConfig] = Field(default_factory=dict)
    reply_rules: ReplyRulesConfig = Field(default_factory=ReplyRulesConfig)

    @model_validator(mode="after")
    def _check_references(self) -> Self:
        problems: list[tuple[tuple[str | int, ...], str]] = []
        for key in ("default_zone", "bounce_zone"):
            name: str = getattr(self.routing, key)
            if name not in self.zones:
                problems.append(
                    (("routing", key), f"names zone {name!r}, which is not defined in [zones]")
                )
        bounce_zone = self.zones.get(self.routing.bounce_zone)
        if bounce_zone is not None:
            try:
                RetrySchedule.parse(bounce_zone.retry, self.routing.bounce_max_age)
            except ValueError as exc:
                whose = f" of zone {self.routing.bounce_zone!r}"
                text = _max_age_problem(bounce_zone.retry, self.routing.bounce_max_age, exc, whose)
                problems.append((("routing", "bounce_max_age"), text))
        for rule_key, text in unknown_rule_zones(self.routing.rules, self.zones):
            problems.append((("routing", *rule_key), text))
        problems += self._api_listen_problems()
        if problems:
            raise problems_error(*problems)
        return self

    def _api_listen_problems(self) -> list[tuple[tuple[str | int, ...], str]]:
        # The receiver binds before the API, so serve would fail "address already in use"
        # on its own listener: the same rule as receiver.tls_listen against listen.
        if not self.api.enabled:
            return []
        receiver = self.receiver
        return [
            (("api", "listen"), f"the same address as receiver.{key} ({text}): use another port")
            for key, text, address in (
                ("listen", receiver.listen, receiver.listen_address),
                ("tls_listen", receiver.tls_listen, receiver.tls_listen_address),
            )
            if address is not None and same_listener(self.api.listen_address, address)
        ]

    @property
    def bounce_schedule(self) -> RetrySchedule:
        """Retry schedule for bounces we generate (bounce zone intervals, bounce max age)."""
        bounce_zone = self.zones[self.routing.bounce_zone]
        return RetrySchedule.parse(bounce_zone.retry, self.routing.bounce_max_age)
