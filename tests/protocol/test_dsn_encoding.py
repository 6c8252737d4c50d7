"""How a notice is encoded: 7-bit for an ASCII sender, labelled 8bit otherwise.

A notice is built when it is queued, long before anyone knows whether the sender's MX
offers 8BITMIME or SMTPUTF8, and a notice refused for its encoding is lost (it is never
bounced in turn).  So a notice to an ASCII sender must be 7-bit whatever the original held
(RFC 6532 section 3.5 and RFC 6533 let message/global and message/global-headers be
quoted-printable; message/rfc822 cannot be encoded, RFC 2046 section 5.2.1, so an 8-bit
body stays home).  Every notice is parsed with the ``email`` package; the returned part is
cut out at the boundary and decoded, to compare it octet for octet.
"""

from __future__ import annotations

import binascii
from email.message import Message

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.protocol.test_dsn import (
    ORIGINAL_BODY,
    ORIGINAL_HEADERS,
    assert_clean_lines,
    human_text,
    parse,
    parts,
    request,
)
from zoneq.protocol.dsn import Ret, build_dsn, transport_needs

UTF8_HEADERS = "From: Jörg <joerg@example.org>\r\nSubject: Grüße = 1 \r\n".encode()
LATIN1_BODY = b"Gr\xfc\xdfe\r\n.\r\ntrailing space \r\n"
ASCII_SENDER = "alice@example.org"
UTF8_SENDER = "jörg@example.org"


def raw_third_part(data: bytes) -> tuple[Message, bytes]:
    """The third part and its content exactly as written, decoded if quoted-printable."""
    message = parse(data)
    third = parts(message)[2]
    boundary = message.get_boundary()
    assert boundary is not None
    pieces = data.split(b"\r\n--" + boundary.encode("ascii"))
    assert len(pieces) == 5 and pieces[4].startswith(b"--")
    _, _, content = pieces[3].partition(b"\r\n\r\n")
    if third["Content-Transfer-Encoding"] == "quoted-printable":
        content = binascii.a2b_qp(content)
    return third, content


# (sender, ret, headers, body) -> (third part's type, its CTE, what comes back, top CTE)
CASES = [
    pytest.param(
        ASCII_SENDER,
        Ret.FULL,
        UTF8_HEADERS,
        ORIGINAL_BODY,
        ("message/global", "quoted-printable", "whole", None),
        id="ascii-sender-utf8-headers-full",
    ),
    pytest.param(
        ASCII_SENDER,
        Ret.HDRS,
        UTF8_HEADERS,
        ORIGINAL_BODY,
        ("message/global-headers", "quoted-printable", "headers", None),
        id="ascii-sender-utf8-headers-hdrs",
    ),
    pytest.param(
        ASCII_SENDER,
        Ret.FULL,
        UTF8_HEADERS,
        LATIN1_BODY,
        ("message/global", "quoted-printable", "whole", None),
        id="ascii-sender-utf8-headers-8bit-body",
    ),
    pytest.param(
        ASCII_SENDER,
        Ret.FULL,
        ORIGINAL_HEADERS,
        LATIN1_BODY,
        ("text/rfc822-headers", "7bit", "headers", None),
        id="ascii-sender-8bit-body",
    ),
    pytest.param(
        ASCII_SENDER,
        Ret.FULL,
        ORIGINAL_HEADERS,
        ORIGINAL_BODY,
        ("message/rfc822", "7bit", "whole", None),
        id="ascii-sender-ascii-original",
    ),
    pytest.param(
        UTF8_SENDER,
        Ret.FULL,
        UTF8_HEADERS,
        LATIN1_BODY,
        ("message/global", "8bit", "whole", "8bit"),
        id="utf8-sender-utf8-headers",
    ),
    pytest.param(
        UTF8_SENDER,
        Ret.FULL,
        ORIGINAL_HEADERS,
        LATIN1_BODY,
        ("message/rfc822", "8bit", "whole", "8bit"),
        id="utf8-sender-8bit-body",
    ),
    pytest.param(
        UTF8_SENDER,
        Ret.HDRS,
        ORIGINAL_HEADERS,
        ORIGINAL_BODY,
        ("text/rfc822-headers", "7bit", "headers", "8bit"),  # the To: is UTF-8
        id="utf8-sender-ascii-original",
    ),
]


