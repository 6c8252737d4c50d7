"""Domains in the config are kept as the queue keys them: lower-case A-labels."""

from __future__ import annotations

import pytest

from zoneq.config import InvalidConfig, loads_config
from zoneq.config.zones import limit_for

ZONES = "[zones.default]\n[zones.bounces]\n[zones.books]\n"
A_LABEL = "xn--bcher-kva.example"


def problems_of(text: str) -> dict[str, str]:
    with pytest.raises(InvalidConfig) as info:
        loads_config(text)
    return {p.key: p.text for p in info.value.problems}


def test_u_labels_in_rules_limits_and_policies_load_as_a_labels() -> None:
    config = loads_config(
        ZONES
        + '[delivery]\ndomain_limits = { "Bücher.Example." = 3, ".münchen.de" = 4 }\n'
        + 'mx_limits = { "MX.Bücher.example" = 5 }\n'
        + 'tls_policy = { "bücher.example" = "required" }\n'
        + '[[routing.rules]]\nrecipient_domain = ["BÜCHER.example", ".münchen.de"]\n'
        + 'zone = "books"\n'
        + '[[routing.rules]]\nsender_domain = ["straße.de"]\nzone = "books"\n'
    )
    delivery = config.delivery
    assert delivery.domain_limits == {A_LABEL: 3, ".xn--mnchen-3ya.de": 4}
    assert delivery.mx_limits == {"mx.xn--bcher-kva.example": 5}
    assert delivery.tls_policy == {A_LABEL: "required"}
    assert config.routing.rules[0].recipient_domain == [A_LABEL, ".xn--mnchen-3ya.de"]
    assert config.routing.rules[1].sender_domain == ["xn--strae-oqa.de"]
    # Either form of a destination finds the setting.
    for name in (A_LABEL, "bücher.example", "BÜCHER.example."):
        assert limit_for(delivery.domain_limits, name) == 3
        assert delivery.tls_for(name) == "required"
    assert limit_for(delivery.domain_limits, "a.münchen.de") == 4


@pytest.mark.parametrize(
    ("text", "key", "problem"),
    [
        (
            '[delivery]\ndomain_limits = { "☃.example" = 3 }\n',
            'delivery.domain_limits."☃.example"',
            "invalid domain '☃.example'",
        ),
        (
            '[delivery]\ndomain_limits = { "bücher.example" = 3, "xn--bcher-kva.example" = 4 }\n',
            'delivery.domain_limits."xn--bcher-kva.example"',
            "names the same domain as 'bücher.example'",
        ),
        (
            '[delivery]\ntls_policy = { "bü..example" = "required" }\n',
            'delivery.tls_policy."bü..example"',
            "invalid domain",
        ),
        (
            '[[routing.rules]]\nrecipient_domain = ["ok.example", "☃.example"]\nzone = "books"\n',
            "routing.rules[0].recipient_domain[1]",
            "invalid domain '☃.example'",
        ),
    ],
)
def test_a_domain_idna_refuses_names_its_key(text: str, key: str, problem: str) -> None:
    problems = problems_of(ZONES + text)
    assert key in problems, problems
    assert problem in problems[key]
