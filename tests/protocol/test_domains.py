"""The one form of a destination domain: lower-case A-labels (``zoneq.protocol.domains``)."""

from __future__ import annotations

import idna
import pytest
from hypothesis import assume, given
from hypothesis import strategies as st

from zoneq.protocol.domains import a_label, normal_domain
from zoneq.storage.records import recipient_domain

# (as given, normal form)
CASES = [
    ("example.com", "example.com"),
    ("Example.COM", "example.com"),  # RFC 5321 section 2.4: case-insensitive
    ("bücher.example", "xn--bcher-kva.example"),
    ("BÜCHER.Example", "xn--bcher-kva.example"),  # UTS 46 folds case before encoding
    ("xn--bcher-kva.example", "xn--bcher-kva.example"),
    ("XN--BCHER-KVA.example", "xn--bcher-kva.example"),
    ("\uff42ücher\uff0eexample", "xn--bcher-kva.example"),  # full-width b and dot (UTS 46)
    ("münchen。de", "xn--mnchen-3ya.de"),  # an ideographic full stop is a dot
    ("straße.de", "xn--strae-oqa.de"),  # IDNA 2008: not "strasse.de" as IDNA 2003 had it
    ("bücher.example.", "xn--bcher-kva.example."),  # the root dot is left to the caller
    ("[192.0.2.1]", "[192.0.2.1]"),  # an address literal
    ("[IPv6:2001:DB8::1]", "[ipv6:2001:db8::1]"),
    ("☃.net", "☃.net"),  # IDNA 2008 refuses symbols: kept, lower-cased
    ("Ü\u200d.example", "ü\u200d.example"),  # a joiner out of context: refused, lower-cased
    ("", ""),
]


@pytest.mark.parametrize(("given_domain", "expected"), CASES)
def test_normal_domain(given_domain: str, expected: str) -> None:
    assert normal_domain(given_domain) == expected


@pytest.mark.parametrize(
    ("address", "expected"),
    [
        ("bob@bücher.example", "xn--bcher-kva.example"),
        ("bob@xn--bcher-kva.example", "xn--bcher-kva.example"),
        ("Bob@Example.ORG", "example.org"),
        ('"a@b"@Bücher.Example', "xn--bcher-kva.example"),  # the last @ splits
        ("postmaster", ""),
        ("bob@[192.0.2.1]", "[192.0.2.1]"),
    ],
)
def test_recipient_domain_of_an_address(address: str, expected: str) -> None:
    assert recipient_domain(address) == expected


@pytest.mark.parametrize("refused", ["☃.net", "ü..example", "-bü.example", "bü_x.example"])
def test_a_label_refuses_what_idna_refuses_and_normal_domain_keeps_it(refused: str) -> None:
    with pytest.raises(ValueError, match="not a valid domain name"):
        a_label(refused)
    assert normal_domain(refused) == refused.lower()


@given(st.text())
def test_the_normal_form_is_a_fixed_point(domain: str) -> None:
    once = normal_domain(domain)
    assert normal_domain(once) == once


@given(st.text(st.characters(max_codepoint=127)))
def test_ascii_is_only_lower_cased(domain: str) -> None:
    assert normal_domain(domain) == domain.lower()


_U_LABEL = st.text(
    st.characters(categories=["Ll", "Lu", "Lo", "Nd"], exclude_characters="."),
    min_size=1,
    max_size=20,
)


@given(st.lists(_U_LABEL, min_size=1, max_size=4))
def test_a_u_label_and_its_a_label_are_one_domain(labels: list[str]) -> None:
    domain = ".".join(labels)
    try:
        encoded = idna.encode(domain, uts46=True).decode("ascii")
    except idna.IDNAError:
        assume(False)  # not a name: nothing to compare
    assert normal_domain(domain) == normal_domain(encoded) == encoded.lower()
    assert normal_domain(encoded.upper()) == encoded.lower()
