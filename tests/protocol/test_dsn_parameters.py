"""ENVID and ORCPT at MAIL and RCPT (RFC 3461 sections 4.2 and 4.4, RFC 6533 section 3).

What the receiver stores is what the delivery side can send: one grammar
(``xtext.normal_orcpt``) on both sides.  Before the fix the receiver took an addr-type
with "_" and the raw UTF-8 (unitext) form, the sender refused both with a ValueError, and
every recipient of the job was deferred until it bounced.  Values that decode to controls
or non-ASCII were passed on too (RFC 3461: printable US-ASCII before xtext encoding).
"""

from __future__ import annotations

import pytest

from zoneq.delivery.transport.commands import sendable_orcpt
from zoneq.protocol.smtp_commands import CommandError, parse_mail, parse_rcpt

BAD_ORCPT = "501 5.5.4 Bad ORCPT parameter syntax"
BAD_ENVID = "501 5.5.4 Bad ENVID parameter syntax"
TOO_LONG = "501 5.5.4 ORCPT too long"


def stored_orcpt(value: str, *, smtputf8: bool = False) -> str:
    """The ORCPT stored for ``RCPT TO:<c@d.test> ORCPT=value``, or the refusal's text."""
    try:
        rcpt = parse_rcpt(f"TO:<c@d.test> ORCPT={value}", esmtp=True, smtputf8=smtputf8)
    except CommandError as error:
        return str(error.reply)
    assert rcpt.orcpt is not None
    return rcpt.orcpt


@pytest.mark.parametrize(
    ("value", "smtputf8", "expected"),
    [
        ("rfc822;orig+2Bx@d.test", False, "rfc822;orig+2Bx@d.test"),  # kept raw
        ("x_type;u5@ok.test", False, "x_type;u5@ok.test"),  # an atom (RFC 3461 4.2)
        ("utf-8;j\\x{F6}rg@d.test", False, "utf-8;j\\x{F6}rg@d.test"),
        # The unitext form (RFC 6533 section 3) only with SMTPUTF8, stored as xtext.
        ("utf-8;jörg@d.test", True, "utf-8;j\\x{F6}rg@d.test"),
        ("UTF-8;jörg@d.test", True, "UTF-8;j\\x{F6}rg@d.test"),
        ("utf-8;jörg@d.test", False, BAD_ORCPT),
        # Before xtext encoding: printable US-ASCII (controls never, in utf-8 neither).
        ("rfc822;a+0D+0Ab@d.test", False, BAD_ORCPT),
        ("rfc822;us+C3+A9r@d.test", False, BAD_ORCPT),
        ("rfc822;a+09b@d.test", False, BAD_ORCPT),
        ("utf-8;a\\x{D}\\x{A}b@d.test", True, BAD_ORCPT),
        ("utf-8;a\\x{85}b@d.test", True, BAD_ORCPT),  # a C1 control
        ("rfc822;a+20b@d.test", False, "rfc822;a+20b@d.test"),  # SP is printable
        ("rfc822", False, BAD_ORCPT),
        ("rfc822;", False, BAD_ORCPT),
        (";a@d.test", False, BAD_ORCPT),
        ("rfc(822);a@d.test", False, BAD_ORCPT),
        ("rfc822;a+2@d.test", False, BAD_ORCPT),
    ],
)
def test_orcpt_is_checked_and_normalised_at_rcpt(value: str, smtputf8: bool, expected: str) -> None:
    assert stored_orcpt(value, smtputf8=smtputf8) == expected


# RFC 3461 section 4.2's 500 characters are the parameter's as received.  The utf-8 form
# zoneq stores is longer (up to ten characters per non-ASCII one): a valid ORCPT was once
# refused on that length, and the whole recipient with it.
LONGEST_LOCAL = "п" * 32  # 64 octets: RFC 5321's longest local part
LONG_DOMAIN = ".".join(["д" * 30] * 3) + ".рф"  # 245 octets as UTF-8
# Each in utf-8-addr-xtext (RFC 6533 section 3).
OE, PE, DE, RF = "\\x{F6}", "\\x{43F}", "\\x{434}", "\\x{440}\\x{444}"  # ö п д рф


@pytest.mark.parametrize(
    ("value", "stored"),
    [
        pytest.param(
            f"utf-8;{LONGEST_LOCAL}@{LONG_DOMAIN}",
            f"utf-8;{PE * 32}@{'.'.join([DE * 30] * 3)}.{RF}",
            id="longest-local-part-long-domain",
        ),
        pytest.param(f"utf-8;{'ö' * 90}@d.test", f"utf-8;{OE * 90}@d.test", id="540-stored"),
        pytest.param(f"utf-8;{'ö' * 487}@d.test", f"utf-8;{OE * 487}@d.test", id="500-received"),
        pytest.param(f"utf-8;{'ö' * 488}@d.test", TOO_LONG, id="501-received"),
        pytest.param(f"rfc822;{'a' * 486}@d.test", f"rfc822;{'a' * 486}@d.test", id="ascii-500"),
        pytest.param(f"rfc822;{'a' * 487}@d.test", TOO_LONG, id="ascii-501"),
    ],
)
def test_orcpt_length_is_the_parameter_as_received(value: str, stored: str) -> None:
    assert stored_orcpt(value, smtputf8=True) == stored


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("QQ+2B314159", "QQ+2B314159"),
        ("a+20b", "a+20b"),
        ("x+00+0D+0Ay", BAD_ENVID),
        ("x+0D+0Ay", BAD_ENVID),
        ("caf+C3+A9", BAD_ENVID),
        ("a+7Fb", BAD_ENVID),
        ("a+2", BAD_ENVID),
    ],
)
def test_envid_must_decode_to_printable_us_ascii(value: str, expected: str) -> None:
    try:
        mail = parse_mail(f"FROM:<a@b.test> ENVID={value}", esmtp=True, max_size=10**6)
    except CommandError as error:
        assert str(error.reply) == expected
    else:
        assert mail.envid == expected


@pytest.mark.parametrize(
    ("stored", "sent"),
    [
        ("rfc822;orig+2Bx@d.test", "rfc822;orig+2Bx@d.test"),
        ("x_type;u5@ok.test", "x_type;u5@ok.test"),
        ("utf-8;j\\x{F6}rg@d.test", "utf-8;j\\x{F6}rg@d.test"),
        # Stored by an older receiver: converted, or left out (None), never an error.
        ("utf-8;jörg@ok.test", "utf-8;j\\x{F6}rg@ok.test"),
        ("rfc822;a+0D+0Ab@d.test", None),
        ("no type", None),
        # RFC 3461 section 4.2: at most 500 characters as sent; a longer one is left out.
        pytest.param(f"utf-8;{OE * 81}@de.test", f"utf-8;{OE * 81}@de.test", id="500"),
        pytest.param(f"utf-8;{'ö' * 81}@de.test", f"utf-8;{OE * 81}@de.test", id="500-raw"),
        pytest.param(f"utf-8;{OE * 81}@def.test", None, id="501"),
        pytest.param(f"utf-8;{'ö' * 81}@def.test", None, id="501-raw"),
    ],
)
def test_the_sender_sends_what_the_receiver_stores(stored: str, sent: str | None) -> None:
    assert sendable_orcpt(stored) == sent
    if sent is not None:
        assert stored_orcpt(sent) == sent  # what is sent, the receiver takes as it is
