"""Header folding and line lengths of API submissions, as stored in a real store.

- A long ASCII word in a field is never made RFC 2047 encoded-words (section 5: only in
  *text, phrases and comments), so List-Unsubscribe (RFC 2369, RFC 8058), In-Reply-To and
  References reach the recipient as sent; text still folds at 78 where it can and
  non-ASCII is still encoded, in encoded-words of at most 75 characters (RFC 2047 2).
- No stored line is over 998 octets (RFC 5322 section 2.1.1): the JSON field or the raw
  upload's line that would make one is a 400 naming it, and nothing is stored.
"""

from __future__ import annotations

import re
from email import message_from_bytes, policy
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.api.conftest import api_running, async_test
from tests.api.test_mime_headers import fielded
from tests.api.test_submit import BASE, nothing_stored, raw, source_of
from zoneq.api.mime import build
from zoneq.api.models import Submission
from zoneq.queue.intake import Unacceptable
from zoneq.storage.store import QueueStore

pytestmark = pytest.mark.integration

ENCODED_WORD = re.compile(rb"=\?[^?\s]+\?[qQbB]\?[^?\s]*\?=")
WHITE_LINE = re.compile(rb"\r\n[ \t]+\r\n")  # a line of only white space (obs-FWS)
MSG_ID = "<" + "a" * 90 + "@example.org>"
UNSUBSCRIBE = "<https://example.org/u?t=" + "t" * 120 + ">, <mailto:u@example.org?subject=u>"


def header_section(stored: bytes) -> bytes:
    return stored.split(b"\r\n\r\n", 1)[0]


async def stored_message(store: QueueStore, extra: dict[str, Any]) -> bytes:
    async with api_running(store) as api:
        status, body = await api.call("POST", "/api/v1/messages", json={**BASE, **extra})
        assert status == 201, body
        await store.drain()
        return source_of(store, body["id"])


# (JSON fields over BASE, the field, its value as parsed back from the stored message)
KEPT: dict[str, tuple[dict[str, Any], str, str]] = {
    "List-Unsubscribe (RFC 8058 one-click)": (
        {
            "headers": {
                "List-Unsubscribe": UNSUBSCRIBE,
                "List-Unsubscribe-Post": "List-Unsubscribe=One-Click",
            }
        },
        "List-Unsubscribe",
        UNSUBSCRIBE,
    ),
    "In-Reply-To, a 104-character msg-id": (
        {"headers": {"In-Reply-To": MSG_ID}},
        "In-Reply-To",
        MSG_ID,
    ),
    "References, three of them": (
        {"headers": {"References": " ".join([MSG_ID] * 3)}},
        "References",
        " ".join([MSG_ID] * 3),
    ),
    "a 900-octet word": ({"headers": {"X-Token": "k" * 900}}, "X-Token", "k" * 900),
    "a long URL in the subject": (
        {"subject": "see https://example.org/" + "p" * 100 + " now"},
        "Subject",
        "see https://example.org/" + "p" * 100 + " now",
    ),
}


@pytest.mark.parametrize("case", list(KEPT))
@async_test
async def test_a_long_ascii_word_is_not_encoded(store: QueueStore, case: str) -> None:
    extra, name, value = KEPT[case]
    stored = await stored_message(store, extra)
    section = header_section(stored)
    field = re.search(rb"(?m)^" + name.encode() + rb":[^\r]*(?:\r\n[ \t][^\r]*)*", section)
    assert field is not None, section
    assert not ENCODED_WORD.search(field.group()), field.group()
    # Unfolding (RFC 5322 2.2.3) gives back the value as sent.
    assert field.group().replace(b"\r\n", b"") == f"{name}: {value}".encode()
    assert message_from_bytes(stored, policy=policy.default)[name] == value
    assert max(map(len, stored.split(b"\r\n"))) <= 998


