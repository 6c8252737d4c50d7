"""Drops become DROPPED events, and the routing header's zone is re-checked by the
``queue:route`` plugins (issue 5), on the real receiver and a real LevelDB queue.

Plugins are real modules loaded by the real ``PluginHost``: a test plugin written to
``tmp_path`` (its verdict depends on the local part and on the rule) and the bundled
``plugins/suppression.py`` with a list file.  Events are read back from the queue.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
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
from zoneq.protocol.replies import LOCAL_ERROR
from zoneq.queue.consults import CONCURRENCY
from zoneq.receiver import SmtpReceiver
from zoneq.receiver.hooks import ReceiveHooks, Routed
from zoneq.storage.store import QueueStore

RULES: list[dict[str, Any]] = [{"zone": "tx", "recipient_domain": [".tx.test"]}]
# Rules put c.test in bulk, so a routing header naming "default" moves (and re-checks) them.
RULES_TO_BULK: list[dict[str, Any]] = [{"zone": "bulk", "recipient_domain": ["c.test"]}]

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


# --- a chain of queue:route plugins: the drop is counted where the chain had got to ------

MOVER = """
from zoneq.plugin import Hook


def init(app):
    async def route(args):
        # At the re-check only: move "moved-" recipients on from the header's zone.
        if args.rule == "header" and args.recipient.startswith("moved-"):
            return "tx"
        return None

    app.add_hook(Hook.QUEUE_ROUTE, route)
"""


def chain(tmp_path: Path) -> dict[str, Any]:
    """rules_router (b.test to bulk), a mover (at the header re-check, to tx), then the
    suppression list dropping what is listed in the zone the chain reached."""
    listed = tmp_path / "suppressed.json"
    listed.write_text(json.dumps({"bulk": ["sup@b.test"], "tx": ["moved-sup@c.test"]}))
    plugins = {
        "rules_router": {
            "module": str(BUNDLED / "rules_router.py"),
            "options": {"rules": [{"recipient": "*@b.test", "zone": "bulk"}]},
        },
        "mover": {"module": str(write_plugin(tmp_path, "mover", MOVER))},
        "suppression": {
            "module": str(BUNDLED / "suppression.py"),
            "options": {"file": str(listed), "action": "drop"},
        },
    }
    return {"zones": ZONES, "plugins": plugins}


def test_a_drop_at_rcpt_is_counted_in_the_zone_an_earlier_plugin_chose(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        reply = await send(rx.port, "c@d.test", ["sup@b.test", "ok@b.test"])
        assert zones_of(store, reply) == {"ok@b.test": "bulk"}
        events = [(e.recipient, e.zone, e.text) for e in dropped_events(store)]
        assert events == [("sup@b.test", "bulk", "suppressed in zone bulk")]

    run(tmp_path, body, sections=chain(tmp_path))


def test_a_drop_at_the_header_recheck_is_counted_where_the_chain_moved_it(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        header = with_header(b"X-Sending-Zone: default")
        rcpts = ["moved-sup@c.test", "moved-ok@c.test"]
        reply = await send(rx.port, "c@d.test", ["a@c.test", *rcpts], text=header)
        assert zones_of(store, reply) == {"a@c.test": "default", "moved-ok@c.test": "tx"}
        events = [(e.recipient, e.zone, e.text) for e in dropped_events(store)]
        assert events == [("moved-sup@c.test", "tx", "suppressed in zone tx")]

    run(tmp_path, body, sections={**chain(tmp_path), "routing": {"rules": RULES_TO_BULK}})


# --- the re-check asks side by side, under one deadline ------------------------------------

SLOW = """
import asyncio
import json
from pathlib import Path

from zoneq.plugin import Hook

running = 0  # this module's calls in progress: the plugin runs in the receiver's process


def init(app):
    seen = Path(app.options["seen"])

    async def route(args):
        global running
        if args.rule != "header":
            return None
        running += 1
        try:
            with seen.open("a") as out:
                out.write(json.dumps(running) + "\\n")
            await asyncio.sleep(float(app.options["delay"]))  # well under the 1 s limit
        finally:
            running -= 1
        return None

    app.add_hook(Hook.QUEUE_ROUTE, route)
"""


def slow_route(tmp_path: Path, delay: float) -> dict[str, Any]:
    module = write_plugin(tmp_path, "slow_route", SLOW)
    options = {"seen": str(tmp_path / "seen.jsonl"), "delay": delay}
    plugins = {"slow_route": {"module": str(module), "timeout": "1s", "options": options}}
    return {"zones": ZONES, "plugins": plugins}


def test_the_header_recheck_asks_for_several_recipients_at_once(tmp_path: Path) -> None:
    """Through the real receiver: 3 x CONCURRENCY recipients, 0.1 s each, answered at the
    dot with never more than CONCURRENCY calls running at once, and at times that many."""
    rcpts = [f"r{i}@b.test" for i in range(3 * CONCURRENCY)]

    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        reply = await send(rx.port, "c@d.test", rcpts, text=with_header(b"X-Sending-Zone: bulk"))
        assert set(zones_of(store, reply).values()) == {"bulk"}
        running = [json.loads(line) for line in (tmp_path / "seen.jsonl").read_text().split()]
        assert len(running) == len(rcpts)
        assert max(running) == CONCURRENCY

    run(tmp_path, body, sections=slow_route(tmp_path, 0.1))


def test_the_header_recheck_past_its_deadline_is_451_for_the_message(tmp_path: Path) -> None:
    """Each call well inside the plugin's limit, but 12 recipients take longer together
    than the re-check's deadline: 451 4.3.0, nothing queued (the client tries again)."""
    routed = [Routed(ReceivedRecipient(f"r{i}@b.test", "default"), "default") for i in range(12)]

    async def message(deadline_s: float) -> object:
        config = Config.model_validate({**slow_route(tmp_path, 0.2), "server": {"hostname": "mx"}})
        plugins = PluginHost.from_config(config)
        hooks = ReceiveHooks(config, plugins, recheck_deadline_s=deadline_s)
        try:
            return await hooks.message(
                lambda: Session("127.0.0.1", "client.test", None, True),
                sender="c@d.test",
                routed=routed,
                dropped=(),
                fields=[("X-Sending-Zone", "bulk")],
                trusted=True,
            )
        finally:
            await plugins.close()

    async def body() -> None:
        # 12 at 4 at a time: 0.6 s.  A deadline of 0.3 s is passed, one of 10 s is not.
        assert await message(0.3) == LOCAL_ERROR
        moved = [replace(r.recipient, zone="bulk") for r in routed]
        assert await message(10) == (moved, ())

    asyncio.run(asyncio.wait_for(body(), 30))


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
