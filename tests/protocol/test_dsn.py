"""Tests for the RFC 3464 delivery status notification builder.

Every notice is parsed back with the standard ``email`` package and checked field by field,
as a receiving MUA or bounce processor would read it.
"""

from __future__ import annotations

import dataclasses
import email
import email.policy
import re
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta, timezone
from email.message import EmailMessage, Message
from email.utils import parsedate_to_datetime
from typing import Any

import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from zoneq.errors import ProtocolError
from zoneq.protocol import dsn
from zoneq.protocol.dsn import (
    AUTO_SUBMITTED,
    MAX_FIELD_CHARS,
    SUBJECT_DELAYED,
    SUBJECT_DELIVERED,
    SUBJECT_FAILED,
    Action,
    DsnRequest,
    Notify,
    ReportedRecipient,
    Ret,
    build_dsn,
    should_send_dsn,
    utf8_xtext_decode,
    utf8_xtext_encode,
    xtext_decode,
    xtext_encode,
)

ARRIVED = datetime(2024, 5, 1, 9, 30, 0, tzinfo=UTC)
ATTEMPT = datetime(2024, 5, 1, 9, 31, 5, tzinfo=UTC)
NOW = datetime(2024, 5, 1, 9, 31, 6, tzinfo=timezone(timedelta(hours=2)))
RETRY_UNTIL = datetime(2024, 5, 6, 9, 30, 0, tzinfo=UTC)
NAIVE = ARRIVED.replace(tzinfo=None)

ORIGINAL_HEADERS = (
    b"From: Alice <alice@example.org>\r\n"
    b"To: bob@example.com\r\n"
    b"Subject: quarterly figures\r\n"
    b"Message-ID: <orig.1@example.org>\r\n"
)
ORIGINAL_BODY = b"Hello Bob,\r\n\r\nthe figures are attached.\r\n"

PER_MESSAGE_NAMES = {"Original-Envelope-Id", "Reporting-MTA", "Arrival-Date"}
PER_RECIPIENT_NAMES = {
    "Original-Recipient",
    "Final-Recipient",
    "Action",
    "Status",
    "Remote-MTA",
    "Diagnostic-Code",
    "Last-Attempt-Date",
    "Will-Retry-Until",
}
TOP_NAMES = [
    "From",
    "To",
    "Subject",
    "Date",
    "Message-ID",
    "MIME-Version",
    "Auto-Submitted",
    "Content-Type",
]


def rcpt(**overrides: Any) -> ReportedRecipient:
    values: dict[str, Any] = {
        "final_recipient": "bob@example.com",
        "action": Action.FAILED,
        "status": "5.1.1",
        "diagnostic": "550 5.1.1 <bob@example.com>: user unknown",
        "remote_mta": "mx1.example.com",
        "last_attempt": ATTEMPT,
    }
    values.update(overrides)
    return ReportedRecipient(**values)


def request(**overrides: Any) -> DsnRequest:
    values: dict[str, Any] = {
        "reporting_mta": "out1.zoneq.example",
        "envelope_sender": "alice@example.org",
        "ret": Ret.HDRS,
        "arrival_date": ARRIVED,
        "recipients": (rcpt(),),
        "original_headers": ORIGINAL_HEADERS,
        "original_body": ORIGINAL_BODY,
        "postmaster_from": "MAILER-DAEMON@out1.zoneq.example",
        "message_id": "<dsn.42@out1.zoneq.example>",
        "date": NOW,
    }
    values.update(overrides)
    return DsnRequest(**values)


def parse(data: bytes) -> EmailMessage:
    message = email.message_from_bytes(data, policy=email.policy.default)
    assert isinstance(message, EmailMessage)
    return message


def messages(payload: object) -> list[Message]:
    """A multipart or message/* payload as its list of parts (and nothing else)."""
    assert isinstance(payload, list)
    assert all(isinstance(item, Message) for item in payload)
    return [item for item in payload if isinstance(item, Message)]


def parts(message: EmailMessage) -> list[Message]:
    return messages(message.get_payload())


def status_blocks(message: EmailMessage) -> list[Message]:
    status = parts(message)[1]
    assert status.get_content_type() == "message/delivery-status"
    return messages(status.get_payload())


def raw_field(block: Message, name: str) -> str | None:
    """A field's value exactly as written (folds removed), without the email package's
    header parsing (which would, for example, decode RFC 2047 encoded-words)."""
    for key, value in block.raw_items():
        if key.lower() == name.lower():
            return re.sub(r"\r?\n(?=[ \t])", "", str(value))
    return None


def field(block: Message, name: str) -> str:
    value = raw_field(block, name)
    assert value is not None, f"{name} missing from {list(block.keys())}"
    return value


