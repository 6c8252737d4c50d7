"""``zoneq.api.mime.build`` against header injection through RFC 2047 encoded-words, the
email package's exceptions, internationalized addresses and MIME types: table-driven cases
and a Hypothesis property over the message's bytes (every header section of every part)."""

from __future__ import annotations

import base64
import re
from email import message_from_bytes, policy
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from zoneq.api.mime import POLICY, UTF8_POLICY, build
from zoneq.api.models import Submission
from zoneq.queue.intake import Unacceptable

BASE: dict[str, Any] = {
    "from": "Alice <alice@src.test>",
    "to": ["bob@ok.test"],
    "subject": "hello",
    "text": "body text\n",
}
A = base64.b64encode(b"a").decode()
CRLF_FROM = "=?utf-8?q?hi=0D=0AFrom:_ceo@bank.test=0D=0A=0D=0Afake_body?="
RETURN_PATH_B64 = "=?utf-8?b?eA0KUmV0dXJuLVBhdGg6IDxldmlsQHgudGVzdD4=?="  # x CRLF Return-Path:...
LF_ONLY = "=?utf-8?q?x=0AX-Inj:_1?="


def built(extra: dict[str, Any]) -> bytes:
    return build(Submission.model_validate({**BASE, **extra}), hostname="mx.test", now_ms=0)[0]


def refused(extra: dict[str, Any]) -> str:
    with pytest.raises(Unacceptable) as caught:
        built(extra)
    return str(caught.value)


# An encoded-word that decodes to a line break, in every field that becomes a header, each
# refused before the message is built and named by its JSON field.
@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        ({"subject": CRLF_FROM}, "subject: an encoded-word"),
        ({"subject": LF_ONLY}, "subject: an encoded-word"),
        ({"subject": "=?utf-8?q?x=0DX-Inj:_1?="}, "subject: an encoded-word"),  # bare CR
        ({"subject": "a =?utf-8?q?x=0D=0AX:_y?= b"}, "subject: an encoded-word"),  # mid-text
        ({"subject": "=?utf-8?q?x =0D=0AX: y?="}, "subject: an encoded-word"),  # spaces inside
        ({"subject": "=?bogus?q?x=0D=0AX:_y?="}, "subject: an encoded-word"),  # unknown charset
        ({"subject": "=?cp500?q?x=25X:_y?="}, "subject: an encoded-word"),  # EBCDIC LF is 0x25
        ({"subject": "=?utf-8?q?x=C2=85X:_y?="}, "subject: an encoded-word"),  # NEL
        ({"subject": "=?utf-8?q?x=E2=80=A8X:_y?="}, "subject: an encoded-word"),  # U+2028
        ({"subject": "=?utf-8?q?x=00y?="}, "subject: an encoded-word"),
        ({"subject": "=?utf-8?q?x=1B[2J?="}, "subject: an encoded-word"),  # ESC
        ({"headers": {"X-A": RETURN_PATH_B64}}, "headers.X-A: an encoded-word"),
        (
            {"attachments": [{"filename": "=?utf-8?q?a=0D=0AX-Inj:_1?=", "content": A}]},
            "attachments[0].filename: an encoded-word",
        ),
        ({"from": "=?utf-8?q?A=0D=0ABcc:_e@x.test?= <a@src.test>"}, "from: an encoded-word"),
        ({"to": ["=?utf-8?q?B=0D=0AX-Inj:_1?= <bob@ok.test>"]}, "to[0]: an encoded-word"),
        ({"reply_to": ["=?utf-8?q?B=0AX:_1?= <r@ok.test>"]}, "reply_to[0]: an encoded-word"),
    ],
)
def test_an_encoded_line_break_is_refused_naming_the_field(
    extra: dict[str, Any], needle: str
) -> None:
    assert needle in refused(extra)


