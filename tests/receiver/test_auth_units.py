"""The receiver's pure parts: SASL exchanges, password hashes, relay rules, deadlines."""

from __future__ import annotations

import ipaddress
import subprocess
import sys

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zoneq.receiver.deadline import RequestDeadline
from zoneq.receiver.passwords import dummy_hash, hash_password, parse_hash, verify_password
from zoneq.receiver.relay import (
    PERCENT_HACK,
    SOURCE_ROUTE,
    RelayPolicy,
    address_refusal,
)
from zoneq.receiver.sasl import MALFORMED, Credentials, SaslError, SaslExchange

# --- SASL -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("message", "expected"),
    [
        (b"\0alice\0pw", Credentials("alice", "pw", "")),
        (b"alice\0alice\0pw", Credentials("alice", "pw", "alice")),
        (b"bob\0alice\0pw", Credentials("alice", "pw", "bob")),
        ("\0j\u00f6rg\0p\u00e4ss".encode(), Credentials("j\u00f6rg", "p\u00e4ss", "")),
        (b"\0alice\0pw with spaces", Credentials("alice", "pw with spaces", "")),
    ],
)
def test_plain_messages(message: bytes, expected: Credentials) -> None:
    assert SaslExchange("PLAIN").start(message) == expected


@pytest.mark.parametrize(
    "message",
    [
        b"",
        b"alice\0pw",  # two parts
        b"\0\0pw",  # no user
        b"\0alice\0",  # no password
        b"\0alice\0pw\0more",
        b"\0\xff\xfe\0pw",  # not UTF-8
        b"\0" + b"a" * 256 + b"\0pw",  # RFC 4616: at most 255 octets
    ],
)
def test_malformed_plain_is_501(message: bytes) -> None:
    with pytest.raises(SaslError) as caught:
        SaslExchange("PLAIN").start(message)
    assert caught.value.reply is MALFORMED
    assert caught.value.reply.code == 501


def test_plain_without_initial_response_asks_with_an_empty_challenge() -> None:
    exchange = SaslExchange("PLAIN")
    assert exchange.start(None) == b""
    assert exchange.step(b"\0u\0p") == Credentials("u", "p")


@pytest.mark.parametrize(
    ("initial", "responses", "expected"),
    [
        (None, [b"Username:", b"Password:"], Credentials("user", "secret")),
        (b"user", [b"Password:"], Credentials("user", "secret")),
    ],
)
def test_login_challenges(
    initial: bytes | None, responses: list[bytes], expected: Credentials
) -> None:
    exchange = SaslExchange("LOGIN")
    got = [exchange.start(initial)]
    if initial is None:
        got.append(exchange.step(b"user"))
    got.append(exchange.step(b"secret"))
    assert got == [*responses, expected]


def test_credentials_never_show_the_password() -> None:
    text = repr(Credentials("alice", "hunter2"))
    assert "alice" in text and "hunter2" not in text


def test_unknown_mechanism_is_a_driver_bug() -> None:
    with pytest.raises(ValueError):
        SaslExchange("CRAM-MD5")


# --- password hashes ------------------------------------------------------------------------


def test_hash_round_trip_and_salting() -> None:
    stored = hash_password("s3cret")
    assert stored.startswith("scrypt$ln=14,r=8,p=1$")
    assert verify_password(stored, "s3cret")
    assert not verify_password(stored, "s3cret ")
    assert not verify_password(stored, "S3cret")
    assert hash_password("s3cret") != stored  # a new salt each time
    assert not verify_password(dummy_hash(), "anything")


@settings(max_examples=25, deadline=None)
@given(password=st.text(max_size=40), other=st.text(max_size=40))
def test_any_password_verifies_and_only_itself(password: str, other: str) -> None:
    stored = hash_password(password, log_n=4)  # cheap parameters: the property is the format
    assert verify_password(stored, password)
    assert verify_password(stored, other) == (other == password)