def human_text(message: EmailMessage) -> str:
    text_part = parts(message)[0]
    assert isinstance(text_part, EmailMessage)
    content = text_part.get_content()
    assert isinstance(content, str)
    return content


def lines_of(data: bytes) -> list[bytes]:
    assert data.endswith(b"\r\n")
    return data[:-2].split(b"\r\n")


# ---------------------------------------------------------------------------------------------
# Structure and headers


def test_multipart_report_structure() -> None:
    message = parse(build_dsn(request()))
    assert message.get_content_type() == "multipart/report"
    assert message.get_param("report-type") == "delivery-status"
    assert message["MIME-Version"] == "1.0"
    assert [p.get_content_type() for p in parts(message)] == [
        "text/plain",
        "message/delivery-status",
        "text/rfc822-headers",
    ]
    assert not message.defects
    for part in message.walk():
        assert not part.defects


def test_top_level_headers() -> None:
    message = parse(build_dsn(request()))
    assert list(message.keys()) == TOP_NAMES
    assert message["From"].addresses[0].addr_spec == "MAILER-DAEMON@out1.zoneq.example"
    assert message["From"].addresses[0].display_name == "Mail Delivery System"
    assert message["To"].addresses[0].addr_spec == "alice@example.org"
    assert message["Subject"] == SUBJECT_FAILED
    assert message["Message-ID"] == "<dsn.42@out1.zoneq.example>"
    assert message["Auto-Submitted"] == AUTO_SUBMITTED == "auto-replied"
    assert parsedate_to_datetime(message["Date"]) == NOW


def test_message_id_without_angle_brackets_gets_them() -> None:
    message = parse(build_dsn(request(message_id="dsn.7@host.example")))
    assert message["Message-ID"] == "<dsn.7@host.example>"


def test_envelope_sender_in_angle_brackets_is_unwrapped() -> None:
    message = parse(build_dsn(request(envelope_sender="<alice@example.org>")))
    assert message["To"].addresses[0].addr_spec == "alice@example.org"


@pytest.mark.parametrize(
    ("actions", "subject"),
    [
        ((Action.FAILED,), SUBJECT_FAILED),
        ((Action.DELAYED,), SUBJECT_DELAYED),
        ((Action.DELAYED, Action.FAILED), SUBJECT_FAILED),
        ((Action.DELIVERED,), SUBJECT_DELIVERED),
        ((Action.RELAYED, Action.EXPANDED), SUBJECT_DELIVERED),
        ((Action.DELIVERED, Action.DELAYED), SUBJECT_DELAYED),
    ],
)
def test_subject_follows_the_actions(actions: tuple[Action, ...], subject: str) -> None:
    recipients = tuple(
        rcpt(final_recipient=f"r{i}@example.com", action=action, status="4.4.1")
        for i, action in enumerate(actions)
    )
    assert parse(build_dsn(request(recipients=recipients)))["Subject"] == subject


# ---------------------------------------------------------------------------------------------
# message/delivery-status fields


def test_per_message_fields() -> None:
    per_message = status_blocks(parse(build_dsn(request())))[0]
    assert set(per_message.keys()) == {"Reporting-MTA", "Arrival-Date"}
    assert field(per_message, "Reporting-MTA") == "dns; out1.zoneq.example"
    assert parsedate_to_datetime(field(per_message, "Arrival-Date")) == ARRIVED


def test_original_envelope_id_is_xtext_decoded() -> None:
    per_message = status_blocks(parse(build_dsn(request(envelope_id="QQ314159+2Bx+3Dy"))))[0]
    assert next(iter(per_message)) == "Original-Envelope-Id"
    assert field(per_message, "Original-Envelope-Id") == "QQ314159+x=y"


def test_malformed_envelope_id_is_reported_as_received() -> None:
    per_message = status_blocks(parse(build_dsn(request(envelope_id="abc+zz"))))[0]
    assert field(per_message, "Original-Envelope-Id") == "abc+zz"


def test_per_recipient_fields() -> None:
    blocks = status_blocks(parse(build_dsn(request())))
    assert len(blocks) == 2
    block = blocks[1]
    assert list(block.keys()) == [
        "Final-Recipient",
        "Action",
        "Status",
        "Remote-MTA",
        "Diagnostic-Code",
        "Last-Attempt-Date",
    ]
    assert field(block, "Final-Recipient") == "rfc822; bob@example.com"
    assert field(block, "Action") == "failed"
    assert field(block, "Status") == "5.1.1"
    assert field(block, "Remote-MTA") == "dns; mx1.example.com"
    assert field(block, "Diagnostic-Code") == "smtp; 550 5.1.1 <bob@example.com>: user unknown"
    assert parsedate_to_datetime(field(block, "Last-Attempt-Date")) == ATTEMPT


