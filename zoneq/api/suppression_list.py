"""The suppression list as the API edits it: the list the suppression plugin reads.

The plugin module owns the list's files and format (``plugins/suppression.py``: a JSON
snapshot plus a journal of changes, ``shared_list``, ``normalize``); this module loads that
module the way the plugin host does (``[plugins.suppression]``, its ``module`` and
``options.file``), so the API and the plugin cannot disagree on what the list says or how
addresses compare.  In the core both use the module's one ``SuppressionList`` of the file:
one parsed copy, and a change the API makes is seen by the next RCPT without a read.

Every operation runs under one ``asyncio.Lock``: the API runs in the core process only, so
that lock serialises every change and no concurrent add is lost.  The work (normalising
the addresses, the journal's append and fsync, a listing's sort) runs in a thread, in
chunks the event loop can run between.  When the journal has outgrown the snapshot, a
background task folds it in, under the same lock.  An operator's edit of the snapshot (by
rename, as the plugin asks) is picked up by the next call.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import ClassVar, Final, Protocol, cast

from zoneq.config import Config
from zoneq.config.plugins import PluginImportError, import_plugin, plugin_options
from zoneq.errors import ConfigError, NotFound, TemporaryFailure
from zoneq.queue.intake import check_address

__all__ = [
    "ALL_ZONES",
    "PLUGIN",
    "Check",
    "Page",
    "SuppressionLists",
    "Unavailable",
    "Uncertain",
]

log = logging.getLogger("zoneq.api")

PLUGIN: Final = "suppression"
ALL_ZONES: Final = "*"


class Unavailable(TemporaryFailure):
    """The list's file cannot be read or written now (missing directory, broken JSON, a
    full disk): the operator's to fix; nothing was changed."""

    outcome: ClassVar[str] = "nothing was changed"
    """What the failed request did to the list, for its answer."""


class Uncertain(Unavailable):
    """A change written but neither made durable nor taken back (the plugin's
    ``JournalUncertain``): readers may apply it or not."""

    outcome: ClassVar[str] = "the change may or may not have been kept"


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


class SharedList(Protocol):
    """What the API asks of the plugin module's ``SuppressionList``."""

    def reload_if_changed(self) -> None: ...
    def holds(self, zone: str, address: str) -> bool: ...
    def window(self, zone: str, after: str | None, limit: int) -> tuple[list[str], int]: ...
    def add(self, zone: str, addresses: Iterable[str]) -> tuple[int, int]: ...
    def remove(self, zone: str, address: str) -> bool: ...
    def wants_fold(self) -> bool: ...
    def fold(self) -> None: ...


@dataclass(frozen=True, slots=True)
class _Format:
    """The plugin module's functions, typed."""

    shared: Callable[[Path], SharedList]
    save: Callable[[Path, dict[str, list[str]]], None]
    normalize: Callable[[str], str]
    uncertain: type[OSError]

    @classmethod
    def of(cls, module: ModuleType) -> _Format:
        names = ("shared_list", "save_file", "normalize", "JournalUncertain")
        missing = [n for n in names if not callable(getattr(module, n, None))]
        if missing:
            raise ConfigError(
                f"plugins.{PLUGIN}",
                f"{module.__name__} has no {', '.join(missing)}: not a suppression plugin "
                "the API can manage",
            )
        return cls(
            shared=cast(Callable[[Path], SharedList], module.shared_list),
            save=cast(Callable[[Path, dict[str, list[str]]], None], module.save_file),
            normalize=cast(Callable[[str], str], module.normalize),
            uncertain=cast(type[OSError], module.JournalUncertain),
        )


