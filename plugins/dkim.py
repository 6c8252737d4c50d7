"""DKIM signing (RFC 6376) per sender domain, at the ``sender:headers`` hook, with dkimpy.

    [plugins.dkim]
    [plugins.dkim.options.domains."example.com"]
    selector = "s2026"
    key_file = "/etc/zoneq/dkim/example.com.pem"

A key file holds an RSA key (PEM, PKCS#1 or PKCS#8) or an Ed25519 one (RFC 8463): PEM
PKCS#8 as ``openssl genpkey -algorithm ed25519`` writes it, or the base64 of the 32-byte
seed as dkimpy's ``dknewkey --ktype ed25519`` writes it.  The algorithm is read from the
key; ``algorithm = "rsa-sha256"`` or ``"ed25519-sha256"`` on a key makes that a check, so
that a file of the other kind (or of neither) is refused at start-up naming the algorithm
asked for.  A domain may have several keys, as an array of tables, each with its own
selector; every one adds its own DKIM-Signature.  RFC 8463 section 3 suggests exactly this
while receivers learn Ed25519: an RSA signature that every verifier checks, and an Ed25519
one beside it that those who know it check too.

    [[plugins.dkim.options.domains."example.com"]]
    selector = "rsa2026"
    key_file = "/etc/zoneq/dkim/example.com.pem"
    [[plugins.dkim.options.domains."example.com"]]
    selector = "ed2026"
    key_file = "/etc/zoneq/dkim/example.com.ed25519.pem"

The signing domain is the domain of the From header (RFC 5322 section 3.6.2), since that
is the one DMARC aligns with (RFC 7489 section 3.1.1); when From names no domain with a key,
the envelope sender's domain is tried.  A message from a domain without a key goes out
unsigned.  Keys are read once, at start-up, and each signs a tiny message there: a missing,
unreadable or unusable key (a file that holds no private key) stops zoneq there rather
than failing every delivery later.  Domains are compared in their A-label form, so an
internationalised domain (RFC 8616) matches whether the key or the From header spells it
with U-labels or A-labels, and ``d=`` always carries the A-labels.

dkimpy (the reference implementation in Python, with the verifier the tests use) needs the
whole message; the body is read from the queue once per delivery for that, and the hashing
and signing run on the plugin's own threads, so a large message does not stall the worker's
other connections.  ``max_size`` bounds the memory that costs: a message larger than it
goes out unsigned, with a warning in the log.  Not deferred: its size will not change, so
retrying could only end in a bounce days later, whereas unsigned mail is still delivered
(how receivers treat it is the domain's DMARC policy's call).  An administrator who wants
such mail refused sets ``receiver.max_message_size`` at or below ``max_size``, and it is
refused at DATA (552) before it is ever accepted.  A message dkimpy cannot parse (a
header line without a colon) goes out unsigned too, with a warning, for the same reason.
"""

from __future__ import annotations

import base64
import binascii
import re
from dataclasses import dataclass
from email.parser import HeaderParser
from email.policy import compat32
from email.utils import getaddresses
from pathlib import Path
from typing import Annotated, Literal, TypeAlias

# This file is plugins/dkim.py, loaded by path under another module name, so "dkim" here
# is the dkimpy package and not this file.
import dkim as dkimpy
from pydantic import (
    AfterValidator,
    BaseModel,
    ByteSize,
    ConfigDict,
    Field,
    PlainValidator,
    TypeAdapter,
    field_validator,
)

from zoneq.plugin import (
    AddHeaders,
    Hook,
    OptionError,
    PluginApp,
    SenderHeadersArgs,
    bare_domain,
)

# RFC 6376 section 5.4.1 lists these as the fields a signer should cover; From is required.
DEFAULT_HEADERS = (
    "From",
    "Reply-To",
    "Subject",
    "Date",
    "To",
    "Cc",
    "Message-ID",
    "In-Reply-To",
    "References",
    "MIME-Version",
    "Content-Type",
    "Content-Transfer-Encoding",
    "List-Id",
    "List-Unsubscribe",
    "List-Unsubscribe-Post",
)

# Signed once per key at start-up, to prove the key file holds a key dkimpy can sign with.
_PROBE = b"From: probe@invalid\r\nSubject: key check\r\n\r\nprobe\r\n"


# The a= tag values dkimpy signs with: RFC 6376 section 3.3 and RFC 8463 section 3.
Algorithm: TypeAlias = Literal["rsa-sha256", "ed25519-sha256"]
RSA: Algorithm = "rsa-sha256"
ED25519: Algorithm = "ed25519-sha256"


