"""Composing the notice for failed recipients (``zoneq.queue.bounces.compose``).

Pure: every case builds a notice from a message's metadata and stored text and parses it
back with the ``email`` package.  The returned original is compared octet for octet, cut
out of the notice at the MIME boundary the package reports (and decoded from
quoted-printable where it was encoded), because regenerating a parsed message/rfc822 part
with the package would not show a repeated or altered header section.
"""

from __future__ import annotations

import binascii
from email.message import EmailMessage
from email.parser import BytesParser
from email.policy import default as default_policy

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zoneq.protocol.dsn import Action
from zoneq.queue.bounces import Failure, any_wanted, compose, default_bounce_from
from zoneq.storage.records import MessageMeta, Notice, Recipient

MSG_ID = 0x1A2004BA127000
NOW_MS = 1_700_000_000_000

PLAIN = b"From: a@src.test\r\nSubject: plain\r\nMessage-ID: <p@src.test>\r\n\r\nbody line\r\n"
EMPTY_BODY = b"From: a@src.test\r\nSubject: empty\r\n\r\n"
# A body with an empty line of its own and a line that looks like a header field.
HEADER_LOOKALIKE = b"Subject: tricky\r\n\r\nFrom: not a header\r\n\r\nlast\r\n"
LATIN1_BODY = (
    b"From: a@src.test\r\nSubject: latin\r\nContent-Type: text/plain; charset=latin1\r\n"
    b"Content-Transfer-Encoding: 8bit\r\n\r\nGr\xfc\xdfe\r\n"
)
UTF8_HEADERS = "From: Jörg <a@src.test>\r\nSubject: Grüße\r\n\r\nHallo\r\n".encode()
UTF8_SENDER = "jörg@src.test"


def headers_of(original: bytes) -> bytes:
    return original.partition(b"\r\n\r\n")[0] + b"\r\n"


def notice_for(
    original: bytes,
    *,
    sender: str = "sender@src.test",
    ret: str | None = "FULL",
    notify: tuple[str, ...] = (),
    action: Action = Action.FAILED,
    diagnostic: str = "550 5.1.1 no such user",
    remote_mta: str | None = "mx.dest.test",
    bounce_from: str | None = None,
) -> Notice | None:
    """``compose`` as the queue service calls it: the whole stored text for RET=FULL."""
    meta = MessageMeta(MSG_ID, sender, len(original), 1, NOW_MS, ret=ret)
    recipient = Recipient("default", MSG_ID, "user@dest.test", "dest.test", notify=notify)
    retry_until = NOW_MS + 3_600_000 if action is Action.DELAYED else None
    failure = Failure(
        recipient,
        "5.1.1" if action is Action.FAILED else "4.4.1",
        diagnostic,
        remote_mta,
        action,
        retry_until,
    )
    return compose(
        meta,
        [failure],
        original_start=original,
        original_full=original if ret == "FULL" else None,
        reporting_mta="mta.zoneq.test",
        bounce_zone="bounces",
        now_ms=NOW_MS,
        bounce_from=bounce_from,
    )


def parsed(notice: bytes) -> EmailMessage:
    message = BytesParser(policy=default_policy).parsebytes(notice)
    assert isinstance(message, EmailMessage)
    return message


def returned_part(notice: bytes) -> tuple[str, bytes]:
    """The third part's content type and its content exactly as it stands in ``notice``,
    decoded from quoted-printable if it is (RFC 6532 section 3.5 allows it for
    message/global and message/global-headers, and nothing else here may be encoded)."""
    message = parsed(notice)
    assert message.get_content_type() == "multipart/report"
    parts = list(message.iter_parts())
    assert len(parts) == 3, "no returned original"
    boundary = message.get_boundary()
    assert boundary is not None
    # RFC 2046 section 5.1.1: the CRLF before a delimiter belongs to the delimiter.
    pieces = notice.split(b"\r\n--" + boundary.encode("ascii"))
    assert len(pieces) == 5 and pieces[4].startswith(b"--")
    raw = pieces[3]
    assert raw.startswith(b"\r\n")
    _, _, content = raw[2:].partition(b"\r\n\r\n")
    content_type = parts[2].get_content_type()
    if parts[2]["Content-Transfer-Encoding"] == "quoted-printable":
        assert content_type in ("message/global", "message/global-headers")
        content = binascii.a2b_qp(content)
    return content_type, content