@pytest.mark.parametrize(
    ("extra", "name"),
    [
        ({"subject": "Grüße aus München " * 12}, "Subject"),
        ({"from": "Zoë " * 30 + "<a@src.test>"}, "From"),
        ({"subject": "word " * 60}, "Subject"),
        ({"headers": {"X-Note": "note " * 60}}, "X-Note"),
    ],
)
@async_test
async def test_text_still_folds_at_78_and_non_ascii_is_encoded(
    store: QueueStore, extra: dict[str, Any], name: str
) -> None:
    stored = await stored_message(store, extra)
    section = header_section(stored)
    assert section.isascii()
    field = re.search(rb"(?m)^" + name.encode() + rb":[^\r]*(?:\r\n[ \t][^\r]*)*", section)
    assert field is not None
    lines = field.group().split(b"\r\n")
    assert len(lines) > 3 and max(map(len, lines)) <= 78, lines
    words = ENCODED_WORD.findall(field.group())
    assert bool(words) == (not str(extra).isascii())
    assert all(len(word) <= 75 for word in words), words
    # The text is all there (white space aside: the stdlib's parser puts a space between
    # adjacent encoded-words of a display name, which RFC 2047 6.2 says to drop).
    parsed = message_from_bytes(stored, policy=policy.default)
    given = extra.get("subject") or extra.get("from") or extra["headers"][name]
    assert "".join(str(parsed[name]).split()) == "".join(given.split())


LONG = "x" * 2000
TOO_LONG: list[tuple[dict[str, Any], str]] = [
    ({"from": LONG + " <alice@src.test>"}, "from: the From field"),
    ({"from": '"' + "y" * 1200 + '" <alice@src.test>'}, "from: the From field"),
    ({"to": ["z" * 1100 + " <bob@ok.test>"]}, "to: the To field"),
    ({"cc": ["c" * 1100 + " <c@ok.test>"]}, "cc: the Cc field"),
    ({"reply_to": ["r" * 1100 + " <r@ok.test>"]}, "reply_to: the Reply-To field"),
    ({"from": '"' + "a.b," * 300 + '" <alice@src.test>'}, "from: the From field"),
    ({"subject": "s" * 1200}, "subject: the Subject field"),
    ({"headers": {"List-Unsubscribe": "<https://x.test/" + "u" * 1000 + ">"}}, "headers.List-"),
]


@pytest.mark.parametrize(("extra", "needle"), TOO_LONG)
@async_test
async def test_a_field_that_cannot_fold_into_998_is_400_naming_it(
    store: QueueStore, extra: dict[str, Any], needle: str
) -> None:
    async with api_running(store) as api:
        status, body = await api.call("POST", "/api/v1/messages", json={**BASE, **extra})
        assert status == 400, body
        message = body["error"]["message"]
        assert message.startswith(needle), message
        assert "longer than 998 octets (RFC 5322 section 2.1.1)" in message
        await store.drain()
        assert nothing_stored(store)


# --- the property: whatever the fields, every line is within 998 octets, or a 400 -------

WORDS = st.one_of(
    st.integers(1, 1100).map(lambda n: "w" * n),
    st.sampled_from(["a", "Zoë", "é" * 40, "https://x.test/p?q=1", "-", "."]),
    st.integers(1, 400).map(lambda n: "ü" * n),
    st.integers(60, 80).map(lambda n: "v" * n),  # near the fold, where a run of spaces breaks
)
TEXT = st.lists(st.tuples(WORDS, st.sampled_from(["", " ", "  ", " \t", "   "])), max_size=6).map(
    lambda parts: "".join(word + gap for word, gap in parts)
)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    fields=st.fixed_dictionaries(
        {"from": TEXT, "to": TEXT, "reply": TEXT, "subject": TEXT, "x": TEXT, "file": TEXT}
    )
)
def test_no_stored_line_is_over_998_octets(fields: dict[str, str]) -> None:
    """Property: refused, or every line of the message is at most 998 octets, no line is
    only white space (RFC 5322 3.2.2, 4.2: obs-FWS, not to be generated), every
    encoded-word at most 75 characters, and an ASCII value of a field of the client's own
    is written without encoded-words."""
    submission = fielded(fields)
    if submission is None:  # the model's own limits: a 400 before build
        return
    try:
        data, _ = build(submission, hostname="mx.test", now_ms=0)
    except Unacceptable as exc:  # a 400, and only for the line limit with these words
        assert "longer than 998 octets (RFC 5322 section 2.1.1)" in str(exc), exc
        return
    assert max(map(len, data.split(b"\r\n"))) <= 998
    assert WHITE_LINE.search(data) is None, WHITE_LINE.search(data)
    assert all(len(word) <= 75 for word in ENCODED_WORD.findall(data))
    free = re.search(rb"(?m)^X-Free:[^\r]*(?:\r\n[ \t][^\r]*)*", data)
    assert free is not None
    if fields["x"].isascii():
        assert not ENCODED_WORD.search(free.group()), free.group()


