"""A failure's category, from the remote's reply to the event, the export files and back.

The core and a real zone worker run in this process (``tests/delivery/inproc.py``: real
store, service, IPC and ``Worker``); the remote MX is the fault server answering each RCPT
with a reply of its own; dnsmasq answers the MX lookups.  The events are then exported with
``zoneq export``'s own code and read back with pyarrow and json.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgpack
import pytest

from tests.delivery.inproc import config_for, running
from tests.export.test_export import read_export
from tests.storage.conftest import StoreFactory, async_test
from tests.support.dnsmasq import running_dnsmasq
from tests.support.faultserver import Faults, FaultServer
from zoneq.export.files import Format
from zoneq.export.run import export_events
from zoneq.export.sources import DirectorySource
from zoneq.protocol import ids
from zoneq.protocol.events import SCHEMA_VERSION
from zoneq.storage import keys
from zoneq.storage.export import event_records

SPAMHAUS = b"554 5.7.1 Service unavailable; Client host [127.0.0.1] blocked using zen.spamhaus.org"
UNKNOWN = b"550 5.1.1 <b@cat.test>: Recipient address rejected: User unknown"
# Nothing listens on this loopback address: the connection is refused, no reply comes.
NO_LISTENER = "127.0.0.77"


def _by_recipient(rows: list[dict[str, Any]]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(row["recipient"], row["kind"]): row for row in rows if row["recipient"]}


@pytest.mark.integration
@async_test
async def test_replies_give_their_rules_or_their_status_category_end_to_end(
    tmp_path: Path,
) -> None:
    faults = Faults(rcpt_replies={1: SPAMHAUS, 2: UNKNOWN, 3: b"250 2.1.5 Ok"})
    async with FaultServer(faults) as server:
        records = [
            "mx-host=cat.test,mx.cat.test,10",
            f"host-record=mx.cat.test,{server.host}",
            "mx-host=down.test,mx.down.test,10",
            f"host-record=mx.down.test,{NO_LISTENER}",
        ]
        with running_dnsmasq(records, tmp_path / "dns") as dns:
            config = config_for(tmp_path, dns, server.port, {"retry": "1h"})
            async with running(config) as core:
                await core.queue(["a@cat.test", "b@cat.test", "c@cat.test", "d@down.test"])
                await core.until(lambda: len(core.events()) >= 5)  # accepted + 4 outcomes
                events = {(e.recipient, e.kind.value): e for e in core.events()}
                source = DirectorySource(core.store)
                try:
                    for fmt in Format:
                        export_events(source, tmp_path / fmt.value, fmt)
                finally:
                    source.close()
    # The block list reply: the shipped rule defers it (our address, not the recipient)
    # and names it; the unknown user: no rule, RFC 3463 X.1 (addressing), bounced.
    assert events[("a@cat.test", "deferred")].category == "blocklisted"
    assert events[("b@cat.test", "bounced")].category == "addressing"
    assert events[("c@cat.test", "delivered")].category is None  # nothing failed
    # No reply at all (connection refused): the worker's X.4.x status, network.
    refused = events[("d@down.test", "deferred")]
    assert refused.code is None and refused.enhanced is not None
    assert refused.enhanced.startswith("4.4.") and refused.category == "network"
    for fmt in Format:
        rows = _by_recipient(read_export(tmp_path / fmt.value))
        assert {key: row["category"] for key, row in rows.items()} == {
            key: event.category for key, event in events.items() if key[0]
        }, fmt
        assert all(row["v"] == SCHEMA_VERSION for row in rows.values())


@pytest.mark.parametrize("fmt", list(Format))
@async_test
async def test_a_record_stored_before_categories_exports_with_a_null_one(
    stores: StoreFactory, tmp_path: Path, fmt: Format
) -> None:
    """Event records of schema version 1 (no ``category``) stay in databases written by an
    older zoneq: they decode, export as version 2 rows with a null category, and are not
    refused or skipped."""
    store = stores.open()
    old = {
        "v": 1,
        "kind": "deferred",
        "time_ms": 1_700_000_000_000,
        "zone": "bulk",
        "message_id": ids.format_id(42),
        "recipient": "old@example.test",
        "domain": "example.test",
        "queued_at_ms": 1_699_999_000_000,
        "size": 100,
        "attempt": 1,
        "mx": "mx.example.test",
        "source_ip": None,
        "code": 451,
        "enhanced": "4.3.0",
        "text": "451 4.3.0 Try again later",
        "possible_duplicate": False,
        "recipients": 1,
    }
    event_id = ids.IdGenerator().next(1_700_000_000_000)
    store.database.write([(keys.event(event_id), msgpack.packb(old))], sync=True)
    [record] = list(event_records(store))
    assert record == {**old, "v": SCHEMA_VERSION, "category": None, "id": ids.format_id(event_id)}
    source = DirectorySource(store)
    try:
        export_events(source, tmp_path / "out", fmt)
    finally:
        source.close()
    assert read_export(tmp_path / "out") == [record]
