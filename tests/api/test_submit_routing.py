"""API submissions route like SMTP (issue 5): sender-domain rules, the routing header (an
API client holds the token, so it is trusted), and the ``queue:route`` plugins, with the
bundled ``plugins/suppression.py`` and a test plugin loaded by the real ``PluginHost``.

Real parts: the aiohttp app on 127.0.0.1 over a LevelDB queue on disk
(``tests/api/conftest.py``); refusals come back in the answer, drops as DROPPED events.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from tests.api.conftest import T0, TOKEN, Api, api_running, async_test
from tests.api.test_submit import BASE, RAW, nothing_stored, raw, source_of
from tests.api.test_suppression_serve import REFUSED as SUPPRESSED
from tests.storage.conftest import StoreFactory
from tests.support.plugins import BUNDLED, write_plugin
from zoneq.config import Config, validate_config
from zoneq.errors import TemporaryFailure
from zoneq.plugin import PluginHost
from zoneq.protocol.events import EventKind
from zoneq.queue.consults import RoutingTooSlow
from zoneq.queue.intake import Envelope, Intake
from zoneq.storage.store import QueueStore

pytestmark = pytest.mark.integration


PLUGIN = """
from zoneq.plugin import EnhancedStatus, Hook, Reply


def init(app):
    async def route(args):
        local = args.recipient.split("@")[0]
        if local == "later":
            return Reply(451, ("Greylisted",), EnhancedStatus(4, 7, 1))
        if local == "raise":
            raise RuntimeError("plugin bug")
        if local.startswith("bulk-"):
            return "bulk"  # the suppression plugin, next in the chain, judges bulk's list
        return None

    app.add_hook(Hook.QUEUE_ROUTE, route)
"""


def config(tmp_path: Path, action: str = "refuse") -> Config:
    listed = tmp_path / "suppressed.json"
    listed.write_text(json.dumps({"default": ["sup@ok.test"], "bulk": ["bulk-sup@ok.test"]}))
    module = write_plugin(tmp_path, "verdicts", PLUGIN)
    return validate_config(
        {
            "server": {"hostname": "mx.zoneq.test"},
            "api": {"listen": "127.0.0.1:0", "token": TOKEN},
            "zones": {"default": {}, "bulk": {}, "bounces": {}},
            "routing": {"rules": [{"zone": "bulk", "sender_domain": ["news.test"]}]},
            "plugins": {
                "verdicts": {"module": str(module), "timeout": "1s"},
                "suppression": {
                    "module": str(BUNDLED / "suppression.py"),
                    "options": {"file": str(listed), "action": action},
                },
            },
        }
    )


@contextlib.asynccontextmanager
async def routing_api(store: QueueStore, tmp_path: Path, action: str) -> AsyncIterator[Api]:
    cfg = config(tmp_path, action)
    plugins = PluginHost.from_config(cfg)
    try:
        async with api_running(store, cfg, plugins=plugins) as api:
            yield api
    finally:
        await plugins.close()


def dropped(store: QueueStore) -> list[tuple[str, str, str | None]]:
    return [(e.recipient, e.zone, e.text) for _, e in store.events() if e.kind is EventKind.DROPPED]


@async_test
async def test_sender_domain_rule_and_trusted_header_route_api_mail(
    store: QueueStore, tmp_path: Path
) -> None:
    async with routing_api(store, tmp_path, "refuse") as api:
        status, body = await raw(api, RAW, "?from=list@news.test&to=a@ok.test")
        assert (status, body["zones"], body["refused"]) == (201, ["bulk"], [])
        headed = b"X-Sending-Zone: bulk\r\n" + RAW
        status, body = await raw(api, headed, "?from=a@src.test&to=b@ok.test")
        assert (status, body["zones"]) == (201, ["bulk"])
        # Stored as sent: the delivery side removes the header from the outgoing copy.
        assert b"X-Sending-Zone: bulk\r\n" in source_of(store, body["id"])
        status, body = await raw(api, RAW, "?from=a@src.test&to=b@ok.test")
        assert (status, body["zones"]) == (201, ["default"])


@async_test
async def test_suppression_refusals_are_listed_and_the_rest_queued(
    store: QueueStore, tmp_path: Path
) -> None:
    async with routing_api(store, tmp_path, "refuse") as api:
        status, body = await raw(api, RAW, "?from=a@src.test&to=sup@ok.test&to=b@ok.test")
        assert status == 201, body
        assert body["recipients"] == ["b@ok.test"]
        assert body["refused"] == [{"recipient": "sup@ok.test", "code": 550, "reply": SUPPRESSED}]
        # The JSON submission goes the same way; the header's zone is the one checked.
        fields = {**BASE, "to": ["bulk-sup@ok.test", "c@ok.test"]}
        fields["headers"] = {"X-Sending-Zone": "bulk"}
        status, body = await api.call("POST", "/api/v1/messages", json=fields)
        assert status == 201, body
        assert (body["recipients"], body["zones"]) == (["c@ok.test"], ["bulk"])
        assert [r["recipient"] for r in body["refused"]] == ["bulk-sup@ok.test"]
        assert dropped(store) == []  # a refusal is told, not recorded as a drop


@async_test
async def test_suppression_drops_are_events(store: QueueStore, tmp_path: Path) -> None:
    async with routing_api(store, tmp_path, "drop") as api:
        status, body = await raw(api, RAW, "?from=a@src.test&to=sup@ok.test&to=b@ok.test")
        assert status == 201, body
        assert (body["recipients"], body["refused"]) == (["b@ok.test"], [])
        assert dropped(store) == [("sup@ok.test", "default", "suppressed in zone default")]
        # Every recipient dropped: 200, nothing stored (no Location), the event only.
        status, body = await raw(api, RAW, "?from=a@src.test&to=sup@ok.test")
        assert (status, body["recipients"]) == (200, [])
        assert len(dropped(store)) == 2
        assert store.message_count() == 1
        # Moved to bulk by the plugin before it in the chain: dropped (and counted) there.
        status, body = await raw(api, RAW, "?from=a@src.test&to=bulk-sup@ok.test&to=c@ok.test")
        assert (status, body["zones"], body["refused"]) == (201, ["default"], [])
        assert dropped(store)[-1] == ("bulk-sup@ok.test", "bulk", "suppressed in zone bulk")


@pytest.mark.parametrize(
    ("query", "status", "retry_after"),
    [
        ("?from=a@src.test&to=sup@ok.test", 422, None),
        ("?from=a@src.test&to=sup@ok.test&to=later@ok.test", 503, "30"),
        ("?from=a@src.test&to=raise@ok.test&to=b@ok.test", 503, "30"),
    ],
)
@async_test
async def test_all_refused_or_a_failing_plugin_stores_nothing(
    stores: StoreFactory, tmp_path: Path, query: str, status: int, retry_after: str | None
) -> None:
    store = stores.open()
    async with routing_api(store, tmp_path, "refuse") as api:
        url = api.url(f"/api/v1/messages/raw{query}")
        headers = {"Authorization": f"Bearer {TOKEN}"}
        async with api.session.post(url, data=RAW, headers=headers) as response:
            answer = await response.json()
            assert response.status == status, answer
            assert response.headers.get("Retry-After") == retry_after
        assert answer["error"]["status"] == status
        await store.drain()
        assert nothing_stored(store)
        assert dropped(store) == []


SLOW_ROUTE = """
import asyncio