class DomainKey(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    selector: str = Field(pattern=r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,62})$")
    key_file: Path
    algorithm: Algorithm | None = None
    """The key's algorithm, when set a check on the key file; read from the key if not."""


_KEY_ARRAY = TypeAdapter(tuple[DomainKey, ...])


def _one_or_more(value: object) -> DomainKey | tuple[DomainKey, ...]:
    """A domain's table (one key), or an array of tables (one signature per key)."""
    if not isinstance(value, list):
        return DomainKey.model_validate(value)
    keys = _KEY_ARRAY.validate_python(value)  # its errors carry each table's index
    if not keys:
        raise ValueError("an empty array signs nothing: give at least one key")
    selectors = [key.selector for key in keys]
    if len(set(selectors)) < len(selectors):
        # One selector names one DNS record (RFC 6376 section 3.6.2.1): two keys under it
        # cannot both verify.
        raise ValueError(f"each key needs a selector of its own, got {selectors}")
    return keys


# PlainValidator, not a union: a union's errors would carry pydantic's branch names in the
# option path; model_validate's own errors keep the path as the operator wrote it.
DomainKeys = Annotated[DomainKey | tuple[DomainKey, ...], PlainValidator(_one_or_more)]


# RFC 5322 section 3.6.8: a field name is printable US-ASCII (33 to 126) except the colon;
# and not the semicolon either, which would end the h= tag it is written into (RFC 6376
# section 3.2): every signature would fail to verify.
_FIELD_NAME = re.compile(r"[!-9<-~]+")


def _field_name(name: str) -> str:
    if not _FIELD_NAME.fullmatch(name):
        raise ValueError(
            f"{name!r} is not a header field name: printable ASCII other than the colon and "
            "the semicolon, no spaces (RFC 5322 section 3.6.8, RFC 6376 section 3.2)"
        )
    return name


FieldName = Annotated[str, AfterValidator(_field_name)]


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    domains: dict[str, DomainKeys]
    headers: list[FieldName] = Field(default_factory=lambda: list(DEFAULT_HEADERS))
    # relaxed/relaxed survives the header refolding and whitespace changes relays make.
    canonicalization: Literal["relaxed/relaxed", "relaxed/simple", "simple/simple"] = (
        "relaxed/relaxed"
    )
    # 25 MiB: about what the large mailbox providers accept at all; dkimpy holds a few
    # copies of the message while signing, so this bounds a worker's memory per delivery.
    max_size: ByteSize = Field(default=ByteSize(25 << 20), gt=0)
    """Largest message (header and body) to sign, in bytes or as "25MiB"; a larger one goes
    out unsigned."""

    @field_validator("headers")
    @classmethod
    def _signs_from(cls, headers: list[str]) -> list[str]:
        # RFC 6376 section 5.4: From MUST be signed.  Checked here so that the error names
        # this option, not the key that dkimpy's start-up probe would otherwise blame.
        if "from" not in (name.lower() for name in headers):
            raise ValueError("must include From (RFC 6376 section 5.4)")
        return headers


@dataclass(frozen=True)
class SigningKey:
    selector: bytes
    algorithm: Algorithm
    private: bytes
    """As dkimpy takes it: the PEM for RSA, the base64 of the 32-byte seed for Ed25519."""


# RFC 8410 section 7 (and the example in section 10.3): an Ed25519 private key in PKCS#8
# (RFC 5958), as OpenSSL writes it, is these 16 bytes (version 0, AlgorithmIdentifier
# id-Ed25519 without parameters, an OCTET STRING wrapping the OCTET STRING of the key)
# followed by the 32-byte seed.
_ED25519_PKCS8 = bytes.fromhex("302e020100300506032b657004220420")
_ED25519_OID = bytes.fromhex("06032b6570")  # 1.3.101.112, RFC 8410 section 3
_SEED_SIZE = 32
_PKCS8_PEM = re.compile(rb"-----BEGIN PRIVATE KEY-----(.*?)-----END PRIVATE KEY-----", re.S)
_BASE64 = re.compile(rb"[A-Za-z0-9+/]+={0,2}")

_ED25519_FORMS = (
    'PEM "BEGIN PRIVATE KEY" as openssl genpkey -algorithm ed25519 writes it, or the base64 '
    "of the 32-byte seed as dknewkey --ktype ed25519 writes it"
)


