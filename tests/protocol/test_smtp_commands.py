"""Tests for zoneq.protocol.smtp_commands: MAIL's AUTH= parameter (RFC 4954 section 5).

The other parameters are covered through the state machine (``test_smtp_server.py``); these
are the pure parser's answers, given whether EHLO advertised AUTH.
"""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zoneq.protocol.smtp_commands import CommandError, MailCommand, parse_mail
from zoneq.protocol.xtext import xtext_encode

FROM = "FROM:<a@b.test>"


def reply_to(argument: str, *, auth: bool = True, esmtp: bool = True) -> str:
    """``250`` when parsed, else the refusal's code and enhanced status."""
    try:
        parse_mail(argument, esmtp=esmtp, max_size=1000, auth=auth)
    except CommandError as error:
        return f"{error.reply.code} {error.reply.enhanced}"
    return "250"


@pytest.mark.parametrize(
    ("argument", "auth", "expected"),
    [
        (f"{FROM} AUTH=<>", True, "250"),  # the identity is unknown or not trusted
        (f"{FROM} AUTH=alice+40b.test", True, "250"),  # alice@b.test
        (f"{FROM} Auth=alice@b.test", True, "250"),  # keywords are case-insensitive
        (f"{FROM} AUTH=+22a+20b+22@c.test", True, "250"),  # a quoted local part
        (f"{FROM} SIZE=10 AUTH=<> RET=HDRS", True, "250"),
        (f"{FROM} AUTH=bad+Z", True, "501 5.5.4"),  # "+" needs two hex digits
        (f"{FROM} AUTH=a+", True, "501 5.5.4"),
        (f"{FROM} AUTH=+FF@b", True, "501 5.5.4"),  # not UTF-8
        (f"{FROM} AUTH=alice", True, "501 5.5.4"),  # neither an addr-spec nor <>
        (f"{FROM} AUTH=@b.test", True, "501 5.5.4"),
        (f"{FROM} AUTH=a@", True, "501 5.5.4"),
        (f"{FROM} AUTH=<", True, "501 5.5.4"),
        (f"{FROM} AUTH=a+00@b", True, "501 5.5.4"),  # a control character
        (f"{FROM} AUTH", True, "501 5.5.4"),
        (f"{FROM} AUTH=", True, "501 5.5.4"),
        (f"{FROM} AUTH=<> AUTH=<>", True, "501 5.5.4"),
        (f"{FROM} AUTH=<>", False, "555 5.5.4"),  # AUTH not advertised: unknown
        (f"{FROM} AUTH=bad+Z", False, "555 5.5.4"),
    ],
)
def test_auth_parameter(argument: str, auth: bool, expected: str) -> None:
    assert reply_to(argument, auth=auth) == expected


def test_auth_parameter_after_helo_is_555() -> None:
    assert reply_to(f"{FROM} AUTH=<>", esmtp=False) == "555 5.5.4"


_LOCAL = st.text(st.characters(codec="utf-8", exclude_categories=("Cc", "Cs")), min_size=1)
_DOMAIN = st.from_regex(r"[a-z0-9]([a-z0-9.-]{0,30}[a-z0-9])?", fullmatch=True)


@given(_LOCAL, _DOMAIN)
def test_any_encoded_address_is_accepted_and_not_kept(local: str, domain: str) -> None:
    """RFC 4954 section 5: any addr-spec, xtext-encoded, is taken; the command parsed is
    the one without the parameter (zoneq does not pass the identity on)."""
    argument = f"{FROM} AUTH={xtext_encode(local + '@' + domain)}"
    parsed = parse_mail(argument, esmtp=True, max_size=1000, auth=True)
    assert parsed == MailCommand("a@b.test")
    assert parsed == parse_mail(FROM, esmtp=True, max_size=1000, auth=True)
