"""The suppression routes against a real store and a config with the bundled suppression
plugin enabled: the file they write is the one the plugin reads, checked by loading the
plugin through a real ``PluginHost`` and calling its ``queue:route`` hook."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.api.conftest import CONFIG, TOKEN, Api, api_running, async_test, make_config
from tests.plugin.test_suppression_journal import fsync_failing
from tests.support.plugins import BUNDLED
from zoneq.config import Config, loads_config
from zoneq.config.plugins import PluginConfig, import_plugin
from zoneq.plugin import Hook, PluginHost, RouteArgs
from zoneq.storage.store import QueueStore

pytestmark = pytest.mark.integration

S = "/api/v1/suppression"
REFUSED = "550 5.1.1 Recipient is on the suppression list"

PLUGIN = """
[plugins.suppression]
enabled = {enabled}
module = "{module}"
options.file = "{file}"
options.action = "refuse"
"""


def suppression_config(file: Path, *, enabled: bool = True) -> Config:
    """The API tests' config (zones default, bulk, bounces) with the bundled plugin."""
    plugin = PLUGIN.format(
        module=BUNDLED / "suppression.py", file=file, enabled=str(enabled).lower()
    )
    return loads_config(CONFIG.format(token=TOKEN, max_size="50MiB") + plugin)


def empty_list(directory: Path) -> Path:
    """The list's file, as an operator would start it (the plugin requires it to exist), in
    a directory of its own (so a test can see no temporary file is left)."""
    path = directory / "lists" / "suppressed.json"
    path.parent.mkdir()
    path.write_text("{}\n")
    return path


@pytest.fixture
def listed(tmp_path: Path) -> Path:
    return empty_list(tmp_path)


def bundled() -> Any:
    """The bundled plugin's module, imported the way zoneq imports it (once per process)."""
    return import_plugin("suppression", PluginConfig(module=str(BUNDLED / "suppression.py")))


def on_disk(path: Path) -> dict[str, list[str]]:
    """The list as another process reads it: the snapshot and its journal, read afresh."""
    data: dict[str, list[str]] = bundled().SuppressionList(path).as_dict()
    return data


def written(path: Path) -> tuple[int, int]:
    """What a write moves: the snapshot's mtime and the journal's size."""
    journal = path.with_name(path.name + ".journal")
    return path.stat().st_mtime_ns, journal.stat().st_size if journal.exists() else 0


async def add(api: Api, zone: str, *addresses: str) -> dict[str, Any]:
    status, body = await api.call("POST", f"{S}/{zone}", json={"addresses": list(addresses)})
    assert status == 200, body
    return dict(body)


async def check(api: Api, zone: str, address: str) -> dict[str, Any]:
    status, body = await api.call("GET", f"{S}/{zone}/check", params={"address": address})
    assert status == 200, body
    return dict(body)


@async_test
async def test_add_list_check_remove(store: QueueStore, listed: Path) -> None:
    async with api_running(store, suppression_config(listed)) as api:
        assert await add(api, "bulk", "A@Shop.Example", "b@shop.example") == {
            "zone": "bulk",
            "added": 2,
            "total": 2,
        }
        # Listed again in another case: the same address, nothing added, nothing written.
        before = written(listed)
        assert (await add(api, "bulk", "a@SHOP.example"))["added"] == 0
        assert written(listed) == before

        status, page = await api.call("GET", f"{S}/bulk")
        assert (status, page["addresses"], page["total"]) == (
            200,
            ["a@shop.example", "b@shop.example"],
            2,
        )
        assert on_disk(listed) == {"bulk": ["a@shop.example", "b@shop.example"]}

        assert await check(api, "bulk", "a@shop.EXAMPLE") == {
            "zone": "bulk",
            "address": "a@shop.example",
            "suppressed": True,
            "lists": ["bulk"],
        }
        assert (await check(api, "default", "a@shop.example"))["suppressed"] is False

        status, body = await api.call("DELETE", f"{S}/bulk", params={"address": "A@shop.example"})
        assert (status, body) == (
            200,
            {"zone": "bulk", "address": "a@shop.example", "removed": True},
        )
        status, body = await api.call("DELETE", f"{S}/bulk", params={"address": "a@shop.example"})
        assert status == 404 and "not on the suppression list of bulk" in body["error"]["message"]
        assert on_disk(listed) == {"bulk": ["b@shop.example"]}