def _ed25519_seed(content: bytes) -> bytes | None:
    """The 32-byte seed of an Ed25519 key file, or None when it holds no Ed25519 key."""
    pem = _PKCS8_PEM.search(content)
    if pem is None:
        raw = content.strip()
        return _decoded_seed(raw) if _BASE64.fullmatch(raw) else None
    try:
        der = base64.b64decode(b"".join(pem.group(1).split()), validate=True)
    except binascii.Error:
        return None  # not even base64: left to dkimpy, whose error will say so
    if der.startswith(_ED25519_PKCS8) and len(der) == len(_ED25519_PKCS8) + _SEED_SIZE:
        return der[len(_ED25519_PKCS8) :]
    if _ED25519_OID in der[: len(_ED25519_PKCS8)]:
        # RFC 5958's longer forms (the public key or attributes beside the seed): rare,
        # and OpenSSL 3.0 cannot read them either.  Said plainly rather than sent on to
        # dkimpy's RSA parser, whose error would be about RSA.
        raise ValueError(
            "holds an Ed25519 key in a PKCS#8 form other than the one openssl genpkey "
            "writes (RFC 8410 section 7: the seed alone, no public key or attributes)"
        )
    return None


def _decoded_seed(text: bytes) -> bytes | None:
    try:
        seed = base64.b64decode(text, validate=True)
    except binascii.Error:  # bad padding
        return None
    return seed if len(seed) == _SEED_SIZE else None


def _load_key(selector: str, content: bytes, algorithm: Algorithm | None) -> SigningKey:
    """The key in ``content``; ValueError naming the algorithm when it is not one."""
    seed = _ed25519_seed(content)
    found: Algorithm = RSA if seed is None else ED25519
    if algorithm == ED25519 and seed is None:
        raise ValueError(
            f'holds no Ed25519 private key (algorithm = "{ED25519}"): expected ' + _ED25519_FORMS
        )
    if algorithm == RSA and seed is not None:
        raise ValueError(f'holds an Ed25519 key, not the RSA key algorithm = "{RSA}" asks for')
    private = content if seed is None else base64.b64encode(seed)
    return SigningKey(selector.encode(), found, private)


def _configured(options: Options) -> list[tuple[str, tuple[str | int, ...], DomainKey]]:
    """Each key with its domain and its path in the options (indexed in an array)."""
    out: list[tuple[str, tuple[str | int, ...], DomainKey]] = []
    for domain, keys in options.domains.items():
        if isinstance(keys, DomainKey):
            out.append((domain, ("domains", domain), keys))
        else:
            out.extend((domain, ("domains", domain, i), key) for i, key in enumerate(keys))
    return out


def _respelt(options: Options) -> list[OptionError]:
    """A domain given twice, in two spellings (case, a U-label and its A-label): its keys
    would be pooled, unchecked for a repeated selector, so a message could carry a
    signature whose ``s=`` names another key's record, failing every verification."""
    first: dict[str, str] = {}
    faults = []
    for domain in options.domains:
        name = bare_domain(domain)
        if first.setdefault(name, domain) != domain:
            faults.append(
                OptionError(
                    ("domains", domain),
                    f"names the domain {first[name]!r} names ({name}): give all its keys "
                    "in one entry",
                )
            )
    return faults


