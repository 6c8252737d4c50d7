"""The suppression list at a bulk sender's size, through the API and the plugin in one
process, as in the core: one parsed copy shared by both, a change written as a journal line
(the snapshot neither rewritten nor parsed again), and the journal folded in by a
background task once it has outgrown the snapshot."""

from __future__ import annotations

import asyncio
import gc
import json
from pathlib import Path
from typing import Any

import pytest

from tests.api.conftest import api_running, async_test
from tests.api.test_suppression import (
    REFUSED,
    S,
    add,
    bundled,
    on_disk,
    route,
    suppression_config,
)
from zoneq.plugin import PluginHost
from zoneq.storage.store import QueueStore

pytestmark = pytest.mark.integration

BIG = 100_000


def journal_size(path: Path) -> int:
    journal = path.with_name(path.name + ".journal")
    return journal.stat().st_size if journal.exists() else 0


def live_lists(path: Path) -> list[Any]:
    """The ``SuppressionList``s of ``path`` alive in this process (the hook's closure holds
    one; the API's requests and this test hold whatever ``shared_list`` gave them)."""
    gc.collect()
    kind = bundled().SuppressionList
    return [o for o in gc.get_objects() if isinstance(o, kind) and o.path == path]


@async_test
async def test_the_api_and_the_plugin_share_one_parsed_list(
    store: QueueStore, tmp_path: Path
) -> None:
    listed = tmp_path / "suppressed.json"
    bundled().save_file(listed, {"*": [f"s{i}@d{i % 5000}.example" for i in range(BIG)]})
    snapshot = bundled().stamp(listed)
    config = suppression_config(listed)
    host = PluginHost.from_config(config)  # as serve loads it, before the API starts
    shared = bundled().shared_list(listed)
    assert shared.parses == 1
    async with api_running(store, config) as api:
        assert (await add(api, "bulk", "New@Shop.Example"))["total"] == 1
        assert await route(host, "new@shop.example", "bulk") == REFUSED
        status, body = await api.call("GET", f"{S}/*/check", params={"address": "s9@d9.example"})
        assert (status, body["suppressed"]) == (200, True)
        status, _ = await api.call("DELETE", f"{S}/*", params={"address": "s9@d9.example"})
        assert status == 200
        assert await route(host, "s9@d9.example", "bulk") is None
        # One copy in the process, the hook's and the API's: it read none of the lines
        # the API wrote (a copy of its own would have, to see them).
        assert live_lists(listed) == [shared]
        assert shared is bundled().shared_list(listed)
    # Not one parse more, the snapshot untouched, two short lines written.
    assert shared.parses == 1 and shared.journal_lines == 0
    assert bundled().stamp(listed) == snapshot
    assert journal_size(listed) < 100


@async_test
async def test_a_long_journal_is_folded_in_the_background(
    store: QueueStore, tmp_path: Path
) -> None:
    listed = tmp_path / "suppressed.json"
    listed.write_text('{"tx": ["t@x.test"]}\n')
    addresses = [f"user{i}@s{i % 7}.example.test" for i in range(60_000)]  # > 1 MiB
    async with api_running(store, suppression_config(listed)) as api:
        assert (await add(api, "bulk", *addresses))["total"] == len(addresses)
        for _ in range(200):  # the fold runs after the answer: wait for it, bounded
            if journal_size(listed) == 0:
                break
            await asyncio.sleep(0.05)
        assert journal_size(listed) == 0
        assert (await add(api, "bulk", "later@x.test"))["added"] == 1
    expected = {"bulk": sorted([*addresses, "later@x.test"]), "tx": ["t@x.test"]}
    assert on_disk(listed) == expected
    assert json.loads(listed.read_text()) == {**expected, "bulk": sorted(addresses)}
    assert bundled().shared_list(listed).parses == 1