class SuppressionLists:
    """List, add, remove and check suppressed addresses per zone (``"*"``: every zone)."""

    def __init__(self, path: Path, file_format: _Format, zones: Iterable[str]) -> None:
        self.path = path
        self._format = file_format
        self._zones = frozenset(zones)
        self._lock = asyncio.Lock()
        self._folding: asyncio.Task[None] | None = None

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

    def _list(self, *, create: bool = False) -> SharedList | None:
        """The list, caught up with its files; in a thread, locked.  None when the file does
        not exist (an empty list), unless ``create``: then an empty file is written."""
        try:
            listed = self._format.shared(self.path)
            listed.reload_if_changed()
        except FileNotFoundError:
            if not create:
                return None
            try:
                self._format.save(self.path, {})
            except OSError as exc:
                raise Unavailable(f"suppression list {self.path} not written: {exc}") from exc
            return self._list()
        except OSError as exc:
            raise Unavailable(f"suppression list {self.path}: {exc}") from exc
        except ValueError as exc:
            raise Unavailable(f"suppression list {exc}") from exc
        return listed

    def _page(self, zone: str, cursor: str | None, limit: int) -> Page:
        listed = self._list()
        if listed is None:
            return Page([], None, 0)
        chunk, total = listed.window(zone, cursor, limit + 1)
        more = len(chunk) > limit
        return Page(chunk[:limit], chunk[limit - 1] if more else None, total)

    def _add(self, zone: str, addresses: Sequence[str]) -> tuple[int, int, bool]:
        normalized = [self._address(a) for a in addresses]  # all checked before any is kept
        listed = self._list(create=True)
        assert listed is not None
        try:
            added, total = listed.add(zone, normalized)
        except OSError as exc:
            raise self._not_written(exc) from exc
        return added, total, listed.wants_fold()

    def _remove(self, zone: str, address: str) -> bool:
        listed = self._list()
        try:
            if listed is None or not listed.remove(zone, address):
                raise NotFound(f"{address} is not on the suppression list of {zone}")
        except OSError as exc:
            raise self._not_written(exc) from exc
        return listed.wants_fold()

    def _not_written(self, exc: OSError) -> Unavailable:
        if isinstance(exc, self._format.uncertain):
            return Uncertain(f"suppression list {self.path}: {exc}")
        return Unavailable(f"suppression list {self.path} not written: {exc}")

    def _check(self, zone: str, address: str) -> Check:
        listed = self._list()
        names = [zone] if zone == ALL_ZONES else [ALL_ZONES, zone]
        return Check(address, [z for z in names if listed is not None and listed.holds(z, address)])

    def _fold(self) -> None:
        try:
            listed = self._list()
            if listed is not None and listed.wants_fold():
                listed.fold()
        except (OSError, Unavailable) as exc:  # the journal still holds every change
            log.warning("suppression list %s: journal not folded in: %s", self.path, exc)

    def _fold_later(self, wanted: bool) -> None:
        if wanted and (self._folding is None or self._folding.done()):
            self._folding = asyncio.create_task(self._fold_locked())

    async def _fold_locked(self) -> None:
        async with self._lock:
            await asyncio.to_thread(self._fold)

    # --- the operations: checked arguments, then the file work in a thread, locked ----------

    async def page(self, zone: str, cursor: str | None, limit: int) -> Page:
        zone = self._zone(zone)
        async with self._lock:
            return await asyncio.to_thread(self._page, zone, cursor, limit)

    async def add(self, zone: str, addresses: Sequence[str]) -> tuple[int, int]:
        """How many of ``addresses`` were not listed yet, and how many the zone's list holds
        now; all are checked before any is written, so one bad address changes nothing."""
        zone = self._zone(zone)
        async with self._lock:
            added, total, fold = await asyncio.to_thread(self._add, zone, addresses)
        self._fold_later(fold)
        return added, total

    async def remove(self, zone: str, address: str) -> str:
        zone, normalized = self._zone(zone), self._address(address)
        async with self._lock:
            fold = await asyncio.to_thread(self._remove, zone, normalized)
        self._fold_later(fold)
        return normalized

    async def check(self, zone: str, address: str) -> Check:
        zone, normalized = self._zone(zone), self._address(address)
        async with self._lock:
            return await asyncio.to_thread(self._check, zone, normalized)
