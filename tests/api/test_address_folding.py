"""Address fields of JSON submissions read back as the mailboxes given, however they fold.

A display name with specials (``,`` ``;`` ``(`` ``"`` ``.``...) is a quoted-string (RFC 5322
3.2.4, 3.4).  The email package of this Python drops its quotes when it folds it (CPython
gh-80222), so ``"Doe, John xxx..." <john@example.com>`` was stored as ``Doe, John`` CRLF
``xxx... <john@example.com>``: the two mailboxes ``Doe`` and ``John xxx... <john@...>``, a
spoofed address list.  Table-driven cases for From, To, Cc and Reply-To, a Hypothesis
property over display names, and one submission stored through the API in a real store.
"""

from __future__ import annotations

import re
from email import message_from_bytes, policy
from email.utils import getaddresses
from typing import Any

import pytest
from hypothesis import HealthCheck, assume, example, given, settings
from hypothesis import strategies as st

from tests.api.conftest import api_running, async_test
from tests.api.test_submit import BASE, source_of
from zoneq.api.mime import build
from zoneq.api.models import Submission
from zoneq.queue.intake import Unacceptable
from zoneq.storage.store import QueueStore

# The JSON key and the field it becomes, each given one mailbox.
FIELDS = {"from": "From", "to": "To", "cc": "Cc", "reply_to": "Reply-To"}
ADDRESS = "john@example.com"


def quoted(name: str) -> str:
    """``name`` as an RFC 5322 quoted-string (3.2.4: ``\\`` and ``"`` as quoted-pairs)."""
    return '"' + name.replace("\\", "\\\\").replace('"', '\\"') + '"'


def submission(key: str, name: str) -> Submission:
    value = f"{quoted(name)} <{ADDRESS}>"
    return Submission.model_validate({**BASE, key: value if key == "from" else [value]})


def read_back(data: bytes, field: str) -> list[tuple[str, str]]:
    """The mailboxes of ``field`` as a reader parses the message (the stdlib's parser)."""
    parsed = message_from_bytes(data, policy=policy.default)
    return [(a.display_name, a.addr_spec) for a in parsed[field].addresses]


def folded_field(data: bytes, field: str) -> bytes:
    head = b"\r\n" + data.split(b"\r\n\r\n", 1)[0]
    start = head.index(b"\r\n" + field.encode() + b":") + 2
    end = head.find(b"\r\n", start)
    while head[end + 2 : end + 3] in (b" ", b"\t"):
        end = head.find(b"\r\n", end + 2)
    return head[start:end]


# The review's leads: each with specials that must stay inside the quotes.
LEADS = ["Doe, John", "ACME (sales)", "a;b", 'O\'Neil, "Jr"', "x.y", "<ceo@bank.test>,"]


@pytest.mark.parametrize("key", list(FIELDS))
@pytest.mark.parametrize("lead", LEADS)
@pytest.mark.parametrize("length", [1, 60, 64, 66, 70, 76, 100, 150])
def test_a_long_display_name_with_specials_reads_back_as_one_mailbox(
    key: str, lead: str, length: int
) -> None:
    name = f"{lead} {'x' * length}"
    data, _ = build(submission(key, name), hostname="mx.test", now_ms=0)
    field = FIELDS[key]
    assert read_back(data, field) == [(name, ADDRESS)], folded_field(data, field)
    # Still folded where it can be (RFC 5322 2.1.1): a longer line is one word.
    lines = folded_field(data, field).split(b"\r\n")
    assert all(len(line) <= 78 or len(line.split()) == 1 for line in lines), lines


def test_the_reviewed_case_keeps_its_quotes() -> None:
    """The review's reproduction: the quotes stay, so the comma is no list separator."""
    name = "Doe, John " + "x" * 70
    data, _ = build(submission("to", name), hostname="mx.test", now_ms=0)
    unfolded = folded_field(data, "To").replace(b"\r\n", b"")
    assert unfolded == f'To: "{name}" <{ADDRESS}>'.encode()


# Words of printable ASCII, specials and quotes weighted up, and long runs that fold.
SPECIALS = '()<>[]:;@\\,."'
WORD = st.one_of(
    st.text(st.sampled_from(SPECIALS + "abcXYZ'-"), min_size=1, max_size=12),
    st.integers(1, 90).map(lambda n: "x" * n),
    st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=20),
)
NAME = st.lists(WORD, min_size=1, max_size=8).map(" ".join)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(name=NAME, key=st.sampled_from(list(FIELDS)))
# Found by a full run: the email package's parser raised TypeError on what it wrote.
@example(name=" ".join([":", "x" * 68, ",", "."]), key="from")
@example(name=" ".join(["x" * 70, ",", "."]), key="from")
@example(name="=?", key="from")  # refused since ed664ac; a full run drew it
def test_every_address_field_reads_back_as_the_mailboxes_given(name: str, key: str) -> None:
    """Property: From, To, Cc and Reply-To, with any ASCII display name, parse back to the
    same display name and addr-spec (single spaces between words: RFC 5322 3.2.2 makes a run
    of white space between words one space)."""
    given_value = f"{quoted(name)} <{ADDRESS}>"
    assume(getaddresses([given_value]) == [(name, ADDRESS)])  # what the API itself reads
    if "=?" in name:  # an encoded-word's opening: refused, naming the key (``_mailbox``)
        with pytest.raises(Unacceptable, match=r"nor its opening '=\?'"):
            build(submission(key, name), hostname="mx.test", now_ms=0)
        return
    data, _ = build(submission(key, name), hostname="mx.test", now_ms=0)
    assert read_back(data, FIELDS[key]) == [(name, ADDRESS)], folded_field(data, FIELDS[key])


