"""Tests for zoneq.protocol.local_parts: a local part in its least quoted spelling.

RFC 5322 section 3.2.4: a quoted-string is "identical to atom, semantically", so
``"bob"`` and ``bob`` are one local part; RFC 5321 section 4.1.2: a sender "SHOULD NOT"
quote one that does not need it.  The properties compare with the standard library's
RFC 5322 parser (``email.headerregistry.Address``): the canonical spelling names the same
mailbox as the one given.
"""

from __future__ import annotations

from email.headerregistry import Address

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zoneq.protocol.local_parts import canonical_address, canonical_local

LOCAL_PARTS = [
    # Left as given: no quotes, or not one whole quoted-string, or a control inside.
    ("bob", "bob"),
    ("Bob.Smith+tag", "Bob.Smith+tag"),
    ("a\\b", "a\\b"),  # a backslash outside quotes is no quoted-pair
    ('"bob', '"bob'),
    ('bob"', 'bob"'),
    ('"a"b"', '"a"b"'),
    ('"a"."b"', '"a"."b"'),  # RFC 5322 obs-local-part: words, not one quoted-string
    ('"a\\"', '"a\\"'),  # the last quote is escaped: the string never closes
    ('"a\x01b"', '"a\x01b"'),
    ('"a\\\x7fb"', '"a\\\x7fb"'),
    # A dot-atom inside: unquoted (RFC 5321 4.1.2 Dot-string), case kept (section 2.4).
    ('"bob"', "bob"),
    ('"Bob"', "Bob"),
    ('"b\\ob"', "bob"),  # a quoted-pair of an ordinary character
    ('"\\b\\o\\b"', "bob"),
    ('"first.last"', "first.last"),
    ('"a+tag"', "a+tag"),
    ('"!#$%&\'*+/=?^_`{|}~-"', "!#$%&'*+/=?^_`{|}~-"),
    ('"ünï"', "ünï"),  # RFC 6531 section 3.3: non-ASCII is atext
    ('"jos\\é"', "josé"),
    # Quotes needed: kept, only '"' and '\' escaped.
    ('"a b"', '"a b"'),
    ('"a\\ b"', '"a b"'),
    ('".bob"', '".bob"'),
    ('"bob."', '"bob."'),
    ('"a..b"', '"a..b"'),
    ('"a@b"', '"a@b"'),
    ('"a\\@b"', '"a@b"'),
    ('"a,b"', '"a,b"'),
    ('"a(b)"', '"a(b)"'),
    ('"a\\"b"', '"a\\"b"'),
    ('"a\\\\b"', '"a\\\\b"'),
    ('""', '""'),
    ('"ü b"', '"ü b"'),
]


@pytest.mark.parametrize(("given_local", "canonical"), LOCAL_PARTS)
def test_canonical_local(given_local: str, canonical: str) -> None:
    assert canonical_local(given_local) == canonical


@pytest.mark.parametrize(
    ("address", "canonical"),
    [
        ('"bob"@example.net', "bob@example.net"),
        ('"bob"@Example.NET', "bob@Example.NET"),  # the domain is the caller's
        ('"a@b"@example.net', '"a@b"@example.net'),  # the last @ splits
        ('"a\\@b"@example.net', '"a@b"@example.net'),
        ("bob@example.net", "bob@example.net"),
        ("Postmaster", "Postmaster"),
        ('"bob"', '"bob"'),  # no @: no local part to speak of
    ],
)
def test_canonical_address(address: str, canonical: str) -> None:
    assert canonical_address(address) == canonical


# Any text near the edges: quotes, backslashes, dots, a space, non-ASCII, a control.
_odd_text = st.text(alphabet='"\\. aB@ü\x01', max_size=14)


@given(_odd_text)
def test_canonical_is_a_fixed_point(local: str) -> None:
    once = canonical_local(local)
    assert canonical_local(once) == once


@given(_odd_text)
def test_canonical_is_never_longer(local: str) -> None:
    # The 64-octet limit (RFC 5321 4.5.3.1.1) is checked on the spelling given.
    assert len(canonical_local(local).encode()) <= len(local.encode())


# A quoted-string built from content (printable ASCII and space: RFC 5321 qtextSMTP and
# the two it leaves out), each character escaped or not; '"' and '\' always escaped.
_content = st.lists(
    st.tuples(st.characters(min_codepoint=32, max_codepoint=126), st.booleans()), max_size=12
)


def quoted(pieces: list[tuple[str, bool]]) -> str:
    return '"' + "".join("\\" + c if escape or c in '"\\' else c for c, escape in pieces) + '"'


@given(_content)
def test_canonical_names_the_same_mailbox(pieces: list[tuple[str, bool]]) -> None:
    """As RFC 5322 reads them (``email.headerregistry``), the spelling given and the
    canonical one have one local part: the content, quoted-pairs undone."""
    local = quoted(pieces)
    canonical = canonical_local(local)
    content = "".join(c for c, _ in pieces)
    given_box = Address(addr_spec=f"{local}@example.net")
    canonical_box = Address(addr_spec=f"{canonical}@example.net")
    assert given_box.username == canonical_box.username == content
    assert canonical_box.domain == "example.net"
    # Least quoted: the only escapes left are the two that must be.
    assert canonical == quoted([(c, False) for c in content]) or canonical == content
