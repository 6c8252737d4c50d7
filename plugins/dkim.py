"""DKIM signing (RFC 6376) per sender domain, at the ``sender:headers`` hook, with dkimpy.

    [plugins.dkim]
    [plugins.dkim.options.domains."example.com"]
    selector = "s2026"
    key_file = "/etc/zoneq/dkim/example.com.pem"

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
and RSA run on the plugin's own threads, so a large message does not stall the worker's
other connections.  ``max_size`` bounds the memory that costs: a message larger than it
goes out unsigned, with a warning in the log.  Not deferred: its size will not change, so
retrying could only end in a bounce days later, whereas unsigned mail is still delivered
(how receivers treat it is the domain's DMARC policy's call).  An administrator who wants
such mail refused sets ``receiver.max_message_size`` at or below ``max_size``, and it is
refused at DATA (552) before it is ever accepted.  A message dkimpy cannot parse (a
header line without a colon) goes out unsigned too, with a warning, for the same reason.
"""

from __future__ import annotations

import re
from email.parser import HeaderParser
from email.policy import compat32
from email.utils import getaddresses
from pathlib import Path
from typing import Annotated, Literal

# This file is plugins/dkim.py, loaded by path under another module name, so "dkim" here
# is the dkimpy package and not this file.
import dkim as dkimpy
from pydantic import AfterValidator, BaseModel, ByteSize, ConfigDict, Field, field_validator

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


class DomainKey(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    selector: str = Field(pattern=r"^[A-Za-z0-9](?:[A-Za-z0-9._-]{0,62})$")
    key_file: Path


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

    domains: dict[str, DomainKey]
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


class Signer:
    def __init__(self, options: Options) -> None:
        self.headers = [name.encode() for name in options.headers]
        header_c, body_c = options.canonicalization.split("/")
        self.canonicalize = (header_c.encode(), body_c.encode())
        # Keyed by the A-label form (RFC 5890): a key configured under "bücher.example"
        # and one under "xn--bcher-kva.example" name the same domain, as do the From
        # addresses that use either form.
        self.keys: dict[str, tuple[bytes, bytes]] = {}
        faults: list[OptionError] = []
        for domain, key in options.domains.items():
            name = bare_domain(domain)
            where = ("domains", domain, "key_file")
            try:
                entry = (key.selector.encode(), key.key_file.read_bytes())
            except OSError as exc:
                problem = f"cannot read key file {str(key.key_file)!r}: {exc.strerror or exc}"
                faults.append(OptionError(where, problem))
                continue
            self.keys[name] = entry
            try:
                # A file that reads but holds no usable private key would otherwise pass
                # start-up and fail every signing, deferring the domain's mail until it
                # expires: sign a tiny message now, exactly as a delivery would.
                self.sign(_PROBE, name)
            except dkimpy.DKIMException as exc:
                del self.keys[name]
                problem = f"key file {str(key.key_file)!r} holds no usable private key: {exc}"
                faults.append(OptionError(where, problem))
        if faults:  # every bad key at once, each naming its domain
            raise ExceptionGroup("DKIM key files", faults)

    def domain_for(self, headers: bytes, sender: str) -> str | None:
        for candidate in (*_from_domains(headers), _domain(sender)):
            if candidate is not None and candidate in self.keys:
                return candidate
        return None

    def sign(self, message: bytes, domain: str) -> bytes:
        selector, key = self.keys[domain]
        signature: bytes = dkimpy.sign(
            message,
            selector,
            domain.encode(),
            key,
            canonicalize=self.canonicalize,
            include_headers=self.headers,
            linesep=b"\r\n",
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
            # Hashing and RSA take milliseconds per megabyte: off the worker's event loop.
            signature = await app.to_thread(signer.sign, message, domain)
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
        return AddHeaders((signature,))

    app.add_hook(Hook.SENDER_HEADERS, sign)