def test_optional_recipient_fields_are_left_out() -> None:
    bare = rcpt(diagnostic=None, remote_mta=None, last_attempt=None)
    block = status_blocks(parse(build_dsn(request(recipients=(bare,)))))[1]
    assert list(block.keys()) == ["Final-Recipient", "Action", "Status"]


def test_blank_diagnostic_and_remote_are_left_out() -> None:
    blank = rcpt(diagnostic=" \r\n ", remote_mta="\t")
    block = status_blocks(parse(build_dsn(request(recipients=(blank,)))))[1]
    assert "Diagnostic-Code" not in block
    assert "Remote-MTA" not in block


def test_local_diagnostic_type() -> None:
    local = rcpt(diagnostic="DNS lookup failed: no MX", diagnostic_type="X-Zoneq")
    block = status_blocks(parse(build_dsn(request(recipients=(local,)))))[1]
    assert field(block, "Diagnostic-Code") == "X-Zoneq; DNS lookup failed: no MX"


@pytest.mark.parametrize(
    ("orcpt", "expected"),
    [
        ("rfc822;bob@example.com", "rfc822; bob@example.com"),
        ("rfc822;bob+2Bsales@example.com", "rfc822; bob+sales@example.com"),
        ("RFC822; bob@example.com", "RFC822; bob@example.com"),
        ("utf-8;us\\x{E9}r@example.com", "utf-8; us\\x{E9}r@example.com"),
        ("utf-8;usér@example.com", "utf-8; us\\x{E9}r@example.com"),  # unitext form
        ("bob@example.com", "unknown; bob@example.com"),  # no address type
        ("rfc822;b+zz@example.com", "rfc822; b+zz@example.com"),  # not xtext: as received
        ("rfc822;us+C3+A9r@example.com", "utf-8; us\\x{E9}r@example.com"),
    ],
)
def test_original_recipient_from_orcpt(orcpt: str, expected: str) -> None:
    block = status_blocks(parse(build_dsn(request(recipients=(rcpt(original_recipient=orcpt),)))))[
        1
    ]
    assert next(iter(block)) == "Original-Recipient"
    assert field(block, "Original-Recipient") == expected


@pytest.mark.parametrize("orcpt", ["rfc822;", "utf-8;", "  ", ""])
def test_orcpt_without_an_address_is_left_out(orcpt: str) -> None:
    message = parse(build_dsn(request(recipients=(rcpt(original_recipient=orcpt),))))
    assert "Original-Recipient" not in status_blocks(message)[1]
    assert "Originally addressed to" not in human_text(message)


def test_several_recipients_give_several_blocks_in_order() -> None:
    recipients = (
        rcpt(final_recipient="a@example.com", status="5.1.1"),
        rcpt(final_recipient="b@example.net", status="5.2.2", diagnostic="552 mailbox full"),
        rcpt(final_recipient="c@example.org", status="5.7.1", remote_mta=None),
    )
    message = parse(build_dsn(request(recipients=recipients)))
    blocks = status_blocks(message)
    assert len(blocks) == 4
    assert [field(b, "Final-Recipient") for b in blocks[1:]] == [
        "rfc822; a@example.com",
        "rfc822; b@example.net",
        "rfc822; c@example.org",
    ]
    assert [field(b, "Status") for b in blocks[1:]] == ["5.1.1", "5.2.2", "5.7.1"]
    assert "Remote-MTA" not in blocks[3]
    text = human_text(message)
    for address in ("<a@example.com>", "<b@example.net>", "<c@example.org>"):
        assert address in text
    assert "552 mailbox full" in text


def test_delay_notice() -> None:
    delayed = rcpt(
        action=Action.DELAYED,
        status="4.4.1",
        diagnostic="421 4.4.1 try again later",
        will_retry_until=RETRY_UNTIL,
    )
    message = parse(build_dsn(request(recipients=(delayed,))))
    assert message["Subject"] == SUBJECT_DELAYED
    block = status_blocks(message)[1]
    assert field(block, "Action") == "delayed"
    assert field(block, "Status") == "4.4.1"
    assert parsedate_to_datetime(field(block, "Will-Retry-Until")) == RETRY_UNTIL
    assert list(block.keys())[-1] == "Will-Retry-Until"
    text = " ".join(human_text(message).split())
    assert "will be retried until" in text
    assert "do not need to send the message again" in text


def test_failure_text_says_no_retry() -> None:
    text = " ".join(human_text(parse(build_dsn(request()))).split())
    assert "<bob@example.com>: failed" in text
    assert "will not be retried" in text
    assert "550 5.1.1 <bob@example.com>: user unknown" in text


