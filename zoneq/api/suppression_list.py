"""The suppression list as the API edits it: the file the suppression plugin reads.

The plugin module owns the file's format (``plugins/suppression.py``: ``load_file``,
``save_file``, ``normalize``); this module loads that module the way the plugin host does
(``[plugins.suppression]``, its ``module`` and ``options.file``), so the API and the plugin
cannot disagree on what the file says or how addresses compare.

Every operation runs under one ``asyncio.Lock``: the API runs in the core process only, so
that lock serialises every read-modify-write and no concurrent add is lost.  File I/O runs
in a thread, off the event loop.  The parsed list is kept while the file's stat stays the
same, so reads of a big list cost a ``stat``; an operator's edit of the file (by rename, as
the plugin asks) is picked up by the next call.
"""

from __future__ import annotations

import asyncio
import bisect
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Final, cast

from zoneq.config import Config
from zoneq.config.plugins import PluginImportError, import_plugin, plugin_options
from zoneq.errors import ConfigError, NotFound, TemporaryFailure
from zoneq.queue.intake import check_address

__all__ = ["ALL_ZONES", "PLUGIN", "Check", "Page", "SuppressionLists", "Unavailable"]

PLUGIN: Final = "suppression"
ALL_ZONES: Final = "*"

Zones = dict[str, frozenset[str]]
Stamp = tuple[int, int, int, int]


class Unavailable(TemporaryFailure):
    """The list's file cannot be read or written now (missing directory, broken JSON, a
    full disk): the operator's to fix; nothing was changed."""


@dataclass(frozen=True, slots=True)
class Page:
    addresses: list[str]
    cursor: str | None
    total: int


@dataclass(frozen=True, slots=True)
class Check:
    address: str
    lists: list[str]
    """Which lists hold the address: the zone's own and/or ``"*"``."""


@dataclass(frozen=True, slots=True)
class _Format:
    """The plugin module's file functions, typed."""

    load: Callable[[Path], Zones]
    save: Callable[[Path, Mapping[str, Collection[str]]], None]
    normalize: Callable[[str], str]
    stamp: Callable[[Path], Stamp]

    @classmethod
    def of(cls, module: ModuleType) -> _Format:
        names = ("load_file", "save_file", "normalize", "stamp")
        missing = [n for n in names if not callable(getattr(module, n, None))]
        if missing:
            raise ConfigError(
                f"plugins.{PLUGIN}",
                f"{module.__name__} has no {', '.join(missing)}: not a suppression plugin "
                "the API can manage",
            )
        return cls(
            load=cast(Callable[[Path], Zones], module.load_file),
            save=cast(Callable[[Path, Mapping[str, Collection[str]]], None], module.save_file),
            normalize=cast(Callable[[str], str], module.normalize),
            stamp=cast(Callable[[Path], Stamp], module.stamp),
        )


class SuppressionLists:
    """List, add, remove and check suppressed addresses per zone (``"*"``: every zone)."""

    def __init__(self, path: Path, file_format: _Format, zones: Collection[str]) -> None:
        self.path = path
        self._format = file_format
        self._zones = frozenset(zones)
        self._lock = asyncio.Lock()
        self._stamp: Stamp | None = None
        self._cached: Zones = {}
        self._sorted: dict[str, list[str]] = {}

    @classmethod
    def from_config(cls, config: Config) -> SuppressionLists | None:
        """The list of an enabled ``[plugins.suppression]``, or None when it is not enabled.

        Raises ``ConfigError`` if the plugin cannot be loaded (serve would not start
        either: the plugin host loads the same module)."""
        settings = config.plugins.get(PLUGIN)
        if settings is None or not settings.enabled:
            return None
        try:
            module = import_plugin(PLUGIN, settings)
            options = plugin_options(module, settings)
        except (PluginImportError, ValueError) as exc:
            raise ConfigError(f"plugins.{PLUGIN}", str(exc)) from None
        path = getattr(options, "file", None)
        if not isinstance(path, Path):
            raise ConfigError(f"plugins.{PLUGIN}.options.file", "the list's file is not set")
        return cls(path, _Format.of(module), config.zones)

    def _zone(self, zone: str) -> str:
        if zone != ALL_ZONES and zone not in self._zones:
            raise NotFound(f"no zone {zone!r} (zones: {', '.join(sorted(self._zones))}, or *)")
        return zone

    def _address(self, address: str) -> str:
        return self._format.normalize(check_address(address))

    def _read(self) -> Zones:
        """The file's contents (a missing file is an empty list); in a thread, locked."""
        try:
            now = self._format.stamp(self.path)
        except FileNotFoundError:
            self._stamp, self._cached, self._sorted = None, {}, {}
            return self._cached
        except OSError as exc:
            raise Unavailable(f"suppression list {self.path}: {exc}") from exc
        if now != self._stamp:
            try:
                zones = self._format.load(self.path)
            except (OSError, ValueError) as exc:
                raise Unavailable(f"suppression list {exc}") from exc
            self._stamp, self._cached, self._sorted = now, zones, {}
        return self._cached

    def _write(self, zones: Zones) -> None:
        try:
            self._format.save(self.path, zones)
        except OSError as exc:
            raise Unavailable(f"suppression list {self.path} not written: {exc}") from exc
        self._stamp, self._cached, self._sorted = self._format.stamp(self.path), zones, {}

    def _page(self, zone: str, cursor: str | None, limit: int) -> Page:
        zones = self._read()
        ordered = self._sorted.get(zone)
        if ordered is None:
            ordered = self._sorted[zone] = sorted(zones.get(zone, ()))
        start = 0 if cursor is None else bisect.bisect_right(ordered, cursor)
        chunk = ordered[start : start + limit]
        more = start + limit < len(ordered)
        return Page(chunk, chunk[-1] if more and chunk else None, len(ordered))

    def _add(self, zone: str, addresses: Sequence[str]) -> tuple[int, int]:
        zones = self._read()
        before = zones.get(zone, frozenset())
        after = before.union(addresses)
        if len(after) != len(before):
            self._write({**zones, zone: after})
        return len(after) - len(before), len(after)

    def _remove(self, zone: str, address: str) -> None:
        zones = self._read()
        before = zones.get(zone, frozenset())
        if address not in before:
            raise NotFound(f"{address} is not on the suppression list of {zone}")
        self._write({**zones, zone: before - {address}})

    def _check(self, zone: str, address: str) -> Check:
        zones = self._read()
        names = [zone] if zone == ALL_ZONES else [ALL_ZONES, zone]
        return Check(address, [z for z in names if address in zones.get(z, ())])

    # --- the operations: checked arguments, then the file work in a thread, locked ----------

    async def page(self, zone: str, cursor: str | None, limit: int) -> Page:
        zone = self._zone(zone)
        async with self._lock:
            return await asyncio.to_thread(self._page, zone, cursor, limit)

    async def add(self, zone: str, addresses: Sequence[str]) -> tuple[int, int]:
        """How many of ``addresses`` were not listed yet, and how many the zone's list holds
        now; all are checked before any is written, so one bad address changes nothing."""
        zone = self._zone(zone)
        normalized = [self._address(a) for a in addresses]
        async with self._lock:
            return await asyncio.to_thread(self._add, zone, normalized)

    async def remove(self, zone: str, address: str) -> str:
        zone, normalized = self._zone(zone), self._address(address)
        async with self._lock:
            await asyncio.to_thread(self._remove, zone, normalized)
        return normalized

    async def check(self, zone: str, address: str) -> Check:
        zone, normalized = self._zone(zone), self._address(address)
        async with self._lock:
            return await asyncio.to_thread(self._check, zone, normalized)