@pytest.mark.parametrize(
    ("original", "sender", "content_type"),
    [
        (PLAIN, "sender@src.test", "message/rfc822"),
        (EMPTY_BODY, "sender@src.test", "message/rfc822"),
        (HEADER_LOOKALIKE, "sender@src.test", "message/rfc822"),
        (LATIN1_BODY, UTF8_SENDER, "message/rfc822"),  # 8-bit: only under SMTPUTF8
        (UTF8_HEADERS, "sender@src.test", "message/global"),  # RFC 6532 section 3.7, QP
        (UTF8_HEADERS, UTF8_SENDER, "message/global"),  # as it is
    ],
    ids=["plain", "empty-body", "header-lookalike", "8bit-body", "utf8-headers", "utf8-both"],
)
def test_ret_full_returns_the_original_once_and_exactly(
    original: bytes, sender: str, content_type: str
) -> None:
    notice = notice_for(original, sender=sender)
    assert notice is not None
    assert returned_part(notice.body) == (content_type, original)
    first = original.partition(b"\r\n")[0]
    assert notice.body.count(first) <= 1  # its first header, once (or encoded)


def test_ret_full_returns_the_header_section_of_an_8bit_body_to_an_ascii_sender() -> None:
    # message/rfc822 cannot be encoded (RFC 2046 section 5.2.1) and the notice may reach a
    # server without 8BITMIME: headers only (RFC 3461 section 4.3), and the reason said.
    notice = notice_for(LATIN1_BODY)
    assert notice is not None
    assert returned_part(notice.body) == ("text/rfc822-headers", headers_of(LATIN1_BODY))
    assert notice.body.isascii()
    text = parsed(notice.body).get_body(("plain",))
    assert text is not None
    assert "Its body is not returned" in " ".join(text.get_content().split())


def test_ret_hdrs_returns_the_header_section_alone() -> None:
    notice = notice_for(PLAIN, ret=None)
    assert notice is not None
    headers = PLAIN.partition(b"\r\n\r\n")[0] + b"\r\n"
    assert returned_part(notice.body) == ("text/rfc822-headers", headers)


# (sender, ret, original) -> (body_8bit, smtputf8): what the notice's transaction needs.
FLAGS = [
    ("sender@src.test", None, PLAIN, False, False),
    ("sender@src.test", "FULL", PLAIN, False, False),
    ("sender@src.test", "FULL", LATIN1_BODY, False, False),  # the body stays home
    ("sender@src.test", None, LATIN1_BODY, False, False),  # headers only: 7-bit
    ("sender@src.test", "FULL", UTF8_HEADERS, False, False),  # message/global, QP
    ("sender@src.test", None, UTF8_HEADERS, False, False),  # message/global-headers, QP
    (UTF8_SENDER, None, PLAIN, True, True),  # UTF-8 To: and RCPT TO
    (UTF8_SENDER, "FULL", LATIN1_BODY, True, True),  # and the 8-bit body returned
]


@pytest.mark.parametrize(("sender", "ret", "original", "body_8bit", "smtputf8"), FLAGS)
def test_the_notice_is_queued_with_the_flags_its_content_needs(
    sender: str, ret: str | None, original: bytes, body_8bit: bool, smtputf8: bool
) -> None:
    notice = notice_for(original, sender=sender, ret=ret)
    assert notice is not None
    assert (notice.meta.body_8bit, notice.meta.smtputf8) == (body_8bit, smtputf8)
    assert notice.meta.body_8bit == (not notice.body.isascii())  # RFC 6152 section 3
    assert notice.meta.sender == "" and notice.meta.is_bounce


