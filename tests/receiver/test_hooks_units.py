"""Pure parts of the receive hooks: which zone the routing header gives, which recipients
it moves, and the header fields the scan hands to ``message:headers``."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.receiver.harness import make_config
from zoneq.ipc.intake_messages import ReceivedRecipient
from zoneq.receiver.hooks import ReceiveHooks, Routed, with_header_zone
from zoneq.receiver.message import scan_headers

HOOKS = ReceiveHooks(make_config({"zones": {"default": {}, "bounces": {}, "bulk": {}}}))


@pytest.mark.parametrize(
    ("fields", "trusted", "zone"),
    [
        ([("X-Sending-Zone", "bulk")], True, "bulk"),
        ([("x-sending-zone", " bulk ")], True, "bulk"),  # names compare case-insensitively
        ([("X-Sending-Zone", "bulk")], False, None),  # untrusted: ignored
        ([("X-Sending-Zone", "nosuch")], True, None),  # undefined zone: the rules decide
        ([("X-Sending-Zone", "bulk"), ("X-Sending-Zone", "default")], True, "bulk"),  # first
        ([("X-Sending-Zones", "bulk"), ("Subject", "bulk")], True, None),
        ([], True, None),
    ],
)
def test_header_zone(fields: list[tuple[str, str]], trusted: bool, zone: str | None) -> None:
    assert HOOKS.header_zone(fields, trusted=trusted) == zone


ROUTED = [
    Routed(ReceivedRecipient("a@b.test", "default"), "default"),
    Routed(ReceivedRecipient("c@d.test", "default"), "recipient_domain"),
    Routed(ReceivedRecipient("v@d.test", "tx"), "plugin:router"),
]


@pytest.mark.parametrize(
    ("zone", "zones"),
    [(None, ["default", "default", "tx"]), ("bulk", ["bulk", "bulk", "tx"])],
)
def test_header_moves_all_but_plugin_choices(zone: str | None, zones: list[str]) -> None:
    moved = with_header_zone(ROUTED, zone)
    assert [r.zone for r in moved] == zones
    assert [r.address for r in moved] == [r.recipient.address for r in ROUTED]


_NAME = st.text(
    st.characters(min_codepoint=0x21, max_codepoint=0x7E, exclude_characters=":"),
    min_size=1,
    max_size=20,
)
_VALUE = st.text(st.characters(min_codepoint=0x21, max_codepoint=0x7E), min_size=1, max_size=40)


@given(st.lists(st.tuples(_NAME, st.lists(_VALUE, min_size=1, max_size=3)), max_size=8))
def test_scan_fields_unfold_in_order(fields: list[tuple[str, list[str]]]) -> None:
    # Each value folded over several lines (RFC 5322 section 2.2.3) comes back unfolded.
    text = b"".join(
        f"{name}: {parts[0]}".encode()
        + b"".join(f"\r\n\t{p}".encode() for p in parts[1:])
        + b"\r\n"
        for name, parts in fields
    )
    scanned = scan_headers(text + b"\r\nbody\r\n").fields()
    assert scanned == tuple((name, " ".join(parts)) for name, parts in fields)
