"""``consult_all``: many recipients through the real ``PluginHost``'s ``queue:route``
plugins side by side, the verdicts in the recipients' order, a plugin's fault raised as
itself and a deadline for the whole."""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.plugins import config_with, write_plugin
from zoneq.plugin import Drop, PluginFailure, PluginHost
from zoneq.protocol.replies import Reply
from zoneq.queue.consults import RoutingTooSlow, consult_all
from zoneq.queue.routing import Route, Router

# The verdict is spelled in the local part ("tx.3" is zone tx after 3 ms), so the answers
# come back in another order than they were asked.
PLUGIN = """
import asyncio

from zoneq.plugin import Drop, EnhancedStatus, Hook, Reply


def init(app):
    async def route(args):
        verdict, _, ms = args.recipient.partition("@")[0].partition(".")
        await asyncio.sleep(int(ms) / 1000)
        if verdict == "raise":
            raise RuntimeError("plugin bug")
        if verdict == "drop":
            return Drop("dropped")
        if verdict == "refuse":
            return Reply(550, ("No",), EnhancedStatus(5, 7, 1))
        return None if verdict == "keep" else verdict

    app.add_hook(Hook.QUEUE_ROUTE, route)
"""

VERDICTS = ["keep", "tx", "bulk", "drop", "refuse"]


def router_with_plugin(directory: Path) -> tuple[Router, PluginHost]:
    module = write_plugin(directory, "verdicts", PLUGIN)
    config = config_with({"verdicts": {"module": module, "timeout": "2s"}})
    plugins = PluginHost.from_config(config)
    return Router.from_config(config, plugins), plugins


def expected(local: str) -> object:
    """What ``summary`` should make of the verdict for ``local``."""
    verdict = local.partition(".")[0]
    tokens: dict[str, object] = {"keep": "default", "refuse": 550}
    return Drop("dropped", zone="default") if verdict == "drop" else tokens.get(verdict, verdict)


def summary(verdict: Route | Reply | Drop) -> object:
    """A zone, a drop, or a reply's code."""
    if isinstance(verdict, Route):
        return verdict.zone
    return verdict if isinstance(verdict, Drop) else verdict.code


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(VERDICTS), st.integers(0, 5)), max_size=12))
def test_verdicts_come_back_in_the_order_asked(
    tmp_path_factory: pytest.TempPathFactory, asks: list[tuple[str, int]]
) -> None:
    router, plugins = router_with_plugin(tmp_path_factory.mktemp("consults"))
    locals_ = [f"{verdict}.{ms}" for verdict, ms in asks]
    decided = Route("default", "default")

    async def main() -> list[Route | Reply | Drop]:
        try:
            return await consult_all(
                router, [(f"{local}@b.test", decided) for local in locals_], sender="a@s.test"
            )
        finally:
            await plugins.close()

    assert [summary(v) for v in asyncio.run(main())] == [expected(local) for local in locals_]


def test_a_plugin_fault_is_raised_as_itself_and_a_deadline_as_too_slow(tmp_path: Path) -> None:
    router, plugins = router_with_plugin(tmp_path)
    decided = Route("default", "default")

    async def main() -> None:
        try:
            asks = [("keep.50@b.test", decided), ("raise.1@b.test", decided)]
            with pytest.raises(PluginFailure, match="plugin bug"):
                await consult_all(router, asks, sender="")
            slow = [(f"keep.100@{i}.test", decided) for i in range(8)]  # 2 rounds of 4
            with pytest.raises(RoutingTooSlow, match=r"8 recipients not routed within 0\.15s"):
                await consult_all(router, slow, sender="", deadline_s=0.15)
            assert len(await consult_all(router, slow, sender="", deadline_s=5)) == 8
        finally:
            await plugins.close()

    asyncio.run(main())