from zoneq.plugin import Hook


def init(app):
    async def route(args):
        await asyncio.sleep(0.2)  # well under its 1 s limit
        return None

    app.add_hook(Hook.QUEUE_ROUTE, route)
"""


@pytest.mark.parametrize(("deadline_s", "stored"), [(0.3, False), (10.0, True)])
@async_test
async def test_routing_past_its_deadline_is_a_temporary_failure_and_stores_nothing(
    store: QueueStore, tmp_path: Path, deadline_s: float, stored: bool
) -> None:
    """12 recipients at 0.2 s each, asked 4 at a time: 0.6 s in all.  Past the deadline
    the submission fails as temporary (503 over the API) and leaves nothing behind."""
    module = write_plugin(tmp_path, "slow_route", SLOW_ROUTE)
    cfg = validate_config(
        {
            "server": {"hostname": "mx.zoneq.test"},
            "zones": {"default": {}, "bounces": {}},
            "plugins": {"slow_route": {"module": str(module), "timeout": "1s"}},
        }
    )
    plugins = PluginHost.from_config(cfg)
    intake = Intake(store, cfg, clock=lambda: T0, plugins=plugins, route_deadline_s=deadline_s)
    envelope = Envelope("a@src.test", tuple(f"r{i}@ok.test" for i in range(12)))

    async def body() -> AsyncIterator[bytes]:
        yield RAW

    try:
        if stored:
            receipt = await intake.receive(body(), envelope, source={"client": "127.0.0.1"})
            assert len(receipt.recipients) == 12
        else:
            with pytest.raises(RoutingTooSlow) as info:
                await intake.receive(body(), envelope, source={"client": "127.0.0.1"})
            assert isinstance(info.value, TemporaryFailure)
            await store.drain()
            assert nothing_stored(store)
    finally:
        await plugins.close()