@pytest.mark.parametrize(("sender", "ret", "headers", "body", "expected"), CASES)
def test_encoding_of_each_notice(
    sender: str,
    ret: Ret,
    headers: bytes,
    body: bytes,
    expected: tuple[str, str, str, str | None],
) -> None:
    content_type, cte, returned, top_cte = expected
    req = request(envelope_sender=sender, ret=ret, original_headers=headers, original_body=body)
    data = build_dsn(req)
    assert_clean_lines(data)
    message = parse(data)
    assert not message.defects
    assert message.get_content_type() == "multipart/report"
    assert message["Content-Transfer-Encoding"] == top_cte  # RFC 2045 sections 6.2, 6.4
    assert [p.get_content_type() for p in parts(message)][:2] == [
        "text/plain",
        "message/delivery-status",
    ]
    third, content = raw_third_part(data)
    assert (third.get_content_type(), third["Content-Transfer-Encoding"]) == (content_type, cte)
    assert content == (headers + b"\r\n" + body if returned == "whole" else headers)
    # 7-bit exactly when the sender is ASCII; the flags follow (RFC 6152, RFC 6531).
    assert data.isascii() == sender.isascii()
    needs = transport_needs(req, data)
    assert (needs.body_8bit, needs.smtputf8) == (not data.isascii(), not sender.isascii())


def test_a_withheld_body_is_explained_in_the_text() -> None:
    data = build_dsn(request(ret=Ret.FULL, original_body=LATIN1_BODY))
    text = " ".join(human_text(parse(data)).split())
    assert "The header section of your message is attached below." in text
    assert "Its body is not returned: it holds 8-bit characters" in text


@pytest.mark.parametrize(
    ("ret", "body", "said"),
    [
        (Ret.FULL, ORIGINAL_BODY, False),  # returned whole
        (Ret.HDRS, LATIN1_BODY, False),  # not asked for: nothing to explain
        (Ret.FULL, None, False),  # not given (over the size cap)
        (Ret.FULL, b"nul \x00\r\n", True),
    ],
    ids=["full", "hdrs", "no-body", "nul"],
)
def test_the_text_only_explains_a_body_asked_for_and_left_out(
    ret: Ret, body: bytes | None, said: bool
) -> None:
    text = " ".join(human_text(parse(build_dsn(request(ret=ret, original_body=body)))).split())
    assert ("Its body is not returned" in text) is said


_line = st.binary(max_size=80).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
# Header lines with something besides blanks (a blank line would end the header section).
_headers = st.lists(_line.filter(lambda b: b.strip(b" \t") != b""), min_size=1, max_size=5)


@given(
    header_lines=_headers,
    body_lines=st.one_of(st.none(), st.lists(_line, max_size=8)),
    ret=st.sampled_from(Ret),
)
def test_any_original_gives_an_ascii_sender_a_7bit_notice(
    header_lines: list[bytes], body_lines: list[bytes] | None, ret: Ret
) -> None:
    headers = b"".join(line + b"\r\n" for line in header_lines)
    body = None if body_lines is None else b"".join(line + b"\r\n" for line in body_lines)
    req = request(original_headers=headers, original_body=body, ret=ret)
    data = build_dsn(req)
    # Whatever the original's octets: 7-bit, no flag needed, no 8bit label (RFC 6152,
    # RFC 6531, RFC 2045 section 6.4).
    assert data.isascii()
    assert_clean_lines(data)
    needs = transport_needs(req, data)
    assert (needs.body_8bit, needs.smtputf8) == (False, False)
    message = parse(data)
    assert "Content-Transfer-Encoding" not in message
    kinds = [p.get_content_type() for p in parts(message)]
    assert kinds[:2] == ["text/plain", "message/delivery-status"]
    if b"\x00" in headers:  # a header section MIME cannot carry: nothing returned
        assert len(kinds) == 2
        return
    third, content = raw_third_part(data)
    international = not headers.isascii()
    whole = None if body is None else headers + b"\r\n" + body
    # message/global can be encoded; message/rfc822 cannot, so it is for 7-bit text only.
    returnable = whole is not None and b"\x00" not in whole
    if ret is Ret.FULL and whole is not None and returnable and (international or whole.isascii()):
        expected_type = "message/global" if international else "message/rfc822"
        assert (third.get_content_type(), content) == (expected_type, whole)
        return
    expected_type = "message/global-headers" if international else "text/rfc822-headers"
    assert (third.get_content_type(), content) == (expected_type, headers)
