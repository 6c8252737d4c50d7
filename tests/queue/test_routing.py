"""Routing: each rule, the order of the kinds, the trusted header, and plugin overrides."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.plugins import write_plugin
from zoneq.config import Config, validate_config
from zoneq.plugin import EnhancedStatus, PluginFailure, PluginHost, Reply
from zoneq.queue.routing import Route, Router

RULES: list[dict[str, Any]] = [
    {"sender_domain": ["news.example"], "zone": "bulk"},
    {"sender_domain": [".shop.example"], "zone": "tx"},
    {"recipient_domain": ["gmail.test"], "zone": "gmail"},
    {"recipient_domain": [".edu.test", "school.test"], "zone": "edu"},
    {"client_network": ["10.0.0.0/8", "2001:db8::/32"], "zone": "internal"},
    # Same kind again, later in the file: only reached when the first one does not match.
    {"recipient_domain": ["gmail.test", "later.test"], "zone": "bulk"},
]
ZONES = ["default", "bounces", "bulk", "tx", "gmail", "edu", "internal"]


def make_config(rules: list[dict[str, Any]] = RULES, **routing: Any) -> Config:
    return validate_config(
        {"zones": {name: {} for name in ZONES}, "routing": {"rules": rules, **routing}}
    )


CONFIG = make_config()
ROUTER = Router.from_config(CONFIG)


@pytest.mark.parametrize(
    ("kwargs", "zone", "rule"),
    [
        # each kind on its own
        ({"sender": "a@news.example"}, "bulk", "sender_domain"),
        ({"sender": "a@mail.shop.example"}, "tx", "sender_domain"),
        ({"sender": "a@shop.example"}, "default", "default"),  # ".x" is below x, not x
        ({"recipient": "b@GMAIL.test."}, "gmail", "recipient_domain"),
        ({"recipient": "b@cs.edu.test"}, "edu", "recipient_domain"),
        ({"recipient": "b@school.test"}, "edu", "recipient_domain"),
        ({"recipient": "b@later.test"}, "bulk", "recipient_domain"),
        ({"client_ip": "10.1.2.3"}, "internal", "client_network"),
        ({"client_ip": "::ffff:10.1.2.3"}, "internal", "client_network"),  # v4-mapped
        ({"client_ip": "2001:db8::1"}, "internal", "client_network"),
        ({"client_ip": "192.0.2.1"}, "default", "default"),
        ({"client_ip": "not an address"}, "default", "default"),
        # precedence: header > sender > recipient > client > default
        (
            {
                "zone_header": "edu",
                "trusted": True,
                "sender": "a@news.example",
                "recipient": "b@gmail.test",
                "client_ip": "10.0.0.1",
            },
            "edu",
            "header",
        ),
        (
            {"sender": "a@news.example", "recipient": "b@gmail.test", "client_ip": "10.0.0.1"},
            "bulk",
            "sender_domain",
        ),
        ({"recipient": "b@gmail.test", "client_ip": "10.0.0.1"}, "gmail", "recipient_domain"),
        ({"recipient": "b@x.test", "client_ip": "10.0.0.1"}, "internal", "client_network"),
        # the null sender and a bare local part have no domain to match
        ({"sender": "", "recipient": "postmaster"}, "default", "default"),
    ],
)
def test_rules_and_their_precedence(kwargs: dict[str, Any], zone: str, rule: str) -> None:
    recipient = kwargs.pop("recipient", "b@elsewhere.test")
    assert ROUTER.decide(recipient, **kwargs) == Route(zone, rule)


@pytest.mark.parametrize(
    ("trusted", "header", "zone"),
    [
        (True, "tx", "tx"),
        (True, "  tx ", "tx"),
        (False, "tx", "gmail"),  # untrusted: the header is ignored, the rules decide
        (True, "no-such-zone", "gmail"),  # unknown zone: falls through to the rules
        (True, None, "gmail"),
    ],
)
def test_zone_header_is_honoured_only_from_trusted_clients(
    trusted: bool, header: str | None, zone: str
) -> None:
    decided = ROUTER.decide("b@gmail.test", trusted=trusted, zone_header=header)
    assert decided.zone == zone


def test_no_rules_sends_everything_to_the_default_zone() -> None:
    config = make_config([], default_zone="tx")
    router = Router.from_config(config)
    decided = router.decide("b@gmail.test", sender="a@news.example", client_ip="10.0.0.1")
    assert decided.zone == "tx"


_LABEL = r"[a-z](?:[a-z0-9-]{0,8}[a-z0-9])?"
_DOMAIN = st.from_regex(rf"{_LABEL}(?:\.{_LABEL}){{0,3}}", fullmatch=True)


@given(_DOMAIN, _DOMAIN)
def test_a_domain_rule_matches_exactly_its_domain_and_a_dot_rule_only_below(
    domain: str, other: str
) -> None:
    config = make_config(
        [
            {"recipient_domain": [domain], "zone": "gmail"},
            {"recipient_domain": ["." + domain], "zone": "edu"},
        ]
    )
    router = Router.from_config(config)
    assert router.decide(f"u@{domain.upper()}").zone == "gmail"
    assert router.decide(f"u@sub.{domain}").zone == "edu"
    expected = "gmail" if other == domain else "edu" if other.endswith("." + domain) else "default"
    assert router.decide(f"u@{other}").zone == expected


@given(st.emails(), st.booleans())
def test_untrusted_header_never_changes_the_decision(address: str, with_header: bool) -> None:
    header = "tx" if with_header else None
    assert ROUTER.decide(address, zone_header=header) == ROUTER.decide(address)


# --- plugin override (queue:route) -----------------------------------------------------------


def router_with_plugin(tmp_path: Path, body: str) -> Router:
    module = write_plugin(
        tmp_path,
        "override",
        f"""
        from zoneq.plugin import Drop, EnhancedStatus, Hook, Reply

        def init(app):
            def handler(args):
                {body}
            app.add_hook(Hook.QUEUE_ROUTE, handler)
        """,
    )
    data = CONFIG.model_dump()
    data["plugins"] = {"override": {"module": str(module), "timeout": "1s"}}
    config = validate_config(data)
    return Router.from_config(config, PluginHost.from_config(config))


def test_plugin_overrides_the_rules_per_recipient(tmp_path: Path) -> None:
    router = router_with_plugin(
        tmp_path, "return 'tx' if args.recipient.startswith('vip@') else None"
    )
    assert asyncio.run(router.route("vip@gmail.test")) == Route("tx", "plugin:override")
    assert asyncio.run(router.route("b@gmail.test")) == Route("gmail", "recipient_domain")


def test_plugin_can_refuse_a_recipient_with_its_own_reply(tmp_path: Path) -> None:
    router = router_with_plugin(
        tmp_path, "return Reply(450, ('Try later',), EnhancedStatus(4, 7, 1))"
    )
    assert asyncio.run(router.route("b@gmail.test")) == Reply(
        450, ("Try later",), EnhancedStatus(4, 7, 1)
    )


def test_plugin_failure_at_route_time_surfaces_as_plugin_failure(tmp_path: Path) -> None:
    router = router_with_plugin(tmp_path, "raise KeyError('x')")
    with pytest.raises(PluginFailure) as info:
        asyncio.run(router.route("b@gmail.test"))
    assert info.value.reply.code == 451
