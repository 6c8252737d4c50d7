"""Plugin hooks at send time and after each outcome, with the real worker and core.

The core and the worker run in this process (``inproc.py``), each with its own plugin host
as in ``zoneq serve``; the sink is Postfix's smtp-sink, which dumps what it received.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import dkim
import pytest

from tests.delivery.inproc import InProc, config_for, dns_for, running
from tests.plugin.test_bundled import rsa_key
from tests.queue.test_service import dsn_of
from tests.support.plugins import BUNDLED, write_plugin
from tests.support.smtpsink import SinkMessage, run_smtp_sink
from zoneq.plugin import PluginHost
from zoneq.storage.records import State

pytestmark = pytest.mark.integration
__all__ = ["rsa_key"]  # the fixture, imported for pytest

RAISES = """
    from zoneq.plugin import Hook

    def init(app):
        def broken(args):
            raise RuntimeError("signing service down")
        app.add_hook(Hook.SENDER_HEADERS, broken)
"""

VETO = """
    from zoneq.plugin import EnhancedStatus, Hook, Reply

    def init(app):
        def connect(args):
            if args.domain == "veto.test":
                return Reply(451, ("not now",), EnhancedStatus(4, 7, 0))
            if args.domain == "refuse.test":
                return Reply(550, ("not to this one",), EnhancedStatus(5, 7, 1))
            return None
        app.add_hook(Hook.SENDER_CONNECT, connect)
"""

RECORDER = """
    import json
    from zoneq.plugin import Hook

    def init(app):
        path = app.options["path"]
        def record(hook):
            def write(args):
                reply = args.reply
                line = {"hook": str(hook), "recipient": args.recipient, "zone": args.zone,
                        "sender": args.sender, "attempts": args.attempts,
                        "code": reply.code if reply else None, "message_id": args.message_id}
                with open(path, "a") as out:
                    out.write(json.dumps(line) + "\\n")
            return write
        for hook in (Hook.DELIVERED, Hook.DEFERRED, Hook.BOUNCED):
            app.add_hook(hook, record(hook))