@pytest.mark.parametrize(
    ("stored", "problem"),
    [
        ("plain-text-password", "not a password hash"),
        ("scrypt$ln=14,r=8,p=1$c2FsdA", "not a password hash"),
        ("scrypt$ln=30,r=8,p=1$c2FsdA$" + "A" * 43, "out of range"),
        ("scrypt$ln=14,r=0,p=1$c2FsdA$" + "A" * 43, "out of range"),
        ("scrypt$ln=14,r=8,p=1$c2FsdA$QUJD", "too short"),
        ("scrypt$ln=14,r=8,p=1$c$" + "A" * 43, "bad base64"),
    ],
)
def test_bad_stored_hashes_say_why(stored: str, problem: str) -> None:
    with pytest.raises(ValueError, match=problem):
        parse_hash(stored)


def hash_password_command(stdin: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zoneq", "hash-password"],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )


def test_hash_password_command_reads_stdin() -> None:
    done = hash_password_command("pipe d\n")
    assert done.returncode == 0, done.stderr
    [line] = done.stdout.splitlines()
    assert verify_password(line, "pipe d")
    empty = hash_password_command("\n")
    assert empty.returncode == 1 and "empty password" in empty.stderr


# --- relay rules ----------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("address", "route", "expected"),
    [
        ("user@example.org", None, None),
        ("user@example.org", "@relay.example", SOURCE_ROUTE),
        ("user@example.org", "@a.example,@b.example", SOURCE_ROUTE),
        ("user%other.example@relay.example", None, PERCENT_HACK),
        ("postmaster", None, None),
        ('"odd@local"@example.org', None, None),
    ],
)
def test_address_refusal(address: str, route: str | None, expected: object) -> None:
    assert address_refusal(address, route) is expected


@pytest.mark.parametrize(
    ("ip", "allowed"),
    [
        ("127.0.0.1", True),
        ("127.0.0.2", False),
        ("192.0.2.7", True),
        ("::ffff:192.0.2.7", True),  # IPv4 client on a dual-stack socket
        ("2001:db8::1", True),
        ("2001:db9::1", False),
        ("not an address", False),
    ],
)
def test_relay_policy_by_network(ip: str, allowed: bool) -> None:
    networks = [ipaddress.ip_network(n) for n in ("127.0.0.1/32", "192.0.2.0/24", "2001:db8::/32")]
    assert RelayPolicy(networks).client_allowed(ip) is allowed


# --- request deadlines ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("steps", "left"),
    [
        ([], 10.0),
        ([(4.0, 0)], 6.0),
        ([(4.0, 0), (7.0, 0)], -1.0),
        ([(4.0, 1000)], 8.0),  # 1,000 octets at 500/s earn 2 s
        ([(1.0, 100_000)], 10.0),  # never more than the timeout ahead
        ([(9.0, 0), (0.5, 500)], 1.5),
    ],
)
def test_deadline_spending(steps: list[tuple[float, int]], left: float) -> None:
    deadline = RequestDeadline(10.0, 500)
    for elapsed, octets in steps:
        deadline.spend(elapsed, octets)
    assert deadline.left == pytest.approx(left)
    assert deadline.expired is (left <= 0)
    deadline.restart()
    assert deadline.left == 10.0


@given(
    pause=st.floats(min_value=0.01, max_value=5.0),
    octets=st.integers(min_value=0, max_value=10),
    timeout=st.floats(min_value=1.0, max_value=300.0),
)
def test_a_trickle_below_the_rate_always_expires_in_bounded_time(
    pause: float, octets: int, timeout: float
) -> None:
    """Bytes at half the minimum rate or less: the deadline passes within 2x the timeout."""
    rate = max(1, int(4 * octets / pause) + 1)  # octets/pause <= rate/4
    deadline = RequestDeadline(timeout, rate)
    spent = 0.0
    while not deadline.expired:
        deadline.spend(pause, octets)
        spent += pause
        assert deadline.left <= timeout
        assert spent <= 2 * timeout + pause