def test_delivery_status_part_is_7bit_ascii() -> None:
    recipients = (
        rcpt(
            final_recipient="usér@exämple.com",
            original_recipient="utf-8;usér@exämple.com",
            diagnostic="550 5.1.1 ユーザー不明",
            remote_mta="mx.bücher.example",
        ),
    )
    data = build_dsn(request(recipients=recipients, envelope_id="caf\u00e9"))
    start = data.index(b"Content-Type: message/delivery-status")
    end = data.index(b"\r\n--=_zoneq_", start)
    assert data[start:end].isascii()
    block = status_blocks(parse(data))[1]
    assert (
        field(block, "Diagnostic-Code")
        == "smtp; 550 5.1.1 \\x{30E6}\\x{30FC}\\x{30B6}\\x{30FC}\\x{4E0D}\\x{660E}"
    )


def test_utf8_recipient() -> None:
    recipients = (rcpt(final_recipient="usér@exämple.com", diagnostic="550 5.1.1 unknown"),)
    message = parse(build_dsn(request(recipients=recipients)))
    block = status_blocks(message)[1]
    value = field(block, "Final-Recipient")
    assert value == "utf-8; us\\x{E9}r@ex\\x{E4}mple.com"
    addr_type, _, address = value.partition("; ")
    assert addr_type == "utf-8"
    assert utf8_xtext_decode(address) == "usér@exämple.com"
    # People get the address as it is written.
    assert "<usér@exämple.com>: failed" in human_text(message)


def test_utf8_envelope_sender_goes_in_to_as_utf8() -> None:
    data = build_dsn(request(envelope_sender="usér@exämple.com"))
    assert "To: usér@exämple.com\r\n".encode() in data
    message = parse(data)
    assert str(message["To"]) == "usér@exämple.com"
    assert status_blocks(message)


# ---------------------------------------------------------------------------------------------
# The returned original


def test_ret_hdrs_returns_headers_only() -> None:
    data = build_dsn(request(ret=Ret.HDRS))
    third = parts(parse(data))[2]
    assert third.get_content_type() == "text/rfc822-headers"
    assert isinstance(third, EmailMessage)
    headers = third.get_content()
    assert headers.replace("\r\n", "\n") == ORIGINAL_HEADERS.decode().replace("\r\n", "\n")
    assert b"the figures are attached" not in data


def test_ret_full_returns_the_whole_message() -> None:
    data = build_dsn(request(ret=Ret.FULL))
    third = parts(parse(data))[2]
    assert third.get_content_type() == "message/rfc822"
    assert third["Content-Transfer-Encoding"] == "7bit"
    assert b"the figures are attached" in data
    inner = messages(third.get_payload())
    original = inner[0]
    assert isinstance(original, EmailMessage)
    assert original["Subject"] == "quarterly figures"
    assert original["Message-ID"] == "<orig.1@example.org>"
    assert (
        original.get_content().replace("\r\n", "\n") == "Hello Bob,\n\nthe figures are attached.\n"
    )
    assert "full text of your message" in " ".join(human_text(parse(data)).split())


def test_ret_full_without_body_returns_headers() -> None:
    # The caller passes no body when the message is over its size cap for returning.
    data = build_dsn(request(ret=Ret.FULL, original_body=None))
    assert parts(parse(data))[2].get_content_type() == "text/rfc822-headers"


def test_ret_full_keeps_8bit_body_octets_for_a_utf8_sender() -> None:
    # Only a notice that needs SMTPUTF8 anyway may be 8-bit (tests/protocol/
    # test_dsn_encoding.py has the ASCII sender's side).
    body = b"caf\xc3\xa9 \xff\xfe raw octets\r\n"
    data = build_dsn(request(ret=Ret.FULL, original_body=body, envelope_sender="jörg@example.org"))
    third = parts(parse(data))[2]
    assert third.get_content_type() == "message/rfc822"
    assert third["Content-Transfer-Encoding"] == "8bit"
    assert body in data


def test_header_block_stops_at_the_first_empty_line() -> None:
    headers = b"Subject: s\nFrom: a@example.org\n\nbody that slipped in\n"
    data = build_dsn(request(ret=Ret.HDRS, original_headers=headers))
    assert b"body that slipped in" not in data
    third = parts(parse(data))[2]
    assert isinstance(third, EmailMessage)
    assert third.get_content().replace("\r\n", "\n") == "Subject: s\nFrom: a@example.org\n"


