"""Drops become DROPPED events, and the routing header's zone is re-checked by the
``queue:route`` plugins (issue 5), on the real receiver and a real LevelDB queue.

Plugins are real modules loaded by the real ``PluginHost``: a test plugin written to
``tmp_path`` (its verdict depends on the local part and on the rule) and the bundled
``plugins/suppression.py`` with a list file.  Events are read back from the queue.
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from tests.api.test_suppression_serve import REFUSED as SUPPRESSED
from tests.ipc.test_intake_dropped import drop_fields, dropped_events, expected_drop
from tests.receiver.harness import MESSAGE, T0, leftovers, nothing_left, queued_id, run
from tests.receiver.test_hooks import ZONES, data, send, session, with_header, zones_of
from tests.support.plugins import BUNDLED, write_plugin
from zoneq.config.model import Config
from zoneq.ipc.intake_messages import DroppedRecipient, ReceivedRecipient
from zoneq.plugin import PluginHost
from zoneq.plugin.hooks import Session
from zoneq.protocol.ids import format_id
from zoneq.receiver import SmtpReceiver
from zoneq.receiver.hooks import ReceiveHooks, Routed
from zoneq.storage.store import QueueStore

RULES: list[dict[str, Any]] = [{"zone": "tx", "recipient_domain": [".tx.test"]}]

PLUGIN = """
from zoneq.plugin import Drop, EnhancedStatus, Hook, Reply


def init(app):
    async def route(args):
        local = args.recipient.split("@")[0]
        if local == "dropped":
            return Drop("test drop")
        if args.rule != "header":
            return None  # the rest only when the routing header moved the recipient
        if local == "later":
            return Reply(451, ("Greylisted in this zone",), EnhancedStatus(4, 7, 1))
        if local == "raise":
            raise RuntimeError("plugin bug")
        if local == "elsewhere":
            return "tx"
        return None

    app.add_hook(Hook.QUEUE_ROUTE, route)