@pytest.mark.parametrize(
    ("extra", "needle"),
    [
        # Benign encoded-words in an address come out garbled (getaddresses splits at a colon
        # inside one): refused, the name is sent as Unicode text instead.
        ({"to": ["=?utf-8?q?Team:_A?= <a@ok.test>"]}, "to[0]: no encoded-word"),
        ({"cc": ['"=?utf-8?q?Bob?=" <b@ok.test>']}, "cc[0]: no encoded-word"),
        ({"from": "=?utf-8?q?Al?= <a@src.test>"}, "from: no encoded-word"),
        # Control characters as sent, C1 and the Unicode line separators included.
        ({"subject": "hi\u2028Bcc: e@x.test"}, "subject: control character"),
        ({"subject": "hi\x85Bcc: e@x.test"}, "subject: control character"),
        ({"from": "Al\u2028ice <a@src.test>"}, "from: control character"),
        ({"headers": {"X-A": "a\x1b[2Jb"}}, "headers.X-A: control character"),
        # The email package's HeaderParseError (a MessageError, not a ValueError) was a 500:
        # UTS 46 maps U+3002 to a dot, so this domain's A-label ends in an empty label, which
        # the address check now refuses first, as the SMTP receiver does.
        ({"to": ["bob@bücher.test\u3002"]}, "to[0] 'bob@bücher.test\u3002': empty domain label"),
        ({"to": ["bob@a\u200db.test"]}, "is not a valid domain name (IDNA)"),
        ({"to": ["jo..sé@ok.test"]}, "to[0]: 'jo..sé@ok.test' is not an address"),
        # A UTF-8 local part only in a header: the message would not get SMTPUTF8.
        ({"reply_to": ["josé@ok.test"]}, "reply_to[0]: a non-ASCII local part needs SMTPUTF8"),
        (
            {"from": "josé@src.test", "envelope_from": "a@src.test"},
            "from: a non-ASCII local part needs SMTPUTF8",
        ),
        # RFC 2045 6.4, RFC 2046 5.2.1: these may not be base64.
        *(
            (
                {"attachments": [{"filename": "a", "content_type": t, "content": A}]},
                "attachments[0].content_type: ",
            )
            for t in ("multipart/mixed", "Multipart/Alternative", "message/rfc822", "message/x")
        ),
    ],
)
def test_bad_input_is_refused_naming_the_field(extra: dict[str, Any], needle: str) -> None:
    assert needle in refused(extra)


def test_encoded_words_that_decode_to_text_still_pass() -> None:
    """The check refuses control characters, not encoded-words: a client that sends one
    already encoded gets it decoded and written again."""
    data = built({"subject": "=?utf-8?q?Gr=C3=BC=C3=9Fe?=", "headers": {"X-A": "=?utf-8?b?w6k=?="}})
    parsed = message_from_bytes(data, policy=policy.default)
    assert (parsed["Subject"], parsed["X-A"]) == ("Grüße", "é")


@pytest.mark.parametrize(
    ("name", "value"),
    [
        ("Subject", CRLF_FROM),
        ("Subject", LF_ONLY),
        ("X-A", RETURN_PATH_B64),
        ("Content-Disposition", 'attachment; filename="=?utf-8?q?a=0D=0AX-Inj:_1?="'),
        # A CR followed by a space: CPython's own rule lets it through, a bare CR all the same.
        ("Content-Disposition", 'attachment; filename="=?utf-8?q?=0D_?="'),
        ("X-A", "=?utf-8?q?a=0A_b?="),
    ],
)
@pytest.mark.parametrize("checked", [POLICY, UTF8_POLICY], ids=["ascii", "utf8"])
def test_every_written_field_is_checked_for_line_breaks(
    checked: Any, name: str, value: str
) -> None:
    """The second line of defence alone: what the email package writes for these (CPython
    before 3.11.10 writes a real line break) is refused, whatever let it through."""
    with pytest.raises(Unacceptable, match=f"header field '{name}': would hold a line break"):
        checked.fold_binary(*checked.header_store_parse(name, value))


@pytest.mark.parametrize(
    ("to", "field", "envelope"),
    [
        # RFC 2047 section 5: no encoded-word in an addr-spec; an A-label instead (UTS 46
        # maps the upper case and the full-width stop); so does the envelope, where an
        # ASCII local part needs no SMTPUTF8 (RFC 6531).
        ("bob@bücher.test", b"To: bob@xn--bcher-kva.test\r\n", "bob@xn--bcher-kva.test"),
        ("Bob <bob@BÜCHER\uff0etest>", b"To: Bob <bob@xn--bcher-kva.test>\r\n", None),
        ("Zoë <z@ok.test>", b"To: =?utf-8?q?Zo=C3=AB?= <z@ok.test>\r\n", "z@ok.test"),
    ],
)
def test_idna_domains_are_written_as_a_labels(to: str, field: bytes, envelope: str | None) -> None:
    data, env = build(Submission.model_validate({**BASE, "to": [to]}), hostname="mx.test", now_ms=0)
    assert field in data and b"=?" not in data.split(b"To: ", 1)[1].split(b"<")[-1]
    if envelope is not None:
        assert env.recipients == (envelope,)


def test_a_utf8_local_part_is_written_as_utf8_with_an_envelope_that_gets_smtputf8() -> None:
    """RFC 6532: the local part has no ASCII form; the intake flags the message SMTPUTF8
    for its non-ASCII envelope address, so the header is written in UTF-8 (domain as an
    A-label, other fields too)."""
    data, env = build(
        Submission.model_validate(
            {**BASE, "to": ["José <josé@bücher.test>"], "reply_to": ["rené@ok.test"]}
        ),
        hostname="mx.test",
        now_ms=0,
    )
    assert "To: José <josé@xn--bcher-kva.test>\r\n".encode() in data
    assert "Reply-To: rené@ok.test\r\n".encode() in data
    assert env.recipients == ("josé@bücher.test",)