def test_international_headers_use_rfc6533_types() -> None:
    headers = "Subject: Grüße\r\nFrom: usér@exämple.com\r\n".encode()
    hdrs = parts(parse(build_dsn(request(ret=Ret.HDRS, original_headers=headers))))[2]
    assert hdrs.get_content_type() == "message/global-headers"
    # Raw 8-bit for a UTF-8 sender (RFC 6532 recommends 8bit where the transport allows
    # it); quoted-printable for an ASCII one, in tests/protocol/test_dsn_encoding.py.
    full_data = build_dsn(
        request(ret=Ret.FULL, original_headers=headers, envelope_sender="usér@example.org")
    )
    full = parts(parse(full_data))[2]
    assert full.get_content_type() == "message/global"
    assert full["Content-Transfer-Encoding"] == "8bit"
    assert headers in full_data


def test_no_original_headers_and_no_body_means_two_parts() -> None:
    message = parse(build_dsn(request(ret=Ret.HDRS, original_headers=b"")))
    assert len(parts(message)) == 2


@pytest.mark.parametrize(
    "body",
    [b"binary \x00 octet\r\n", b"x" * 999 + b"\r\n"],
    ids=["nul", "line-over-998"],
)
def test_body_mime_cannot_carry_falls_back_to_headers(body: bytes) -> None:
    # message/rfc822 cannot be encoded (RFC 2046 section 5.2.1), so such a body stays home.
    data = build_dsn(request(ret=Ret.FULL, original_body=body))
    assert parts(parse(data))[2].get_content_type() == "text/rfc822-headers"
    assert body not in data
    assert "header section of your message" in " ".join(human_text(parse(data)).split())


@pytest.mark.parametrize("ret", [Ret.HDRS, Ret.FULL])
def test_headers_mime_cannot_carry_are_not_returned(ret: Ret) -> None:
    data = build_dsn(request(ret=ret, original_headers=b"Subject: \x00\r\n"))
    message = parse(data)
    assert len(parts(message)) == 2
    assert "attached" not in human_text(message)


def test_returned_original_is_byte_for_byte_apart_from_line_ends() -> None:
    # Not parsed and regenerated: odd folding, spacing and MIME survive as they were.
    headers = b"Subject:   spaced\tout  \r\nX-Long: " + b"y" * 200 + b"\r\n  folded\r\n"
    body = b"--b\r\nnot really MIME\r\n"
    data = build_dsn(request(ret=Ret.FULL, original_headers=headers, original_body=body))
    assert headers + b"\r\n" + body in data


# ---------------------------------------------------------------------------------------------
# Line endings, lengths, determinism


def assert_clean_lines(data: bytes) -> None:
    assert b"\n" not in data.replace(b"\r\n", b"")
    assert b"\r" not in data.replace(b"\r\n", b"")
    for line in lines_of(data):
        assert len(line) <= 998


@pytest.mark.parametrize("ret", [Ret.HDRS, Ret.FULL])
def test_crlf_only_even_with_bare_lf_and_cr_in_the_original(ret: Ret) -> None:
    headers = b"Subject: mixed\nFrom: a@example.org\rX-Folded: one\n two\r\n"
    body = b"line one\nline two\rline three\r\n\n"
    data = build_dsn(request(ret=ret, original_headers=headers, original_body=body))
    assert_clean_lines(data)


def test_same_request_same_bytes() -> None:
    assert build_dsn(request()) == build_dsn(request())
    first = parse(build_dsn(request())).get_boundary()
    other = parse(build_dsn(request(message_id="<dsn.43@out1.zoneq.example>"))).get_boundary()
    assert first != other


def test_boundary_found_in_content_is_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    body = (
        b"--=_zoneq_taken\r\nContent-Type: text/plain\r\n\r\nsmuggled part\r\n--=_zoneq_taken--\r\n"
    )

    def fixed(_req: DsnRequest) -> Iterator[str]:
        yield "=_zoneq_taken"
        yield "=_zoneq_free"

    monkeypatch.setattr(dsn, "_boundaries", fixed)
    message = parse(build_dsn(request(ret=Ret.FULL, original_body=body)))
    assert message.get_boundary() == "=_zoneq_free"
    assert len(parts(message)) == 3
    inner = messages(parts(message)[2].get_payload())
    assert "smuggled part" in str(inner[0].get_payload())


def test_long_diagnostic_is_folded_at_whitespace() -> None:
    words = " ".join(f"word{i}" for i in range(60))
    diagnostic = f"550 5.7.1 {words}"
    data = build_dsn(request(recipients=(rcpt(diagnostic=diagnostic),)))
    assert_clean_lines(data)
    start = data.index(b"Diagnostic-Code:")
    end = data.index(b"\r\nLast-Attempt-Date:", start)
    folded = data[start:end].split(b"\r\n")
    assert len(folded) > 1
    assert all(len(line) <= 78 for line in folded)
    assert all(line.startswith(b" ") for line in folded[1:])
    block = status_blocks(parse(data))[1]
    assert field(block, "Diagnostic-Code") == f"smtp; {diagnostic}"