"""


def drop_plugin(tmp_path: Path) -> dict[str, Any]:
    module = write_plugin(tmp_path, "drops", PLUGIN)
    plugins = {"drops": {"module": str(module), "timeout": "1s"}}
    return {"zones": ZONES, "routing": {"rules": RULES}, "plugins": plugins}


def suppression(tmp_path: Path, action: str) -> dict[str, Any]:
    listed = tmp_path / "suppressed.json"
    listed.write_text(json.dumps({"bulk": ["sup@b.test"]}))
    table = {"module": str(BUNDLED / "suppression.py"), "options": {"file": str(listed)}}
    table["options"]["action"] = action
    return {"zones": ZONES, "plugins": {"suppression": table}}


# --- a drop at RCPT ---------------------------------------------------------------------


def test_a_drop_at_rcpt_is_a_dropped_event_next_to_the_queued_recipients(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        reply = await send(rx.port, "c@d.test", ["dropped@x.tx.test", "a@b.test"])
        msg_id = queued_id(reply)
        assert zones_of(store, reply) == {"a@b.test": "default"}
        [event] = dropped_events(store)
        # The zone the rules gave (".tx.test" -> tx), the message's id, size and age.
        size = store.message(msg_id).size
        assert drop_fields(event) == expected_drop(
            msg_id, "tx", "dropped@x.tx.test", now_ms=T0, size=size, reason="test drop"
        )

    run(tmp_path, body, sections=drop_plugin(tmp_path))


def test_every_recipient_dropped_is_250_events_only_and_no_text_left(tmp_path: Path) -> None:
    big = MESSAGE + (b"y" * 78 + b"\r\n") * 2000  # 160 KB: chunks written before the dot

    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        reply = await send(rx.port, "c@d.test", ["dropped@b.test", "dropped@c.test"], text=big)
        assert reply == "250 2.0.0 Ok: accepted, nothing to deliver"
        events = dropped_events(store)
        assert [(e.recipient, e.zone, e.text) for e in events] == [
            ("dropped@b.test", "default", "test drop"),
            ("dropped@c.test", "default", "test drop"),
        ]
        assert len({e.message_id for e in events}) == 1
        assert events[0].size > len(big)  # our Received field on top
        await store.drain()
        assert leftovers(store) == []  # removed in the commit itself, not by a sweep
        assert store.message_count() == 0

    run(tmp_path, body, sections=drop_plugin(tmp_path))


def test_no_event_without_a_250(tmp_path: Path) -> None:
    """RSET, a refusal at the dot, the client gone: the drops die with the transaction."""

    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        client = await session(rx.port)
        try:
            assert (await client.cmd("MAIL FROM:<c@d.test>")).startswith("250 ")
            assert (await client.cmd("RCPT TO:<dropped@b.test>")).startswith("250 ")
            assert (await client.cmd("RSET")).startswith("250 ")
            # Deferred at the dot by the header re-check (4yz): no 250, no event.
            assert (await client.cmd("MAIL FROM:<c@d.test>")).startswith("250 ")
            assert (await client.cmd("RCPT TO:<dropped@b.test>")).startswith("250 ")
            assert (await client.cmd("RCPT TO:<later@b.test>")).startswith("250 ")
            deferred = await data(client, with_header(b"X-Sending-Zone: bulk"))
            assert deferred == "451 4.7.1 Greylisted in this zone"
            # Gone mid-DATA.
            assert (await client.cmd("MAIL FROM:<c@d.test>")).startswith("250 ")
            assert (await client.cmd("RCPT TO:<dropped@b.test>")).startswith("250 ")
            assert (await client.cmd("DATA")).startswith("354 ")
            await client.send(MESSAGE)
        finally:
            await client.close()
        await nothing_left(store)
        assert dropped_events(store) == []

    run(tmp_path, body, sections=drop_plugin(tmp_path))


# --- the routing header's zone, re-checked ---------------------------------------------


@pytest.mark.parametrize(
    ("action", "text"), [("drop", "suppressed in zone bulk"), ("refuse", SUPPRESSED)]
)
def test_suppressed_in_the_header_zone_is_dropped_with_an_event(
    tmp_path: Path, action: str, text: str
) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        # Without the header the rules give "default", where sup@ is not suppressed.
        plain = await send(rx.port, "c@d.test", ["sup@b.test"])
        assert zones_of(store, plain) == {"sup@b.test": "default"}
        header = with_header(b"X-Sending-Zone: bulk")
        reply = await send(rx.port, "c@d.test", ["sup@b.test", "a@b.test"], text=header)
        assert zones_of(store, reply) == {"a@b.test": "bulk"}
        [event] = dropped_events(store)
        assert (event.recipient, event.zone, event.message_id, event.text) == (
            "sup@b.test",
            "bulk",
            format_id(queued_id(reply)),
            text,
        )

    run(tmp_path, body, sections=suppression(tmp_path, action))


def test_every_recipient_refused_in_the_header_zone_refuses_the_message(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        header = with_header(b"X-Sending-Zone: bulk")
        reply = await send(rx.port, "c@d.test", ["sup@b.test", "SUP@b.test"], text=header)
        assert reply == SUPPRESSED
        await nothing_left(store)
        assert dropped_events(store) == []

    run(tmp_path, body, sections=suppression(tmp_path, "refuse"))


def test_header_recheck_may_move_on_and_a_failing_plugin_is_451(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        header = with_header(b"X-Sending-Zone: bulk")
        # A plugin may move a header-placed recipient on; the others follow the header.
        moved = await send(rx.port, "c@d.test", ["elsewhere@b.test", "a@b.test"], text=header)
        assert zones_of(store, moved) == {"elsewhere@b.test": "tx", "a@b.test": "bulk"}
        # A misbehaving plugin at the re-check: 451 4.3.0 for the message, nothing kept.
        failed = await send(rx.port, "c@d.test", ["raise@b.test", "a@b.test"], text=header)
        assert failed.startswith("451 4.3.0 "), failed
        assert len(store.browse("bulk")[0]) == 1  # the first message's only

    run(tmp_path, body, sections=drop_plugin(tmp_path))


# --- ReceiveHooks.message itself: an untrusted header changes nothing -------------------


def hooks_with_suppression(tmp_path: Path) -> tuple[ReceiveHooks, PluginHost]:
    sections = suppression(tmp_path, "refuse")
    config = Config.model_validate({**sections, "server": {"hostname": "mx.zoneq.test"}})
    plugins = PluginHost.from_config(config)
    return ReceiveHooks(config, plugins), plugins


@pytest.mark.parametrize("trusted", [False, True])
def test_the_header_is_rechecked_only_when_trusted(tmp_path: Path, trusted: bool) -> None:
    async def body() -> None:
        hooks, plugins = hooks_with_suppression(tmp_path)
        kept = (DroppedRecipient("earlier@b.test", "default", "dropped at RCPT"),)
        routed = [
            Routed(ReceivedRecipient("sup@b.test", "default"), "default"),
            Routed(ReceivedRecipient("a@b.test", "default"), "default"),
        ]
        try:
            result = await hooks.message(
                lambda: Session("127.0.0.1", "client.test", None, trusted),
                sender="c@d.test",
                routed=routed,
                dropped=kept,
                fields=[("X-Sending-Zone", "bulk")],
                trusted=trusted,
            )
        finally:
            await plugins.close()
        if not trusted:
            assert result == ([r.recipient for r in routed], kept)
            return
        refused = DroppedRecipient("sup@b.test", "bulk", SUPPRESSED)
        assert result == ([ReceivedRecipient("a@b.test", "bulk")], (*kept, refused))

    asyncio.run(asyncio.wait_for(body(), 30))
