"""The bundled rules router compares domains as zoneq's own rules do: a U-label is its
A-label, in the patterns and in the addresses, whatever the case (RFC 5890 section
2.3.2.1; ``zoneq/queue/routing.py``)."""

from __future__ import annotations

import asyncio

import pytest

from tests.support.plugins import BUNDLED, host_with
from zoneq.plugin import Hook, PluginHost, RouteArgs

RULES = [
    {"recipient": "*@bücher.test", "zone": "tx"},
    {"recipient": "*@*.xn--mnchen-3ya.test", "zone": "bulk"},
    {"sender": "news@straße.test", "zone": "bulk"},
    {"recipient": "VIP@*", "zone": "tx"},
    # A wildcard in a non-ASCII label has no A-label, nor has a pattern without "@" a
    # domain to convert: these meet the addresses' U-label form (the 0d98f2f regression).
    {"recipient": "*@bü*.test", "zone": "bulk"},
    {"recipient": "*köln.test", "zone": "tx"},
    {"recipient": "*@*STRÖM.test", "zone": "bulk"},
]


@pytest.fixture(scope="module")
def host() -> PluginHost:
    options = {"rules": RULES}
    return host_with({"rr": {"module": BUNDLED / "rules_router.py", "options": options}})


@pytest.mark.parametrize(
    ("sender", "recipient", "zone"),
    [
        ("a@x.test", "u@bücher.test", "tx"),
        ("a@x.test", "w@xn--bcher-kva.test", "tx"),  # the pattern's U-label, as an A-label
        ("a@x.test", "w@XN--BCHER-KVA.TEST", "tx"),
        ("a@x.test", "u@BÜCHER.test", "tx"),
        ("a@x.test", "u@sub.bücher.test", None),  # the pattern names that domain only
        ("a@x.test", "u@mx.münchen.test", "bulk"),  # the pattern's A-label, as a U-label
        ("a@x.test", "u@mx.xn--mnchen-3ya.test", "bulk"),
        ("news@xn--strae-oqa.test", "u@dst.test", "bulk"),  # senders compare alike
        ("NEWS@Straße.test", "u@dst.test", "bulk"),
        ("a@x.test", "Vip@s.test", "tx"),
        ("a@x.test", "u@buecher.test", None),
        ("", "u@dst.test", None),  # the null reverse-path has no domain
        ("a@x.test", "u@bühne.test", "bulk"),
        ("a@x.test", "u@xn--bhne-0ra.test", "bulk"),
        ("a@x.test", "u@BÜHNE.test", "bulk"),
        ("a@x.test", "u@buhne.test", None),
        ("a@x.test", "u@köln.test", "tx"),
        ("a@x.test", "u@mail.xn--kln-sna.test", "tx"),
        ("a@x.test", "u@koln.test", None),
        ("a@x.test", "u@malström.test", "bulk"),
        ("a@x.test", "u@xn--malstrm-f1a.test", "bulk"),
        ("a@x.test", "u@malstrom.test", None),
    ],
)
def test_domains_match_in_either_form(
    host: PluginHost, sender: str, recipient: str, zone: str | None
) -> None:
    args = RouteArgs(sender, recipient, "default", "default")
    assert asyncio.run(host.call(Hook.QUEUE_ROUTE, args)).zone == zone