def test_overlong_diagnostic_is_cut_with_a_marker() -> None:
    diagnostic = "550 " + "x" * 2000
    data = build_dsn(request(recipients=(rcpt(diagnostic=diagnostic),)))
    assert_clean_lines(data)
    value = field(status_blocks(parse(data))[1], "Diagnostic-Code")
    assert value.startswith("smtp; 550 xxx")
    assert value.endswith("...")
    assert len(value) == len("smtp; ") + MAX_FIELD_CHARS


def test_overlong_non_ascii_is_cut_between_escapes() -> None:
    data = build_dsn(request(recipients=(rcpt(diagnostic="é" * 500),)))
    value = field(status_blocks(parse(data))[1], "Diagnostic-Code")
    assert value.endswith("\\x{E9}...")
    assert len(value) <= len("smtp; ") + MAX_FIELD_CHARS


# ---------------------------------------------------------------------------------------------
# Hostile input


def test_hostile_remote_reply_cannot_inject_headers_or_blocks() -> None:
    hostile = (
        "550 no such user\r\nX-Injected: yes\r\n\r\nFinal-Recipient: rfc822; evil@example.net"
        "\nAction: delivered\rStatus: 2.0.0\x00\x0b\x0c\u2028\u0085end"
    )
    data = build_dsn(request(recipients=(rcpt(diagnostic=hostile),)))
    assert_clean_lines(data)
    message = parse(data)
    blocks = status_blocks(message)
    assert len(blocks) == 2
    block = blocks[1]
    assert "X-Injected" not in block
    assert block.get_all("Final-Recipient") == ["rfc822; bob@example.com"]
    assert block.get_all("Action") == ["failed"]
    value = field(block, "Diagnostic-Code")
    assert "X-Injected: yes" in value
    assert value.endswith("end")
    assert "X-Injected" not in message
    # Nor in the human-readable part: it stays on the reply's own line.
    text = human_text(message)
    assert not any(line.startswith("X-Injected") for line in text.splitlines())


def test_hostile_envelope_values_cannot_inject_headers() -> None:
    recipients = (
        rcpt(
            final_recipient="bob@example.com\r\nX-Rcpt-Injected: 1",
            original_recipient="rfc822;bob@example.com\r\nX-Orcpt-Injected: 1",
            remote_mta="mx.example.com\r\nX-Mta-Injected: 1",
        ),
    )
    data = build_dsn(
        request(
            envelope_sender="alice@example.org\r\nBcc: victim@example.net",
            envelope_id="id\r\nX-Envid-Injected: 1",
            recipients=recipients,
        )
    )
    assert_clean_lines(data)
    message = parse(data)
    assert list(message.keys()) == TOP_NAMES
    assert "Bcc" not in message
    per_message, block = status_blocks(message)
    assert set(per_message.keys()) <= PER_MESSAGE_NAMES
    assert set(block.keys()) <= PER_RECIPIENT_NAMES
    assert field(block, "Remote-MTA") == "dns; mx.example.comX-Mta-Injected:1"


@given(diagnostic=st.text(alphabet=st.characters(min_codepoint=0x20, max_codepoint=0x7E)))
def test_printable_diagnostic_survives_modulo_folding(diagnostic: str) -> None:
    expected = diagnostic.strip()
    assume(len(expected) <= MAX_FIELD_CHARS)
    recipient = rcpt(diagnostic=diagnostic, diagnostic_type="smtp")
    data = build_dsn(request(recipients=(recipient,)))
    assert_clean_lines(data)
    block = status_blocks(parse(data))[1]
    if expected:
        assert field(block, "Diagnostic-Code") == f"smtp; {expected}"
    else:
        assert "Diagnostic-Code" not in block


outside_values = st.fixed_dictionaries(
    {
        "diagnostic": st.text(),
        "final": st.text(min_size=1),
        "remote": st.text(),
        "orcpt": st.text(),
        "envid": st.text(),
        "sender": st.text(min_size=1),
    }
)