@pytest.mark.parametrize(
    ("sender", "notify", "action", "wanted"),
    [
        ("sender@src.test", (), Action.FAILED, True),
        ("", (), Action.FAILED, False),  # the null reverse-path
        ("<>", (), Action.FAILED, False),
        ("sender@src.test", ("NEVER",), Action.FAILED, False),
        ("sender@src.test", (), Action.DELAYED, False),  # no NOTIFY: no delay notices
        ("sender@src.test", ("DELAY",), Action.DELAYED, True),
    ],
)
def test_any_wanted_agrees_with_compose(
    sender: str, notify: tuple[str, ...], action: Action, wanted: bool
) -> None:
    notice = notice_for(PLAIN, sender=sender, notify=notify, action=action)
    meta = MessageMeta(MSG_ID, sender, len(PLAIN), 1, NOW_MS)
    recipient = Recipient("default", MSG_ID, "user@dest.test", "dest.test", notify=notify)
    assert any_wanted(meta, [Failure(recipient, "4.4.1", None, None, action)]) is wanted
    assert (notice is not None) is wanted


_LINE = st.binary(max_size=60).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))


@given(
    headers=st.lists(_LINE.filter(lambda b: b.strip(b" \t") != b""), min_size=1, max_size=4),
    body=st.lists(_LINE, max_size=6),
)
def test_any_original_is_returned_exactly_and_flagged_right(
    headers: list[bytes], body: list[bytes]
) -> None:
    original = (
        b"".join(h + b"\r\n" for h in headers) + b"\r\n" + b"".join(line + b"\r\n" for line in body)
    )
    notice = notice_for(original)
    assert notice is not None
    # An ASCII sender's notice is 7-bit whatever the original holds: no flag needed.
    assert notice.body.isascii()
    assert (notice.meta.body_8bit, notice.meta.smtputf8) == (False, False)
    if b"\x00" not in original:  # NUL cannot be carried: then the headers come back alone
        content_type, returned = returned_part(notice.body)
        international = not headers_of(original).isascii()
        if original.isascii() or international:
            assert returned == original
            assert content_type == ("message/global" if international else "message/rfc822")
        else:  # an 8-bit body under ASCII headers: the header section alone
            assert (content_type, returned) == ("text/rfc822-headers", headers_of(original))


@pytest.mark.parametrize(
    ("bounce_from", "expected"),
    [
        (None, "MAILER-DAEMON@mta.zoneq.test"),
        ("postmaster@example.com", "postmaster@example.com"),
    ],
)
def test_the_notice_comes_from_bounce_from(bounce_from: str | None, expected: str) -> None:
    notice = notice_for(PLAIN, bounce_from=bounce_from)
    assert notice is not None
    assert parsed(notice.body)["From"].addresses[0].addr_spec == expected
    assert notice.meta.sender == ""  # the envelope stays <> (RFC 5321 section 4.5.5)
    assert default_bounce_from("mta.zoneq.test") == "MAILER-DAEMON@mta.zoneq.test"


@pytest.mark.parametrize(
    ("diagnostic", "remote_mta", "code"),
    [
        ("550 5.1.1 no such user", "mx.dest.test", "smtp; 550 5.1.1 no such user"),
        # The delivery worker's text for an NXDOMAIN (zoneq/delivery/mx.py): no server.
        (
            "550 5.1.2 domain dest.test does not exist (NXDOMAIN)",
            None,
            "X-zoneq; 550 5.1.2 domain dest.test does not exist (NXDOMAIN)",
        ),
        # The queue service's text for an expiry without a reply (queue/service.py).
        ("delivery time expired", "mx.dest.test", "X-zoneq; delivery time expired"),
    ],
    ids=["remote-reply", "nxdomain", "expired"],
)
def test_only_a_remote_reply_is_labelled_smtp(
    diagnostic: str, remote_mta: str | None, code: str
) -> None:
    notice = notice_for(PLAIN, diagnostic=diagnostic, remote_mta=remote_mta)
    assert notice is not None
    status = list(parsed(notice.body).iter_parts())[1].get_payload()
    assert isinstance(status, list)
    block = status[1]
    assert block["Diagnostic-Code"] == code
    assert (block["Remote-MTA"] is None) == (remote_mta is None)