"""


def plugin_table(module: Path, **options: Any) -> dict[str, Any]:
    return {"module": str(module), "options": options}


def with_send_plugin(
    tmp_path: Path, source: str, domains: list[str], main: Callable[[InProc], Awaitable[None]]
) -> list[SinkMessage]:
    """Run ``main`` against the in-process core and a worker with the plugin ``source``
    loaded, the ``domains`` pointed at a sink; what the sink got, waited for briefly."""
    module = write_plugin(tmp_path, "plugin", source)
    with run_smtp_sink() as sink, dns_for(tmp_path, domains, sink.host) as dns:
        config = config_for(tmp_path, dns, sink.port, plugins={"plugin": plugin_table(module)})

        async def run() -> None:
            async with running(config, worker_plugins=PluginHost.from_config(config)) as core:
                await main(core)

        asyncio.run(run())
        return sink.messages(1, timeout=0.5)


def test_dkim_signed_at_send_time_verifies_at_the_sink_without_the_zone_header(
    tmp_path: Path, rsa_key: tuple[bytes, bytes]
) -> None:
    private, txt = rsa_key
    key_file = tmp_path / "dkim.pem"
    key_file.write_bytes(private)
    dkim_options = {"domains": {"shop.example": {"selector": "s1", "key_file": str(key_file)}}}
    recorder = write_plugin(tmp_path, "recorder", RECORDER)
    events = tmp_path / "outcomes.jsonl"
    with run_smtp_sink() as sink, dns_for(tmp_path, ["ok.test"], sink.host) as dns:
        config = config_for(
            tmp_path,
            dns,
            sink.port,
            plugins={
                "dkim": plugin_table(BUNDLED / "dkim.py", **dkim_options),
                "recorder": plugin_table(recorder, path=str(events)),
            },
        )

        async def main() -> int:
            # Two hosts, as two processes have: the worker's signs, the core's hears outcomes.
            async with running(
                config,
                worker_plugins=PluginHost.from_config(config),
                core_plugins=PluginHost.from_config(config),
            ) as core:
                msg_id = await core.queue(["someone@ok.test", "other@ok.test"])
                await core.until(lambda: core.store.message_count() == 0)
                await core.until(lambda: events.exists() and len(events.read_text().split()) >= 2)
                return msg_id

        msg_id = asyncio.run(main())
        (received,) = sink.messages(1)
    assert b"X-Sending-Zone" not in received.content
    assert received.content.startswith(b"DKIM-Signature: ")
    message = received.content.replace(b"\n", b"\r\n")  # smtp-sink dumps with LF

    def dns_txt(name: bytes, timeout: int = 5) -> bytes:
        return txt if name == b"s1._domainkey.shop.example." else b""

    assert dkim.verify(message, dnsfunc=dns_txt)
    assert not dkim.verify(message.replace(b"Hello.", b"Hello!"), dnsfunc=dns_txt)
    # Signed once per delivery: one signature for the two recipients' one transaction.
    assert message.count(b"DKIM-Signature:") == 1
    lines = [json.loads(line) for line in events.read_text().splitlines()]
    assert sorted(line["recipient"] for line in lines) == ["other@ok.test", "someone@ok.test"]
    for line in lines:
        assert line["hook"] == "delivered" and line["code"] == 250
        assert line["zone"] == "default" and line["sender"] == "news@shop.example"
        assert line["attempts"] == 1 and line["message_id"] == f"{msg_id:016x}"


def test_a_plugin_raising_at_sender_headers_defers_with_a_logged_error(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    broken = write_plugin(tmp_path, "broken", RAISES)
    with run_smtp_sink() as sink, dns_for(tmp_path, ["ok.test"], sink.host) as dns:
        config = config_for(tmp_path, dns, sink.port, plugins={"broken": plugin_table(broken)})

        async def main() -> None:
            async with running(config, worker_plugins=PluginHost.from_config(config)) as core:
                await core.queue(["someone@ok.test"])
                await core.until(lambda: len(core.events("deferred")) == 1)
                (event,) = core.events("deferred")
                assert (event.code, event.enhanced) == (451, "4.3.0")
                assert (
                    event.text is not None
                    and "plugin broken failed at sender:headers" in event.text
                )
                assert core.store.count("default", State.DEFERRED) == 1  # kept, not lost
                assert core.store.message_count() == 1

        with caplog.at_level(logging.ERROR, logger="zoneq.delivery"):
            asyncio.run(main())
        assert sink.messages(1, timeout=0.5) == []  # nothing went out
    assert any("signing service down" in r.getMessage() for r in caplog.records)


def test_sender_connect_may_defer_a_destination_before_connecting(tmp_path: Path) -> None:
    veto = write_plugin(tmp_path, "veto", VETO)
    with run_smtp_sink() as sink, dns_for(tmp_path, ["ok.test", "veto.test"], sink.host) as dns:
        config = config_for(tmp_path, dns, sink.port, plugins={"veto": plugin_table(veto)})

        async def main() -> None:
            async with running(config, worker_plugins=PluginHost.from_config(config)) as core:
                await core.queue(["a@veto.test", "b@ok.test"])
                await core.until(lambda: bool(core.events("deferred") and core.events("delivered")))
                (deferred,) = core.events("deferred")
                assert (deferred.code, deferred.enhanced, deferred.text) == (
                    451,
                    "4.7.0",
                    "451 4.7.0 not now",
                )
                (delivered,) = core.events("delivered")
                assert delivered.mx == "mx0.ok.test"

        asyncio.run(main())
        received = sink.messages(1)
    assert len(received) == 1  # only ok.test's transaction reached the sink


def test_a_sender_connect_refusal_bounces_as_our_own_diagnostic(tmp_path: Path) -> None:
    """RFC 3464 sections 2.3.5 and 2.3.6: the plugin refused before any connection, so the
    bounce names no Remote-MTA and its Diagnostic-Code is zoneq's, not an SMTP reply; the
    event still names the MX host the refusal was about."""

    async def main(core: InProc) -> None:
        await core.queue(["a@refuse.test"])
        await core.until(lambda: bool(core.events("bounced")))
        (bounced,) = core.events("bounced")
        assert bounced.mx == "mx0.refuse.test"
        await core.until(lambda: core.store.count("bounces", State.READY) == 1)
        status = dsn_of(core.store).get_payload()[1].get_payload()  # type: ignore[index,union-attr]
        (block,) = [block for block in status[1:] if block["Final-Recipient"]]
        assert (block["Action"], block["Status"]) == ("failed", "5.7.1")
        assert block["Remote-MTA"] is None
        assert block["Diagnostic-Code"] == "X-zoneq; 550 5.7.1 not to this one"

    assert with_send_plugin(tmp_path, VETO, ["refuse.test"], main) == []  # nothing went out