@given(values=outside_values)
def test_any_outside_text_keeps_the_structure(values: dict[str, str]) -> None:
    try:
        recipient = rcpt(
            final_recipient=values["final"],
            diagnostic=values["diagnostic"],
            remote_mta=values["remote"],
            original_recipient=values["orcpt"],
        )
        req = request(
            envelope_sender=values["sender"], envelope_id=values["envid"], recipients=(recipient,)
        )
    except ValueError:
        assume(False)  # nothing printable left of an address: refused up front
        return
    data = build_dsn(req)
    assert_clean_lines(data)
    message = parse(data)
    # RFC 2045 section 6.4: an 8-bit notice (a UTF-8 To:) is labelled so at the top.
    eight_bit = [] if data.isascii() else ["Content-Transfer-Encoding"]
    assert list(message.keys()) == TOP_NAMES + eight_bit
    assert message.get("Content-Transfer-Encoding", "8bit") == "8bit"
    assert [p.get_content_type() for p in parts(message)][:2] == [
        "text/plain",
        "message/delivery-status",
    ]
    per_message, block = status_blocks(message)
    assert set(per_message.keys()) <= PER_MESSAGE_NAMES
    assert set(block.keys()) <= PER_RECIPIENT_NAMES
    assert block.get_all("Action") == ["failed"]
    assert block.get_all("Status") == ["5.1.1"]


@given(headers=st.binary(), body=st.one_of(st.none(), st.binary()), ret=st.sampled_from(Ret))
def test_any_original_keeps_the_structure(headers: bytes, body: bytes | None, ret: Ret) -> None:
    data = build_dsn(request(original_headers=headers, original_body=body, ret=ret))
    assert_clean_lines(data)
    message = parse(data)
    kinds = [p.get_content_type() for p in parts(message)]
    assert kinds[:2] == ["text/plain", "message/delivery-status"]
    assert len(kinds) in (2, 3)
    assert len(status_blocks(message)) == 2


# ---------------------------------------------------------------------------------------------
# Validation of our own values