class Signer:
    def __init__(self, options: Options) -> None:
        self.headers = [name.encode() for name in options.headers]
        header_c, body_c = options.canonicalization.split("/")
        self.canonicalize = (header_c.encode(), body_c.encode())
        # Keyed by the A-label form (RFC 5890): a key configured under "bücher.example"
        # and one under "xn--bcher-kva.example" name the same domain, as do the From
        # addresses that use either form.
        self.keys: dict[str, tuple[SigningKey, ...]] = {}
        faults = _respelt(options)
        for domain, where, key in _configured(options):
            try:
                loaded = self._checked(bare_domain(domain), key)
            except _KeyFault as fault:
                faults.append(OptionError((*where, "key_file"), str(fault)))
                continue
            name = bare_domain(domain)
            self.keys[name] = (*self.keys.get(name, ()), loaded)
        if faults:  # every bad key at once, each naming its domain
            raise ExceptionGroup("DKIM key files", faults)

    def _checked(self, domain: str, key: DomainKey) -> SigningKey:
        """The key in ``key.key_file``, proven to sign; _KeyFault saying why not."""
        path = str(key.key_file)
        try:
            content = key.key_file.read_bytes()
        except OSError as exc:
            raise _KeyFault(f"cannot read key file {path!r}: {exc.strerror or exc}") from exc
        try:
            loaded = _load_key(key.selector, content, key.algorithm)
        except ValueError as exc:
            raise _KeyFault(f"key file {path!r} {exc}") from exc
        try:
            # A file that reads but holds no usable private key would otherwise pass
            # start-up and fail every signing, deferring the domain's mail until it
            # expires: sign a tiny message now, exactly as a delivery would.
            _sign_with(loaded, _PROBE, domain, self.headers, self.canonicalize)
        except dkimpy.DKIMException as exc:
            problem = f"key file {path!r} holds no usable private key (read as {loaded.algorithm})"
            if key.algorithm is None and loaded.algorithm == RSA:
                # What is not an Ed25519 key is tried as RSA: say what Ed25519 would be.
                problem += f"; an Ed25519 key would be {_ED25519_FORMS}"
            raise _KeyFault(f"{problem}: {exc}") from exc
        return loaded

    def domain_for(self, headers: bytes, sender: str) -> str | None:
        for candidate in (*_from_domains(headers), _domain(sender)):
            if candidate is not None and candidate in self.keys:
                return candidate
        return None

    def sign(self, message: bytes, domain: str) -> tuple[bytes, ...]:
        """One DKIM-Signature field per key of ``domain``, each over ``message`` alone."""
        return tuple(
            _sign_with(key, message, domain, self.headers, self.canonicalize)
            for key in self.keys[domain]
        )


class _KeyFault(Exception):
    """A key file that cannot sign, with the sentence that says why."""


def _sign_with(
    key: SigningKey,
    message: bytes,
    domain: str,
    headers: list[bytes],
    canonicalize: tuple[bytes, bytes],
) -> bytes:
    signature: bytes = dkimpy.sign(
        message,
        key.selector,
        domain.encode(),
        key.private,
        canonicalize=canonicalize,
        include_headers=headers,
        linesep=b"\r\n",
        signature_algorithm=key.algorithm.encode(),
    )
    return signature


def _domain(address: str) -> str | None:
    _local, at, domain = address.rpartition("@")
    return bare_domain(domain) if at and domain else None


def _from_domains(headers: bytes) -> list[str | None]:
    # The standard library's parser unfolds and decodes header fields; compat32 gives the
    # raw strings getaddresses expects.  Header fields are UTF-8 in an internationalised
    # message (RFC 6532 section 3.2): decoded as such, a U-label From domain stays itself
    # (BytesHeaderParser would turn each non-ASCII byte into an unmatchable surrogate).
    text = headers.decode("utf-8", "surrogateescape")
    parsed = HeaderParser(policy=compat32).parsestr(text)
    values = [str(value) for value in parsed.get_all("From", [])]
    return [_domain(address) for _name, address in getaddresses(values)]


async def _read_at_most(args: SenderHeadersArgs, limit: int) -> bytes | None:
    """The whole message, or None (read no further) once it is past ``limit`` bytes."""
    chunks = [args.headers]
    size = len(args.headers)
    async for chunk in args.body():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def init(app: PluginApp) -> None:
    options = app.options
    assert isinstance(options, Options)
    signer = Signer(options)  # reads every key file now: fail at start-up, not per delivery

    async def sign(args: SenderHeadersArgs) -> AddHeaders | None:
        domain = signer.domain_for(args.headers, args.sender)
        if domain is None:
            return None
        message = await _read_at_most(args, options.max_size)
        if message is None:
            app.log.warning(
                "message %s to %s is over max_size (%d bytes): sent without a DKIM signature",
                args.message_id,
                args.domain,
                options.max_size,
            )
            return None
        try:
            # Hashing and signing take milliseconds per megabyte: off the worker's event loop.
            signatures = await app.to_thread(signer.sign, message, domain)
        except Exception as exc:
            # The key signed at start-up, so this is the message: a header section dkimpy
            # cannot parse (a line without a colon, against RFC 5322 section 2.2, is its
            # MessageFormatError; one that starts with a folded line an IndexError).  As
            # with max_size, it will not change: failing the hook would defer it at every
            # attempt and bounce it at max_age, so it goes out unsigned.
            app.log.warning(
                "message %s to %s cannot be signed (%s): sent without a DKIM signature",
                args.message_id,
                args.domain,
                exc,
            )
            return None
        return AddHeaders(signatures)

    app.add_hook(Hook.SENDER_HEADERS, sign)