@async_test
async def test_star_zone_applies_to_every_zone(store: QueueStore, listed: Path) -> None:
    async with api_running(store, suppression_config(listed)) as api:
        await add(api, "*", "all@x.test")
        await add(api, "bulk", "all@x.test", "bulk@x.test")
        assert (await check(api, "bulk", "all@x.test"))["lists"] == ["*", "bulk"]
        assert (await check(api, "default", "all@x.test"))["lists"] == ["*"]
        assert (await check(api, "*", "bulk@x.test"))["suppressed"] is False
        # Removing it from one zone leaves the list of every zone alone.
        status, _ = await api.call("DELETE", f"{S}/bulk", params={"address": "all@x.test"})
        assert status == 200
        assert (await check(api, "bulk", "all@x.test"))["lists"] == ["*"]
        status, _ = await api.call("DELETE", f"{S}/*", params={"address": "all@x.test"})
        assert status == 200
        assert (await check(api, "bulk", "all@x.test"))["suppressed"] is False
        assert on_disk(listed) == {"bulk": ["bulk@x.test"]}


BAD_ADDRESSES = [
    ("", "empty"),
    ("no-at-sign", "expected local-part@domain"),
    ("@x.test", "expected local-part@domain"),
    ("a b@x.test", "whitespace"),
    ("<a@x.test>", "<>,;"),
    ("a@x.test\r\nRCPT TO:<b@x.test>", "whitespace"),
    ("l" * 65 + "@x.test", "too long"),
]


@pytest.mark.parametrize(("address", "why"), BAD_ADDRESSES)
@async_test
async def test_bad_address_is_400_and_changes_nothing(
    store: QueueStore, listed: Path, address: str, why: str
) -> None:
    listed.write_text('{"bulk": ["kept@x.test"]}')
    before = listed.read_bytes()
    async with api_running(store, suppression_config(listed)) as api:
        # In a batch with good ones: all are checked before any is written.
        status, body = await api.call(
            "POST", f"{S}/bulk", json={"addresses": ["good@x.test", address]}
        )
        assert status == 400 and why in body["error"]["message"], body
        for method, path in (("GET", f"{S}/bulk/check"), ("DELETE", f"{S}/bulk")):
            status, body = await api.call(method, path, params={"address": address})
            assert status == 400 and why in body["error"]["message"], (method, body)
    assert listed.read_bytes() == before


@async_test
async def test_bad_requests_name_what_is_wrong(store: QueueStore, listed: Path) -> None:
    async with api_running(store, suppression_config(listed)) as api:
        cases: list[tuple[str, str, dict[str, Any], int, str]] = [
            ("POST", f"{S}/nozone", {"json": {"addresses": ["a@x.test"]}}, 404, "no zone"),
            ("GET", f"{S}/nozone", {}, 404, "no zone"),
            ("POST", f"{S}/bulk", {"json": {"addresses": []}}, 400, "addresses"),
            ("POST", f"{S}/bulk", {"json": {"address": "a@x.test"}}, 400, "address"),
            ("POST", f"{S}/bulk", {"data": b"not json"}, 400, "JSON"),
            ("GET", f"{S}/bulk/check", {}, 400, "address: required"),
            ("DELETE", f"{S}/bulk", {}, 400, "address: required"),
            ("GET", f"{S}/bulk", {"params": {"limit": "0"}}, 400, "limit"),
        ]
        for method, path, kwargs, expected, text in cases:
            status, body = await api.call(method, path, **kwargs)
            assert status == expected and text in body["error"]["message"], (path, body)
        status, _ = await api.call("GET", f"{S}/bulk", token=None)
        assert status == 401
    assert on_disk(listed) == {}


@pytest.mark.parametrize("enabled", [False, None])
@async_test
async def test_plugin_not_enabled_is_409(
    store: QueueStore, listed: Path, enabled: bool | None
) -> None:
    # None: no [plugins.suppression] at all; False: the table is there, disabled.
    config = make_config() if enabled is None else suppression_config(listed, enabled=False)
    async with api_running(store, config) as api:
        for method, path, kwargs in (
            ("GET", f"{S}/bulk", {}),
            ("POST", f"{S}/bulk", {"json": {"addresses": ["a@x.test"]}}),
            ("GET", f"{S}/bulk/check", {"params": {"address": "a@x.test"}}),
            ("DELETE", f"{S}/bulk", {"params": {"address": "a@x.test"}}),
        ):
            status, body = await api.call(method, path, **kwargs)
            assert status == 409, (method, path, status)
            assert "suppression plugin is not enabled" in body["error"]["message"]
    assert on_disk(listed) == {}


@async_test
async def test_pages_cover_the_list_once_in_order(store: QueueStore, listed: Path) -> None:
    addresses = [f"user{i:04d}@x.test" for i in range(250)]
    async with api_running(store, suppression_config(listed)) as api:
        await add(api, "bulk", *reversed(addresses))
        seen: list[str] = []
        cursor: str | None = None
        pages = 0
        while pages < 10:  # 3 expected; bounded should a cursor ever fail to advance
            params = {"limit": "100", **({"cursor": cursor} if cursor else {})}
            status, page = await api.call("GET", f"{S}/bulk", params=params)
            assert status == 200 and page["total"] == 250
            seen += page["addresses"]
            pages += 1
            cursor = page["cursor"]
            if cursor is None:
                break
        # A removal between pages does not make the next page skip or repeat anything.
        _, first = await api.call("GET", f"{S}/bulk", params={"limit": "10"})
        await api.call("DELETE", f"{S}/bulk", params={"address": addresses[3]})
        status, second = await api.call(
            "GET", f"{S}/bulk", params={"limit": "10", "cursor": first["cursor"]}
        )
    assert pages == 3 and seen == addresses
    assert second["addresses"] == addresses[10:20]


