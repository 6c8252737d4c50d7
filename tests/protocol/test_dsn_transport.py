"""``transport_needs``: the BODY=8BITMIME and SMTPUTF8 a built notice must be sent with."""

from __future__ import annotations

from typing import Any

import pytest

from tests.protocol.test_dsn import parse, rcpt, request
from zoneq.protocol.dsn import DsnTransport, Ret, build_dsn, transport_needs

UTF8_HEADERS = "From: Jörg <joerg@example.org>\r\nSubject: Grüße\r\n".encode()
LATIN1_BODY = b"Gr\xfc\xdfe\r\n"


@pytest.mark.parametrize(
    ("overrides", "part", "needs"),
    [
        ({}, "text/rfc822-headers", DsnTransport(body_8bit=False, smtputf8=False)),
        ({"ret": Ret.FULL}, "message/rfc822", DsnTransport(body_8bit=False, smtputf8=False)),
        (
            # message/rfc822 cannot be encoded (RFC 2046 section 5.2.1): headers only.
            {"ret": Ret.FULL, "original_body": LATIN1_BODY},
            "text/rfc822-headers",
            DsnTransport(body_8bit=False, smtputf8=False),
        ),
        (
            {"ret": Ret.HDRS, "original_body": LATIN1_BODY},  # the body is not returned
            "text/rfc822-headers",
            DsnTransport(body_8bit=False, smtputf8=False),
        ),
        (
            # Quoted-printable (RFC 6532 section 3.5): goes to a server without SMTPUTF8.
            {"ret": Ret.FULL, "original_headers": UTF8_HEADERS},
            "message/global",
            DsnTransport(body_8bit=False, smtputf8=False),
        ),
        (
            {"original_headers": UTF8_HEADERS},
            "message/global-headers",
            DsnTransport(body_8bit=False, smtputf8=False),
        ),
        (
            # A UTF-8 sender needs SMTPUTF8 anyway: the original goes back as it is.
            {"ret": Ret.FULL, "original_body": LATIN1_BODY, "envelope_sender": "jörg@example.org"},
            "message/rfc822",
            DsnTransport(body_8bit=True, smtputf8=True),
        ),
        (
            # UTF-8 header fields with a NUL cannot be returned: no third part, no SMTPUTF8.
            {"original_headers": UTF8_HEADERS + b"X-Bad: \x00\r\n"},
            None,
            DsnTransport(body_8bit=False, smtputf8=False),
        ),
        (
            {"envelope_sender": "jörg@example.org"},  # RFC 6531: the RCPT TO needs it
            "text/rfc822-headers",
            DsnTransport(body_8bit=True, smtputf8=True),
        ),
        (
            # A non-ASCII final recipient is written as utf-8 xtext (RFC 6533): still 7-bit.
            {"recipients": (rcpt(final_recipient="jörg@example.com"),)},
            "text/rfc822-headers",
            DsnTransport(body_8bit=False, smtputf8=False),
        ),
    ],
    ids=[
        "hdrs",
        "full",
        "full-8bit-body",
        "hdrs-8bit-body",
        "full-utf8-headers",
        "hdrs-utf8-headers",
        "utf8-sender-8bit-body",
        "headers-not-returnable",
        "utf8-sender",
        "utf8-recipient",
    ],
)
def test_transport_needs(overrides: dict[str, Any], part: str | None, needs: DsnTransport) -> None:
    req = request(**overrides)
    notice = build_dsn(req)
    parts = list(parse(notice).iter_parts())
    assert (parts[2].get_content_type() if len(parts) == 3 else None) == part
    assert transport_needs(req, notice) == needs
    assert needs.body_8bit == (not notice.isascii())  # RFC 6152 section 3
