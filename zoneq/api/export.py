"""NDJSON exports for ``zoneq export``: the event log after a watermark, and the queue.

Both are read from one LevelDB snapshot (``zoneq.storage.export``), so an export made while
mail flows is one consistent moment.  Lines are sent in batches, awaiting the socket between
them: a slow reader holds the export back (TCP flow control), never the whole log in memory.
An event record that does not decode is logged here and sent as a skip marker line
(``zoneq.storage.export.event_records``) in its place: the stream goes on, and the client
counts it and moves its watermark past it.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any, Final

from aiohttp import web

from zoneq.api.browse import client_id
from zoneq.api.context import context
from zoneq.storage.export import event_records, queue_records

BATCH: Final = 500


async def _ndjson(request: web.Request, records: Iterator[dict[str, Any]]) -> web.StreamResponse:
    response = web.StreamResponse(headers={"Content-Type": "application/x-ndjson"})
    await response.prepare(request)
    lines: list[str] = []
    for record in records:
        lines.append(json.dumps(record, separators=(",", ":")))
        if len(lines) >= BATCH:
            await response.write(("\n".join(lines) + "\n").encode())
            lines.clear()
    if lines:
        await response.write(("\n".join(lines) + "\n").encode())
    await response.write_eof()
    return response


async def events(request: web.Request) -> web.StreamResponse:
    """``?after=<16-hex event id>``: only events after that one (the last export's end)."""
    ctx = context(request)
    after_text = request.query.get("after")
    after = None if not after_text else client_id(after_text, "after")
    with ctx.store.database.snapshot() as snapshot:
        return await _ndjson(request, event_records(ctx.store, after=after, snapshot=snapshot))


async def queue(request: web.Request) -> web.StreamResponse:
    ctx = context(request)
    with ctx.store.database.snapshot() as snapshot:
        records = queue_records(ctx.store, now_ms=ctx.clock(), snapshot=snapshot)
        return await _ndjson(request, records)