# --- the raw upload: a line over 998 octets is refused, naming it --------------------------


@pytest.mark.parametrize(
    ("upload", "line"),
    [
        (b"Subject: a\r\n\r\n" + b"y" * 5000 + b"\r\n", 3),
        (b"Subject: " + b"s" * 5000 + b"\r\n\r\nbody\r\n", 1),
        (b"From: a@src.test\nTo: b@ok.test\n\nok\n" + b"z" * 999 + b"\n", 5),  # bare LF
        (b"Subject: a\r\n\r\n" + (b"q" * 998 + b"\r\n") * 70 + b"q" * 999, 73),  # unended
        (b"Subject: a\r\n\r\n" + b"\xc3\xa9" * 500 + b"\r\n", 3),  # 1000 octets, 500 chars
    ],
)
@pytest.mark.parametrize("piece", [0, 1000], ids=["whole", "in 1000-octet writes"])
@async_test
async def test_a_raw_line_over_998_octets_is_400_naming_it(
    store: QueueStore, upload: bytes, line: int, piece: int
) -> None:
    async def pieces() -> Any:
        for start in range(0, len(upload), piece):
            yield upload[start : start + piece]

    async with api_running(store) as api:
        data: Any = pieces() if piece else upload
        status, body = await raw(api, data, "?from=a@src.test&to=b@ok.test")
        assert status == 400, body
        assert body["error"]["message"].startswith(
            f"line {line} of the message is longer than 998 octets"
        ), body
        await store.drain()
        assert nothing_stored(store)


@async_test
async def test_a_raw_line_of_998_octets_is_stored_as_sent(store: QueueStore) -> None:
    text = b"Subject: " + b"s" * 989 + b"\r\n\r\n" + b"b" * 998 + b"\r\n"
    async with api_running(store) as api:
        status, body = await raw(api, text, "?from=a@src.test&to=b@ok.test")
        assert status == 201, body
        await store.drain()
        assert source_of(store, body["id"]).endswith(text)


def test_a_word_that_fills_a_line_exactly_leaves_no_empty_line() -> None:
    """The email package, folding a display name whose word fills the line, writes an
    empty line (the end of the header section): folded at the spaces instead."""
    name = "w" * 76 + " " + "w" * 76
    data, _ = build(
        Submission.model_validate({**BASE, "reply_to": [f"{name} <r@ok.test>"]}),
        hostname="mx.test",
        now_ms=0,
    )
    parsed = message_from_bytes(data, policy=policy.default)
    assert parsed["Reply-To"].addresses[0].display_name == name
    assert b"\r\n\r\n" not in data.split(b"\r\nMIME-Version:")[0]


# (the JSON fields over BASE, the field): the review's cases, where the email package folded
# a run of white space onto a line of its own; the last one keeps its encoded-words.
WHITE: dict[str, tuple[dict[str, Any], str]] = {
    "subject, two spaces at the fold": ({"subject": "x" * 66 + "  " + "y" * 75}, "Subject"),
    "subject, Re: and two spaces": ({"subject": "Re:  " + "x" * 75 + "  tail"}, "Subject"),
    "a field of the client's, two spaces": (
        {"headers": {"X-Custom": "x" * 75 + "  y"}},
        "X-Custom",
    ),
    "a field of the client's, space and tab": (
        {"headers": {"X-Custom": "x" * 65 + " \t" + "y" * 75}},
        "X-Custom",
    ),
    "non-ASCII, white space at the end": ({"subject": "a " + "ü" * 19 + " \t"}, "Subject"),
}


@pytest.mark.parametrize("case", list(WHITE))
def test_no_header_line_is_only_white_space(case: str) -> None:
    """RFC 5322 3.2.2 and 4.2: a line of only white space is obsolete syntax that must not
    be generated; the field reads back with the same value (unfolding, 2.2.3)."""
    extra, name = WHITE[case]
    data, _ = build(Submission.model_validate({**BASE, **extra}), hostname="mx.test", now_ms=0)
    assert WHITE_LINE.search(data) is None, data.split(b"\r\n\r\n", 1)[0]
    parsed = message_from_bytes(data, policy=policy.default)
    given = extra.get("subject") or extra["headers"][name]
    assert str(parsed[name]).strip() == given.strip()  # the spaces between words kept