NON_ASCII = st.lists(st.one_of(WORD, st.sampled_from(["Müller,", "Zoë", "é" * 30])), max_size=6)


# An encoded-word as a reader finds one (RFC 2047 section 2), whole.
ENCODED_WORD = re.compile(rb"=\?[^?\s]+\?[qQbB]\?[^?\s]*\?=")


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(words=NON_ASCII, key=st.sampled_from(list(FIELDS)))
# Found by a full run: the email package split an encoded-word over a fold, its closing
# ``?=`` encoded into the next word, so the name read back with ``=?utf-8?b?Ojo6Ojo6Og==``.
@example(words=["x" * 62, ":", "::::", ":::::::", ":"], key="from")
def test_a_non_ascii_display_name_never_becomes_other_mailboxes(words: list[str], key: str) -> None:
    """Property: with encoded-words (RFC 2047), the same one mailbox and its name's text,
    every encoded-word whole and within 75 characters (section 2).  (This Python's parser
    puts a space between two adjacent encoded-words of a phrase, which RFC 2047 6.2 says to
    ignore: white space is left out of the comparison.)"""
    name = " ".join(["Zoë", *words])
    given_value = f"{quoted(name)} <{ADDRESS}>"
    assume(getaddresses([given_value]) == [(name, ADDRESS)])
    assume("=?" not in name)  # refused (the property above checks it)
    data, _ = build(submission(key, name), hostname="mx.test", now_ms=0)
    [(got_name, got_address)] = read_back(data, FIELDS[key])
    assert got_address == ADDRESS
    assert "".join(got_name.split()) == "".join(name.split())
    field = folded_field(data, FIELDS[key])
    assert all(len(word) <= 75 for word in ENCODED_WORD.findall(field)), field


# The name the package wrote with a split encoded-word (the example above).
SPLIT_WORD_NAME = " ".join(["Zoë", "x" * 62, ":", "::::", ":::::::", ":"])


@pytest.mark.parametrize("key", list(FIELDS))
def test_a_name_whose_encoded_word_the_package_splits_is_written_whole(key: str) -> None:
    data, _ = build(submission(key, SPLIT_WORD_NAME), hostname="mx.test", now_ms=0)
    field = folded_field(data, FIELDS[key])
    assert b"Ojo6Ojo6Og==\r\n" not in field  # the word the package left unclosed
    [(got_name, got_address)] = read_back(data, FIELDS[key])
    assert ("".join(got_name.split()), got_address) == ("".join(SPLIT_WORD_NAME.split()), ADDRESS)
    assert all(len(word) <= 75 for word in ENCODED_WORD.findall(field)), field
    assert all(len(line) <= 78 for line in field.split(b"\r\n")), field


def test_a_group_in_a_client_address_field_is_written_whole() -> None:
    """A client's own address field (Resent-To, RFC 5322 3.6.6) may hold a group (3.4):
    its name and its members' names written as whole encoded-words too."""
    value = f"Grüppe: {quoted(SPLIT_WORD_NAME)} <{ADDRESS}>, {quoted('Ünd, (x)')} <d@e.test>;"
    sub = Submission.model_validate({**BASE, "headers": {"Resent-To": value}})
    data, _ = build(sub, hostname="mx.test", now_ms=0)
    [group] = message_from_bytes(data, policy=policy.default)["Resent-To"].groups
    assert group.display_name == "Grüppe"
    names = [("".join(a.display_name.split()), a.addr_spec) for a in group.addresses]
    assert names == [("".join(SPLIT_WORD_NAME.split()), ADDRESS), ("Ünd,(x)", "d@e.test")]


@pytest.mark.integration
@async_test
async def test_stored_through_the_api_the_to_field_is_one_mailbox(store: QueueStore) -> None:
    name = "Doe, John " + "x" * 70
    extra: dict[str, Any] = {
        "to": [f"{quoted(name)} <{ADDRESS}>"],
        "cc": [f"{quoted('ACME (sales); ' + 'y' * 66)} <cc@example.com>"],
    }
    async with api_running(store) as api:
        status, body = await api.call("POST", "/api/v1/messages", json={**BASE, **extra})
        assert status == 201, body
        assert sorted(body["recipients"]) == ["cc@example.com", ADDRESS]
        await store.drain()
        stored = source_of(store, body["id"])
    assert read_back(stored, "To") == [(name, ADDRESS)]
    assert read_back(stored, "Cc") == [("ACME (sales); " + "y" * 66, "cc@example.com")]
