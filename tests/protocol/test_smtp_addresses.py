"""Tests for zoneq.protocol.smtp_commands: the domain of a MAIL or RCPT path.

RFC 5321 section 4.1.2: Domain = sub-domain *("." sub-domain), so no label may be empty:
not at either end (``b.test.``, the DNS root's dot, is no Domain), not between two dots.
The HTTP API refuses the same addresses (``zoneq.queue.intake.check_address``).
"""

from __future__ import annotations

import pytest

from zoneq.protocol.smtp_commands import CommandError, parse_mail, parse_rcpt
from zoneq.queue.intake import Unacceptable, check_address

EMPTY_LABEL = (
    "501 5.1.3 Bad address syntax: empty domain label (a dot at either end, or two in a row)"
)

DOMAINS = [
    ("b.test", "250"),
    ("b", "250"),
    ("B.Test", "250"),
    ("b.test.", EMPTY_LABEL),  # the reviewers' case: a separate destination otherwise
    ("everywhere.test.", EMPTY_LABEL),
    (".b.test", EMPTY_LABEL),
    ("b..test", EMPTY_LABEL),
    (".", EMPTY_LABEL),
    ("..", EMPTY_LABEL),
    ("[192.0.2.1]", "250"),  # an address literal (section 4.1.3) has no labels
    ("[IPv6:2001:db8::1]", "250"),
]


# SMTPUTF8 domains: the full stops IDNA maps to "." (UTS 46 section 4) separate labels too.
UTF8_DOMAINS = [
    ("bücher.test", "250"),
    ("b\u3002test", "250"),
    ("b.test\u3002", EMPTY_LABEL),
    ("b\uff0e\uff0etest", EMPTY_LABEL),
    ("\uff61b.test", EMPTY_LABEL),
]


def reply_to(parse: str, address: str) -> str:
    """``250`` when parsed (in an SMTPUTF8 transaction), else the refusal's text."""
    try:
        if parse == "MAIL":
            parse_mail(f"FROM:<{address}> SMTPUTF8", esmtp=True, max_size=1000)
        else:
            parse_rcpt(f"TO:<{address}>", esmtp=True, smtputf8=True)
    except CommandError as error:
        return str(error.reply)
    return "250"


@pytest.mark.parametrize("parse", ["MAIL", "RCPT"])
@pytest.mark.parametrize(("domain", "expected"), DOMAINS + UTF8_DOMAINS)
def test_domain_labels(parse: str, domain: str, expected: str) -> None:
    assert reply_to(parse, f"eve@{domain}") == expected


@pytest.mark.parametrize("parse", ["MAIL", "RCPT"])
def test_source_routed_mailbox_domain_is_checked_too(parse: str) -> None:
    assert reply_to(parse, "@hop.test:eve@b.test.") == EMPTY_LABEL


@pytest.mark.parametrize(("domain", "expected"), DOMAINS + UTF8_DOMAINS)
def test_the_http_api_refuses_the_same_domains(domain: str, expected: str) -> None:
    """Consistency with ``check_address``: what one refuses for an empty label, so does the
    other (the API also refuses other label syntax, which SMTP leaves to the next hop)."""
    try:
        check_address(f"eve@{domain}")
    except Unacceptable as error:
        assert expected == EMPTY_LABEL
        assert "empty domain label" in str(error)
    else:
        assert expected == "250"


BAD_SYNTAX = "501 5.1.3 Bad address syntax"

# RFC 5321 section 4.1.2: Local-part = Dot-string / Quoted-string (RFC 6531 section 3.3
# adds non-ASCII).  A second unquoted "@" is the old user@host@relay routing: refused, as
# the percent hack is.
LOCAL_PARTS = [
    ("eve", "250"),
    ("e.v.e", "250"),
    ("e..ve.", "250"),  # dots in a row: the owning domain's business
    ("jörg", "250"),
    ('"e v e"', "250"),
    ('"e@ve"', "250"),  # quoted, "@" is only text
    ('"e\\"ve"', "250"),
    ("v9@elsewhere.test", BAD_SYNTAX),
    ("w9@", BAD_SYNTAX),
    ("e ve", BAD_SYNTAX),
    ('"e"v"e"', BAD_SYNTAX),  # not one quoted-string
    ("e(ve)", BAD_SYNTAX),
    ("e[ve]", BAD_SYNTAX),
]


@pytest.mark.parametrize("parse", ["MAIL", "RCPT"])
@pytest.mark.parametrize(("local", "expected"), LOCAL_PARTS)
def test_local_part_syntax(parse: str, local: str, expected: str) -> None:
    assert reply_to(parse, f"{local}@ok.test") == expected


@pytest.mark.parametrize(("local", "expected"), LOCAL_PARTS)
def test_the_http_api_refuses_the_same_local_parts(local: str, expected: str) -> None:
    """One check (``local_parts.is_local_part``) for both ways in, space aside: the API
    refuses whitespace anywhere, quoted or not."""
    try:
        check_address(f"{local}@ok.test")
    except Unacceptable:
        assert expected == BAD_SYNTAX or " " in local
    else:
        assert expected == "250"