@async_test
async def test_concurrent_adds_lose_nothing(store: QueueStore, listed: Path) -> None:
    """40 requests at once, each adding 25 addresses (some shared between requests): every
    address is on the list and in the file, whatever order the adds ran in."""
    batches = [[f"u{b}-{i}@x.test" for i in range(24)] + ["shared@x.test"] for b in range(40)]
    async with api_running(store, suppression_config(listed)) as api:
        answers = await asyncio.gather(*(add(api, "bulk", *batch) for batch in batches))
        status, page = await api.call("GET", f"{S}/bulk", params={"limit": "1000"})
    assert status == 200
    expected = sorted({a for batch in batches for a in batch})
    assert sum(a["added"] for a in answers) == len(expected) == 961
    assert page["addresses"] == expected
    assert on_disk(listed) == {"bulk": expected}
    journal = listed.name + ".journal"
    assert not [p for p in listed.parent.iterdir() if p.name not in (listed.name, journal)]


@async_test
async def test_unreadable_file_is_503_and_left_alone(store: QueueStore, listed: Path) -> None:
    async with api_running(store, suppression_config(listed)) as api:
        await add(api, "bulk", "a@x.test")
        listed.write_text('{"bulk": "an operator\'s mistake"}')
        for method, kwargs in (("GET", {}), ("POST", {"json": {"addresses": ["b@x.test"]}})):
            status, body = await api.call(method, f"{S}/bulk", **kwargs)
            assert status == 503, body
            assert "zone name -> [addresses]" in body["error"]["message"]
    assert listed.read_text() == '{"bulk": "an operator\'s mistake"}'


@pytest.mark.parametrize(
    ("failures", "outcome"),
    [
        (1, "nothing was changed"),  # the line's fsync: the line is cut off again
        (2, "the change may or may not have been kept"),  # and the cut's fsync too
    ],
)
@async_test
async def test_an_add_whose_fsync_failed_is_503_saying_what_was_kept(
    store: QueueStore, listed: Path, monkeypatch: pytest.MonkeyPatch, failures: int, outcome: str
) -> None:
    async with api_running(store, suppression_config(listed)) as api:
        fsync_failing(monkeypatch, failures)
        status, body = await api.call("POST", f"{S}/bulk", json={"addresses": ["a@x.test"]})
        assert status == 503, body
        assert f"; {outcome}, try again" in body["error"]["message"]
        if failures == 1:  # as the answer says: not applied, here or by another process
            assert (await check(api, "bulk", "a@x.test"))["suppressed"] is False
            assert on_disk(listed) == {}


@async_test
async def test_a_hand_written_file_is_read_and_kept_compatible(
    store: QueueStore, listed: Path
) -> None:
    """A file in the plugin's original format (unsorted, mixed case) is managed as it is,
    and what the API writes back is still that format."""
    listed.write_text('{"bulk": ["Z@x.test", "a@X.test"], "*": ["C@y.test"]}')
    async with api_running(store, suppression_config(listed)) as api:
        status, page = await api.call("GET", f"{S}/bulk")
        assert (status, page["addresses"]) == (200, ["a@x.test", "z@x.test"])
        await add(api, "default", "d@x.test")
    assert on_disk(listed) == {
        "*": ["c@y.test"],
        "bulk": ["a@x.test", "z@x.test"],
        "default": ["d@x.test"],
    }


async def route(host: PluginHost, recipient: str, zone: str) -> str | None:
    result = await host.call(Hook.QUEUE_ROUTE, RouteArgs("a@src.test", recipient, zone, "default"))
    return None if result.reply is None else str(result.reply)


@async_test
async def test_plugin_sees_an_api_change_without_a_restart(store: QueueStore, listed: Path) -> None:
    config = suppression_config(listed)
    host = PluginHost.from_config(config)  # loads the file once, as serve does at start
    async with api_running(store, config) as api:
        assert await route(host, "x@shop.example", "bulk") is None
        await add(api, "bulk", "X@Shop.Example")
        assert await route(host, "x@shop.example", "bulk") == REFUSED
        assert await route(host, "X@SHOP.EXAMPLE", "bulk") == REFUSED
        assert await route(host, "x@shop.example", "default") is None
        await add(api, "*", "y@shop.example")
        assert await route(host, "y@shop.example", "default") == REFUSED
        status, _ = await api.call("DELETE", f"{S}/bulk", params={"address": "x@shop.example"})
        assert status == 200
        assert await route(host, "x@shop.example", "bulk") is None
