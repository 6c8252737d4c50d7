"""The bundled suppression list refuses every spelling of a listed mailbox.

With ``eve@everywhere.test`` suppressed, ``"eve"@everywhere.test``, ``"Eve"@Everywhere.test``
and ``eve@everywhere.test.`` used to get 250 and be delivered: the quotes and the root's
dot made a string the list did not hold, for the same mailbox (RFC 5322 section 3.2.4,
RFC 5321 section 4.1.2).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import ModuleType

import pytest
from hypothesis import example, given
from hypothesis import strategies as st

from tests.receiver.harness import Raw, run
from tests.support.plugins import BUNDLED, ZONES, host_with
from zoneq.config.plugins import PluginConfig, import_plugin
from zoneq.plugin import Hook, RouteArgs
from zoneq.protocol import domains
from zoneq.receiver import SmtpReceiver
from zoneq.storage.store import QueueStore

LISTED = "eve@everywhere.test"
SPELLINGS = ['"eve"@everywhere.test', '"Eve"@Everywhere.test', "eve@everywhere.test.", LISTED]
REFUSED = "550 5.1.1 Recipient is on the suppression list"
EMPTY_LABEL = f"501 5.1.3 Bad address syntax: {domains.EMPTY_LABEL}"


@pytest.fixture(scope="module")
def plugin() -> ModuleType:
    """The bundled module, imported the way zoneq imports it."""
    return import_plugin("suppression", PluginConfig(module=str(BUNDLED / "suppression.py")))


@pytest.mark.parametrize(
    ("address", "stored"),
    [
        ('"eve"@everywhere.test', "eve@everywhere.test"),  # quotes it does not need
        ('"Eve"@Everywhere.test', "eve@everywhere.test"),
        ('"e\\ve"@x.test', "eve@x.test"),  # a quoted-pair of an ordinary character
        ('"first.last"@x.test', "first.last@x.test"),
        ('"a+tag"@x.test', "a+tag@x.test"),
        ('"ünï"@x.test', "ünï@x.test"),  # RFC 6531 atext
        ("eve@everywhere.test.", "eve@everywhere.test"),  # the root's dot
        ('"Eve"@Bücher.Example.', "eve@xn--bcher-kva.example"),
        ("x@bücher.test..", "x@xn--bcher-kva.test"),  # not kept a U-label: IDNA refused it
        ("x@bücher.test\u3002", "x@xn--bcher-kva.test"),  # a full stop UTS 46 maps to "."
        ("x@ü..", "x@xn--tda"),
        # Quotes it needs stay, in one spelling: only '"' and '\' escaped.
        ('"a b"@x.test', '"a b"@x.test'),
        ('"a\\ b"@x.test', '"a b"@x.test'),
        ('"a..b"@x.test', '"a..b"@x.test'),  # not a dot-atom: a different local part
        ('".eve"@x.test', '".eve"@x.test'),
        ('"a\\"b"@x.test', '"a\\"b"@x.test'),
        ('"a@b"@x.test', '"a@b"@x.test'),
        ('""@x.test', '""@x.test'),
        ('"eve@x.test', '"eve@x.test'),  # one quote is no quoted-string: left alone
        ("postmaster", "postmaster"),
    ],
)
def test_normalize_spellings(plugin: ModuleType, address: str, stored: str) -> None:
    assert plugin.normalize(address) == stored


@given(st.text(alphabet='"\\. aEb@ü', max_size=12))
@example("@ü..")  # once kept a U-label (IDNA refused the empty label), then encoded
@example("x@bücher.test...")
def test_normalize_is_a_fixed_point(plugin: ModuleType, address: str) -> None:
    # The list holds normalized addresses and compares normalized recipients with them.
    once = plugin.normalize(address)
    assert plugin.normalize(once) == once


def test_a_snapshot_line_with_a_doubled_root_dot_is_matched(
    plugin: ModuleType, tmp_path: Path
) -> None:
    """An operator's line ``x@bücher.test..`` suppresses the mailbox in both spellings (it
    was once stored as a U-label, which no normalized recipient ever is)."""
    path = tmp_path / "suppressed.json"
    path.write_text(json.dumps({"*": ["x@bücher.test.."]}), encoding="utf-8")
    listed = plugin.SuppressionList(path)
    assert listed.suppressed("bulk", "x@bücher.test")
    assert listed.suppressed("bulk", "x@xn--bcher-kva.test")


def suppression_plugins(tmp_path: Path) -> dict[str, dict[str, object]]:
    path = tmp_path / "suppressed.json"
    path.write_text(json.dumps({"*": [LISTED]}))
    module = str(BUNDLED / "suppression.py")
    return {"suppression": {"module": module, "options": {"file": str(path)}}}


@pytest.mark.parametrize("recipient", SPELLINGS)
def test_the_route_hook_refuses_every_spelling(tmp_path: Path, recipient: str) -> None:
    host = host_with(suppression_plugins(tmp_path))
    args = RouteArgs("a@src.test", recipient, "default", "default")
    result = asyncio.run(host.call(Hook.QUEUE_ROUTE, args))
    assert str(result.reply) == REFUSED


def test_the_receiver_refuses_every_spelling_at_rcpt(tmp_path: Path) -> None:
    sections = {"zones": ZONES, "plugins": suppression_plugins(tmp_path)}

    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        client = await Raw.connect(rx.port)
        assert (await client.reply()).startswith("220 ")
        assert (await client.cmd("EHLO client.test")).startswith("250")
        assert (await client.cmd("MAIL FROM:<c@d.test>")).startswith("250 ")
        for recipient in SPELLINGS:
            # The root's dot never reaches the plugin: the receiver refuses it as syntax
            # (RFC 5321 section 4.1.2), a refusal all the same.
            refused = EMPTY_LABEL if recipient.endswith(".") else REFUSED
            assert (await client.cmd(f"RCPT TO:<{recipient}>")) == refused, recipient
        assert (await client.cmd("RCPT TO:<adam@everywhere.test>")).startswith("250 ")
        await client.close()

    run(tmp_path, body, sections=sections, allow_networks=["127.0.0.1/32"])
