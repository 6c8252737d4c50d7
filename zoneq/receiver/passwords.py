"""Password hashes for the receiver's AUTH users: scrypt (RFC 7914) from ``hashlib``.

A stored hash reads ``scrypt$ln=14,r=8,p=1$<salt>$<key>`` (salt and key in unpadded
base64), the parameters of passlib's scrypt format without its leading ``$`` so that a
TOML string holds it as it is.  scrypt is memory-hard, so a stolen config costs an
attacker memory as well as time per guess; the standard library has it (OpenSSL), so no
dependency is added for it.  ``ln=14, r=8`` is 16 MiB and some tens of milliseconds per
check, the interactive-login figure of RFC 7914 section 2 and of the ``scrypt`` paper.

Pure apart from ``os.urandom`` for a new salt: no I/O, no clock.  Verification compares in
constant time (``hmac.compare_digest``), and a check for an unknown user costs as much as a
check for a known one (``dummy_hash()``), so timing tells nothing about who exists.
"""

from __future__ import annotations

import base64
import binascii
import functools
import hashlib
import hmac
import os
import re
from dataclasses import dataclass
from typing import Final

__all__ = ["dummy_hash", "hash_password", "parse_hash", "verify_password"]

SCHEME: Final = "scrypt"
DEFAULT_LOG_N: Final = 14
DEFAULT_R: Final = 8
DEFAULT_P: Final = 1
SALT_BYTES: Final = 16
KEY_BYTES: Final = 32
# Bounds on what a stored hash may ask for: enough for any sensible setting, and a cap on
# the memory one check may take (128 * r * 2**ln octets; 2**20 * 8 * 128 = 1 GiB).
_MAX_LOG_N: Final = 20
_MAX_R: Final = 32
_MAX_P: Final = 16
_FORMAT: Final = re.compile(
    r"scrypt\$ln=(?P<ln>[0-9]{1,2}),r=(?P<r>[0-9]{1,2}),p=(?P<p>[0-9]{1,2})"
    r"\$(?P<salt>[A-Za-z0-9+/]+)\$(?P<key>[A-Za-z0-9+/]+)"
)


@dataclass(frozen=True, slots=True)
class _Hash:
    log_n: int
    r: int
    p: int
    salt: bytes
    key: bytes


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode("ascii").rstrip("=")


def _unb64(text: str) -> bytes:
    return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)


def parse_hash(stored: str) -> _Hash:
    """Read a stored hash; ``ValueError`` saying what is wrong when it is not one."""
    match = _FORMAT.fullmatch(stored)
    if match is None:
        raise ValueError("not a password hash: expected 'scrypt$ln=N,r=R,p=P$salt$key'")
    log_n, r, p = int(match["ln"]), int(match["r"]), int(match["p"])
    if not (1 <= log_n <= _MAX_LOG_N and 1 <= r <= _MAX_R and 1 <= p <= _MAX_P):
        raise ValueError(
            f"scrypt parameters out of range (ln 1-{_MAX_LOG_N}, r 1-{_MAX_R}, p 1-{_MAX_P})"
        )
    try:
        salt, key = _unb64(match["salt"]), _unb64(match["key"])
    except binascii.Error:
        raise ValueError("bad base64 in password hash") from None
    if len(key) < 16:
        raise ValueError("password hash key too short")
    return _Hash(log_n, r, p, salt, key)


def _derive(password: str, params: _Hash, length: int) -> bytes:
    n = 1 << params.log_n
    return hashlib.scrypt(
        password.encode("utf-8"),
        salt=params.salt,
        n=n,
        r=params.r,
        p=params.p,
        maxmem=128 * params.r * n * (params.p + 1) + (1 << 20),
        dklen=length,
    )


def hash_password(password: str, *, salt: bytes | None = None, log_n: int = DEFAULT_LOG_N) -> str:
    """A new stored hash for ``password`` (a random salt unless one is given)."""
    salt = os.urandom(SALT_BYTES) if salt is None else salt
    key = _derive(password, _Hash(log_n, DEFAULT_R, DEFAULT_P, salt, b""), KEY_BYTES)
    return f"{SCHEME}$ln={log_n},r={DEFAULT_R},p={DEFAULT_P}${_b64(salt)}${_b64(key)}"


def verify_password(stored: str, password: str) -> bool:
    """True when ``password`` matches ``stored``; the comparison takes constant time."""
    parsed = parse_hash(stored)
    key = _derive(password, parsed, len(parsed.key))
    return hmac.compare_digest(key, parsed.key)


@functools.cache
def dummy_hash() -> str:
    """A hash to check an unknown user's password against (made once, when first needed:
    every zoneq process imports this module, and a scrypt costs 16 MiB and some 50 ms)."""
    return hash_password("", salt=b"\0" * SALT_BYTES)
