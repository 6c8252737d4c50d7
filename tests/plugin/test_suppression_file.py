"""The suppression plugin's file: the format the API writes and the plugin reads, the atomic
replace, and the reload on change (one parse per change, none without one), with the
reload time and memory of a 100,000-address list measured."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
import tracemalloc
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.plugins import BUNDLED
from zoneq.config.plugins import PluginConfig, import_plugin

BIG = 100_000


@pytest.fixture(scope="module")
def plugin() -> ModuleType:
    """The bundled module, imported the way zoneq imports it."""
    return import_plugin("suppression", PluginConfig(module=str(BUNDLED / "suppression.py")))


ZONE_NAMES = st.sampled_from(["*", "default", "bulk", "tx"])
ZONES = st.dictionaries(ZONE_NAMES, st.sets(st.emails(), max_size=20), max_size=4)


@settings(max_examples=60, deadline=None)
@given(ZONES)
def test_save_then_load_gives_the_normalized_list(
    plugin: ModuleType, tmp_path_factory: pytest.TempPathFactory, zones: dict[str, set[str]]
) -> None:
    path = tmp_path_factory.mktemp("round") / "list.json"
    plugin.save_file(path, zones)
    expected = {z: frozenset(a.lower() for a in v) for z, v in zones.items() if v}
    assert plugin.load_file(path) == expected
    # Still the plugin's original format: an object of zone -> [addresses], nothing else.
    raw = json.loads(path.read_text())
    assert all(isinstance(v, list) for v in raw.values()) and set(raw) == set(expected)


@pytest.mark.parametrize(
    ("address", "stored"),
    [
        ("User@Example.ORG", "user@example.org"),  # the whole address, local part too
        ("user@example.org", "user@example.org"),
        # SMTPUTF8 addresses (RFC 6531): the domain as the queue keys it, in A-labels
        ("Ünïcode@Exämple.test", "ünïcode@xn--exmple-cua.test"),
        ("a+tag@x.test", "a+tag@x.test"),  # sub-addresses stay distinct addresses
    ],
)
def test_normalize(plugin: ModuleType, address: str, stored: str) -> None:
    assert plugin.normalize(address) == stored


def test_save_is_a_replace_that_keeps_the_mode_and_moves_mtime(
    plugin: ModuleType, tmp_path: Path
) -> None:
    path = tmp_path / "list.json"
    path.write_text("{}")
    path.chmod(0o640)
    stamps = []
    for i in range(20):  # faster than the kernel's file-time tick: mtime must still move
        plugin.save_file(path, {"bulk": [f"a{i}@x.test"]})
        stamps.append(plugin.stamp(path))
    assert stat.S_IMODE(path.stat().st_mode) == 0o640
    mtimes = [s[1] for s in stamps]
    assert mtimes == sorted(mtimes) and len(set(mtimes)) == 20
    assert [p.name for p in tmp_path.iterdir()] == ["list.json"]  # no temporary file left


def test_failed_save_leaves_the_old_file(plugin: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "list.json"
    path.write_text('{"bulk": ["a@x.test"]}')
    with pytest.raises(TypeError):
        plugin.save_file(path, {"bulk": [object()]})  # not JSON: fails before the rename
    assert path.read_text() == '{"bulk": ["a@x.test"]}'
    assert [p.name for p in tmp_path.iterdir()] == ["list.json"]


def big_list(plugin: ModuleType, path: Path, count: int = BIG, extra: str = "") -> None:
    addresses = [f"subscriber{i}.Name@domain{i % 5000}.example" for i in range(count)]
    plugin.save_file(path, {"*": addresses + ([extra] if extra else [])})


def test_reload_only_on_change_and_once_per_change(plugin: ModuleType, tmp_path: Path) -> None:
    path = tmp_path / "list.json"
    big_list(plugin, path)
    listed: Any = plugin.SuppressionList(path)
    assert listed.parses == 1
    for _ in range(1000):  # RCPTs with no change: a stat each, no parse
        listed.reload_if_changed()
    assert listed.parses == 1

    # A change, then 8 threads asking at once (the host runs plain handlers in threads):
    # one of them parses, the others wait for it and see the new list.
    big_list(plugin, path, extra="new@x.test")
    start = threading.Barrier(8)

    def rcpt() -> bool:
        start.wait()
        listed.reload_if_changed()
        return bool(listed.suppressed("bulk", "NEW@x.test"))

    with ThreadPoolExecutor(8) as pool:
        seen = list(pool.map(lambda _: rcpt(), range(8)))
    assert seen == [True] * 8
    assert listed.parses == 2


def test_a_rename_of_the_same_size_is_seen(plugin: ModuleType, tmp_path: Path) -> None:
    """An operator's edit by rename (as the docstring asks), same size, same second."""
    path = tmp_path / "list.json"
    path.write_text('{"bulk": ["a@x.test"]}')
    listed: Any = plugin.SuppressionList(path)
    new = tmp_path / "new.json"
    new.write_text('{"bulk": ["b@x.test"]}')
    os.utime(new, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns))
    os.replace(new, path)
    listed.reload_if_changed()
    assert listed.suppressed("bulk", "b@x.test") and not listed.suppressed("bulk", "a@x.test")


def test_reload_time_and_memory_of_100k_addresses(plugin: ModuleType, tmp_path: Path) -> None:
    """A figure for the report, with a bound far from it: the reload must fit well inside
    a plugin's default 5 s time limit (RCPTs wait for it)."""
    path = tmp_path / "list.json"
    big_list(plugin, path)
    size = path.stat().st_size
    began = time.perf_counter()
    listed: Any = plugin.SuppressionList(path)
    seconds = time.perf_counter() - began
    tracemalloc.start()
    try:
        again: Any = plugin.SuppressionList(path)
        kept, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert again.suppressed("tx", "subscriber77.name@domain77.example")
    assert listed.parses == 1
    print(
        f"\n{BIG} addresses, file {size / 2**20:.1f} MiB: reload {seconds * 1000:.0f} ms, "
        f"kept {kept / 2**20:.1f} MiB, peak while parsing {peak / 2**20:.1f} MiB"
    )
    assert seconds < 2.5
    assert kept < 40 * 2**20
