"""Keys of the per-domain tables (``tls_policy``, ``domain_limits``, ``mx_limits``): one
lookup for all of them (``domain_lookup``), and a ``*.`` key refused rather than kept
where nothing would ever match it (a TLS policy that silently never applies)."""

from __future__ import annotations

import pytest

from zoneq.config import loads_config
from zoneq.config.types import domain_lookup
from zoneq.errors import ConfigError

TABLE = {"rcpt.test": "exact", ".rcpt.test": "below", ".deep.rcpt.test": "deeper"}


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("rcpt.test", "exact"),  # the name itself: its own key, not ".rcpt.test"
        ("RCPT.test.", "exact"),  # case and the root's dot do not matter
        ("sub.rcpt.test", "below"),
        ("a.b.rcpt.test", "below"),
        ("x.deep.rcpt.test", "deeper"),  # the closest parent wins
        ("deep.rcpt.test", "below"),  # ".deep.rcpt.test" is only for names below it
        ("otherrcpt.test", None),  # a parent is a whole label, not a suffix
        ("test", None),
    ],
)
def test_lookup_takes_the_exact_name_then_the_closest_dotted_parent(
    name: str, expected: str | None
) -> None:
    assert domain_lookup(TABLE, name) == expected


def config_with_policy(policy: str) -> str:
    return (
        f'[delivery]\ntls = "none"\ntls_policy = {{ {policy} }}\n[zones.default]\n[zones.bounces]\n'
    )


@pytest.mark.parametrize(
    ("policy", "domain", "expected"),
    [
        ('".rcpt.test" = "required"', "sub.rcpt.test", "required"),
        ('".rcpt.test" = "required"', "rcpt.test", "none"),
        (
            '".Rcpt.Test." = "required", "open.rcpt.test" = "opportunistic"',
            "open.rcpt.test",
            "opportunistic",
        ),
        (
            '".rcpt.test" = "required", "open.rcpt.test" = "opportunistic"',
            "x.open.rcpt.test",
            "required",
        ),
        ('".bücher.example" = "required"', "mx.xn--bcher-kva.example", "required"),
    ],
)
def test_tls_policy_applies_a_dotted_key_to_every_name_below_it(
    policy: str, domain: str, expected: str
) -> None:
    config = loads_config(config_with_policy(policy))
    assert config.delivery.tls_for(domain) == expected


@pytest.mark.parametrize(
    ("text", "key"),
    [
        (config_with_policy('"*.rcpt.test" = "required"'), 'delivery.tls_policy."*.rcpt.test"'),
        (
            '[delivery]\ndomain_limits = { "*.rcpt.test" = 2 }\n[zones.default]\n[zones.bounces]\n',
            'delivery.domain_limits."*.rcpt.test"',
        ),
    ],
)
def test_a_star_key_is_refused_naming_the_key_and_the_dotted_form(text: str, key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        loads_config(text)
    assert caught.value.key == key
    assert "'.rcpt.test'" in str(caught.value)