# --- the property: no JSON input adds a line to any header section -------------------------

TOP: frozenset[str] = frozenset(
    {"from", "to", "reply-to", "subject", "date", "message-id", "x-free", "mime-version",
     "content-type", "content-transfer-encoding"}
)  # fmt: skip
PART: frozenset[str] = frozenset(
    {"content-type", "content-transfer-encoding", "content-disposition", "mime-version"}
)
FIELD_LINE = re.compile(rb"([!-9;-~]+):.*|[ \t].*", re.DOTALL)
PIECES = st.sampled_from(
    [*'aZ@<>"(),.:;\\[]= ?_-\t', "\u00e9", "=?utf-8?q?",
     "=?utf-8?b?", "=?x?q?", "?=", "=0D", "=0A", "=0D=0A", "DQo", "Cg", "=E2=80=A8",
     "From:_", "Bcc: ", "@ok.test", "x@y.test", "b\u00fccher"]
)  # fmt: skip
RAW = st.lists(
    st.sampled_from(["x", " ", ":", "\r", "\n", "\r\n", "Bcc: e@x.test", "\u2028"]), max_size=6
)
Q_WORD = st.lists(
    st.sampled_from(["=0D", "=0A", "=0D=0A", "_", "x", "From:_", "=C2=85"]), max_size=6
).map(lambda parts: "=?utf-8?q?" + "".join(parts) + "?=")
B_WORD = RAW.map(
    lambda parts: "=?utf-8?b?" + base64.b64encode("".join(parts).encode()).decode() + "?="
)
# Raw control characters left out: refused as sent, they would only hide the rest.
TEXT = st.lists(st.one_of(PIECES, Q_WORD, B_WORD), max_size=5).map("".join)
# Display names mostly plain: an encoded-word in an address refuses the whole submission.
NAME = st.one_of(st.sampled_from(["", "Bob", "Zoë", "Bob Smith"]), TEXT)


def header_sections(data: bytes) -> list[tuple[bool, bytes]]:
    """(top level?, header section) of the message and of each MIME part, from the bytes
    as stored: the section ends at the first empty line after the start or a boundary."""
    sections = [(True, data.split(b"\r\n\r\n", 1)[0])]
    for boundary in re.findall(rb'boundary="([^"]+)"', data):
        for part in data.split(b"\r\n--" + boundary + b"\r\n")[1:]:
            sections.append((False, part.split(b"\r\n\r\n", 1)[0]))
    return sections


def fielded(text: dict[str, str]) -> Submission | None:
    """BASE with ``text`` in every field that becomes a header field (keys from, to, reply,
    subject, x for X-Free, file for an attachment's name); None where the model refuses."""
    try:
        return Submission.model_validate(
            {
                **BASE,
                "from": f"{text['from']} <a@src.test>",
                "to": [f"{text['to']} <b@ok.test>"],
                "reply_to": [f"{text['reply']} <r@ok.test>"],
                "subject": text["subject"],
                "headers": {"X-Free": text["x"]},
                "attachments": [{"filename": text["file"] or "f", "content": A}],
            }
        )
    except ValidationError:
        return None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    text=st.fixed_dictionaries(
        {"from": NAME, "to": NAME, "reply": NAME, "subject": TEXT, "x": TEXT, "file": TEXT}
    )
)
def test_no_json_input_adds_a_line_to_a_header_section(text: dict[str, str]) -> None:
    """Property: whatever the text of the fields that become header fields, the input is
    refused, or every header section (top level and each part) holds only lines that start
    a field we write or continue one (start with a space or a tab): no injected field, no
    early end of a section, no bare CR or LF."""
    submission = fielded(text)
    if submission is None:  # the model's own limits: a 400 before build
        return
    try:
        data, envelope = build(submission, hostname="mx.test", now_ms=0)
    except Unacceptable:
        return
    assert envelope.recipients == ("b@ok.test",)
    sections = header_sections(data)
    assert len(sections) == 3  # the top level, the text part, the attachment
    for top, section in sections:
        names = []
        for line in section.split(b"\r\n"):
            assert b"\r" not in line and b"\n" not in line, line
            match = FIELD_LINE.fullmatch(line)
            assert match is not None, line
            if match.group(1):
                names.append(match.group(1).decode().lower())
        assert set(names) <= (TOP if top else PART), names
        assert len(names) == len(set(names)), names  # no field twice (a second From)
