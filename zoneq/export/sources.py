"""Where an export reads from: the data directory (zoneq stopped) or the running core's API.

LevelDB allows one process per database, so while zoneq runs its directory is locked
(``StoreLocked``) and the export has to ask the core, which reads the same snapshot-based
records (``zoneq.storage.export``) and serves them as NDJSON over its admin API.  When
zoneq is stopped, the export opens the directory itself and reads from a snapshot.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import queue
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Final, Protocol

from zoneq.config import Config
from zoneq.export.watermark import ExportError
from zoneq.protocol.ids import format_id
from zoneq.storage import keys
from zoneq.storage.export import event_records, queue_records
from zoneq.storage.store import QueueStore

TOKEN_FILE: Final = "api.token"  # where zoneq serve puts a generated token (zoneq.api.token)
API_TIMEOUT_S: Final = 30.0
PROBE_TIMEOUT_S: Final = 5.0


class Source(Protocol):
    def events(self, after: int | None) -> Iterator[dict[str, Any]]: ...

    def queue(self, now_ms: int) -> Iterator[dict[str, Any]]: ...

    def count_events(self, after: int | None) -> int | None:
        """How many events ``events(after)`` will give, if cheaply known (for the bar)."""


class DirectorySource:
    """A queue store read from one LevelDB snapshot: a stopped zoneq's data directory
    (``open``), or any open store (the running core's API, tests)."""

    def __init__(self, store: QueueStore) -> None:
        self._store = store
        self._snapshot_cm = store.database.snapshot()
        self._snapshot = self._snapshot_cm.__enter__()

    def close(self) -> None:
        self._snapshot_cm.__exit__(None, None, None)

    @classmethod
    @contextlib.contextmanager
    def open(cls, data_dir: Path) -> Iterator[DirectorySource]:
        """Open ``data_dir`` (``StoreLocked`` when zoneq holds it: ask the API instead)."""
        if not (data_dir / "CURRENT").is_file():
            raise ExportError(f"no zoneq queue database at {data_dir} (no LevelDB CURRENT file)")
        # Not recovered: recovery writes (it sweeps orphans), and an export only reads.
        store = QueueStore.open(data_dir)
        try:
            source = cls(store)
            try:
                yield source
            finally:
                source.close()
        finally:
            asyncio.run(store.close())

    def events(self, after: int | None) -> Iterator[dict[str, Any]]:
        return event_records(self._store, after=after, snapshot=self._snapshot)

    def queue(self, now_ms: int) -> Iterator[dict[str, Any]]:
        return queue_records(self._store, now_ms=now_ms, snapshot=self._snapshot)

    def count_events(self, after: int | None) -> int | None:
        start = keys.EVENT if after is None else keys.event(after) + b"\x00"
        stop = keys.prefix_upper_bound(keys.EVENT)
        items = self._store.database.items(
            start=start, stop=stop, snapshot=self._snapshot, fill_cache=False
        )
        return sum(1 for _ in items)


@dataclass(frozen=True, slots=True)
class ApiSource:
    """The running core, through ``GET /api/v1/export/events`` and ``/export/queue``.

    The API serves the same ``zoneq.storage.export`` records from a snapshot of its own,
    as NDJSON lines, behind its bearer token.
    """

    listen: str
    token: str | None

    def events(self, after: int | None) -> Iterator[dict[str, Any]]:
        query = "" if after is None else f"?after={format_id(after)}"
        return _ndjson(f"http://{self.listen}/api/v1/export/events{query}", self.token)

    def queue(self, now_ms: int) -> Iterator[dict[str, Any]]:
        return _ndjson(f"http://{self.listen}/api/v1/export/queue", self.token)

    def count_events(self, after: int | None) -> int | None:
        return None


_END: Final = object()


def _ndjson(url: str, token: str | None) -> Iterator[dict[str, Any]]:
    """The records of an NDJSON response, streamed: aiohttp runs in a thread of its own and
    hands records over through a bounded queue, so the export's (synchronous) writer never
    holds the whole response."""
    handoff: queue.Queue[object] = queue.Queue(maxsize=10_000)
    stop = threading.Event()

    async def fetch() -> None:
        import aiohttp  # noqa: PLC0415  (only the running-core path needs it)

        headers = {"Accept": "application/x-ndjson"}
        if token:
            headers["Authorization"] = f"Bearer {token}"
        timeout = aiohttp.ClientTimeout(total=None, sock_connect=API_TIMEOUT_S)
        async with (
            aiohttp.ClientSession(timeout=timeout) as session,
            session.get(url, headers=headers) as response,
        ):
            if response.status != 200:
                body = (await response.text())[:200]
                raise ExportError(f"{url}: HTTP {response.status}: {body}")
            async for line in response.content:
                if stop.is_set():
                    return
                if line.strip():
                    handoff.put(json.loads(line))

    def run() -> None:
        try:
            asyncio.run(fetch())
            handoff.put(_END)
        except ExportError as exc:
            handoff.put(exc)
        except (TimeoutError, OSError, ValueError) as exc:
            handoff.put(ExportError(f"cannot read {url} from the running zoneq: {exc}"))
        except Exception as exc:  # aiohttp.ClientError and kin
            handoff.put(ExportError(f"cannot read {url} from the running zoneq: {exc}"))

    thread = threading.Thread(target=run, name="zoneq-export-fetch", daemon=True)
    thread.start()
    try:
        while True:
            item = handoff.get()
            if item is _END:
                return
            if isinstance(item, ExportError):
                raise item
            assert isinstance(item, dict)
            yield item
    finally:
        stop.set()
        with contextlib.suppress(queue.Empty):
            while True:
                handoff.get_nowait()  # unblock a producer waiting on a full queue
        thread.join(timeout=5)


def api_unreachable(listen: str) -> str | None:
    """Why no zoneq API answers ``GET /health`` at ``listen`` (no token needed), or None
    when one does, whatever its status (a 503 is a core whose store cannot write, which
    still serves reads).  Asked when the data directory is locked: the holder may be a
    running zoneq, or another export of a stopped one."""
    url = f"http://{listen}/health"
    try:
        with urllib.request.urlopen(url, timeout=PROBE_TIMEOUT_S):
            return None
    except urllib.error.HTTPError:
        return None  # an HTTP reply: something serves there
    except (OSError, ValueError) as exc:  # URLError is an OSError; a bad listen a ValueError
        reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
        return f"{url}: {reason}"


def api_settings(config: Config) -> tuple[str, str | None]:
    """``[api] listen`` and the bearer token: ``api.token``, the first line of
    ``api.token_file``, or the one ``zoneq serve`` generated into the data directory."""
    api = config.api
    if api.token is not None:
        return api.listen, api.token
    path = (
        Path(api.token_file)
        if api.token_file is not None
        else Path(config.server.data_dir) / TOKEN_FILE
    )
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except FileNotFoundError:
        return api.listen, None
    except OSError as exc:
        raise ExportError(f"cannot read the API token from {path}: {exc}") from exc
    return api.listen, (lines[0].strip() or None) if lines else None


__all__ = ["ApiSource", "DirectorySource", "Source", "api_settings", "api_unreachable"]