@pytest.mark.parametrize("sender", ["", "<>", "  ", " <> "])
def test_no_dsn_to_the_null_sender(sender: str) -> None:
    with pytest.raises(ValueError, match="null reverse-path"):
        request(envelope_sender=sender)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"recipients": ()}, "at least one recipient"),
        ({"reporting_mta": "bad host"}, "reporting_mta"),
        ({"reporting_mta": "host\r\nX: y"}, "reporting_mta"),
        ({"reporting_mta": ""}, "reporting_mta"),
        ({"message_id": "no-at-sign"}, "message_id"),
        ({"message_id": "<a@b>\r\nX: y"}, "message_id"),
        ({"message_id": '<a"b@c>'}, "message_id"),
        ({"envelope_sender": "a" * 900 + "@example.org"}, "longer than"),
        ({"postmaster_from": "MAILER-DAEMON"}, "postmaster_from"),
        ({"postmaster_from": "a@b\r\nX: y"}, "postmaster_from"),
        ({"postmaster_from": "x@"}, "postmaster_from"),
        ({"date": NAIVE}, "timezone-aware"),
        ({"arrival_date": NAIVE}, "timezone-aware"),
    ],
)
def test_request_refuses_bad_own_values(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        request(**overrides)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"status": "550"}, "RFC 3463"),
        ({"status": "3.1.1"}, "RFC 3463"),
        ({"status": " 5.1.1"}, "RFC 3463"),
        ({"final_recipient": " <> "}, "final_recipient"),
        ({"diagnostic_type": "smtp; x"}, "diagnostic_type"),
        ({"diagnostic_type": "X" * 65}, "diagnostic_type"),
        ({"last_attempt": NAIVE}, "timezone-aware"),
        ({"will_retry_until": RETRY_UNTIL}, "DELAYED"),  # with the default action FAILED
    ],
)
def test_recipient_refuses_bad_values(overrides: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        rcpt(**overrides)


def test_values_are_frozen() -> None:
    with pytest.raises(dataclasses.FrozenInstanceError):
        rcpt().status = "5.0.0"  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        request().ret = Ret.FULL  # type: ignore[misc]


# ---------------------------------------------------------------------------------------------
# should_send_dsn (RFC 3461 section 4.1)

F, D, S, N = Notify.FAILURE, Notify.DELAY, Notify.SUCCESS, Notify.NEVER


@pytest.mark.parametrize(
    ("sender", "notify", "action", "expected"),
    [
        # Never to the null reverse-path, whatever was asked.
        ("", None, Action.FAILED, False),
        ("<>", None, Action.FAILED, False),
        (" <> ", (F, D, S), Action.FAILED, False),
        ("<>", (D,), Action.DELAYED, False),
        # NOTIFY absent: failures only, no delay notices (our choice), no success reports.
        ("a@example.org", None, Action.FAILED, True),
        ("a@example.org", (), Action.FAILED, True),
        ("a@example.org", None, Action.DELAYED, False),
        ("a@example.org", None, Action.DELIVERED, False),
        ("a@example.org", None, Action.RELAYED, False),
        ("a@example.org", None, Action.EXPANDED, False),
        # NOTIFY=NEVER: nothing, and NEVER wins if (wrongly) combined.
        ("a@example.org", (N,), Action.FAILED, False),
        ("a@example.org", (N,), Action.DELAYED, False),
        ("a@example.org", (N,), Action.DELIVERED, False),
        ("a@example.org", (N, F), Action.FAILED, False),
        # Explicit keywords.
        ("a@example.org", (F,), Action.FAILED, True),
        ("a@example.org", (D,), Action.FAILED, False),
        ("a@example.org", (S,), Action.FAILED, False),
        ("a@example.org", (S, D), Action.FAILED, False),
        ("a@example.org", (D,), Action.DELAYED, True),
        ("a@example.org", (F,), Action.DELAYED, False),
        ("a@example.org", (F, D), Action.DELAYED, True),
        ("a@example.org", (S,), Action.DELIVERED, True),
        ("a@example.org", (F,), Action.DELIVERED, False),
        ("a@example.org", (S,), Action.RELAYED, True),
        ("a@example.org", (S,), Action.EXPANDED, True),
        ("a@example.org", (F, D), Action.EXPANDED, False),
        # Keyword strings as the queue stores them, in any case.
        ("a@example.org", ("FAILURE",), Action.FAILED, True),
        ("a@example.org", ("delay",), Action.DELAYED, True),
        ("a@example.org", ("never",), Action.FAILED, False),
        ("a@example.org", frozenset({"SUCCESS", "FAILURE"}), Action.DELIVERED, True),
    ],
)
def test_should_send_dsn(
    sender: str, notify: tuple[str, ...] | None, action: Action, expected: bool
) -> None:
    assert should_send_dsn(sender, notify, action) is expected


# ---------------------------------------------------------------------------------------------
# xtext (RFC 3461 section 4) and utf-8-addr-xtext (RFC 6533 section 3)


@pytest.mark.parametrize(
    ("plain", "encoded"),
    [
        ("bob@example.com", "bob@example.com"),
        ("a+b=c d", "a+2Bb+3Dc+20d"),
        ("tab\there", "tab+09here"),
        ("é", "+C3+A9"),
        ("", ""),
    ],
)
def test_xtext_examples(plain: str, encoded: str) -> None:
    assert xtext_encode(plain) == encoded
    assert xtext_decode(encoded) == plain


def test_xtext_decode_accepts_lower_case_hex() -> None:
    assert xtext_decode("a+2bb") == "a+b"


@pytest.mark.parametrize("bad", ["a b", "a=b", "+4", "+ZZ", "abc+", "caf\u00e9", "+FF", "\r\n"])
def test_xtext_decode_refuses_non_xtext(bad: str) -> None:
    with pytest.raises(ProtocolError):
        xtext_decode(bad)


@pytest.mark.parametrize(
    ("plain", "encoded"),
    [
        ("bob@example.com", "bob@example.com"),
        ("usér@exämple.com", "us\\x{E9}r@ex\\x{E4}mple.com"),
        ("a+b=c\\d e", "a\\x{2B}b\\x{3D}c\\x{5C}d\\x{20}e"),
        ("\U0001f600@x", "\\x{1F600}@x"),
    ],
)
def test_utf8_xtext_examples(plain: str, encoded: str) -> None:
    assert utf8_xtext_encode(plain) == encoded
    assert utf8_xtext_decode(encoded) == plain


def test_utf8_xtext_decode_accepts_unitext_and_lower_case() -> None:
    assert utf8_xtext_decode("usér@x") == "usér@x"
    assert utf8_xtext_decode("us\\x{e9}r@x") == "usér@x"


@pytest.mark.parametrize(
    "bad", ["a b", "a+b", "a=b", "a\\b", "\\x{}", "\\x{D800}", "\\x{110000}", "\\x{E9", "\r"]
)
def test_utf8_xtext_decode_refuses_bad_input(bad: str) -> None:
    with pytest.raises(ProtocolError):
        utf8_xtext_decode(bad)


@given(st.text())
def test_xtext_round_trip(value: str) -> None:
    encoded = xtext_encode(value)
    assert re.fullmatch(r"(?:[\x21-\x2a\x2c-\x3c\x3e-\x7e]|\+[0-9A-F]{2})*", encoded)
    assert xtext_decode(encoded) == value


@given(st.text())
def test_utf8_xtext_round_trip(value: str) -> None:
    encoded = utf8_xtext_encode(value)
    assert encoded.isascii()
    assert not any(char in encoded for char in " +=\r\n")
    assert utf8_xtext_decode(encoded) == value
