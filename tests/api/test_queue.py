"""Reading and changing the queue through the API, checked against the store on disk:
counts (and the counters against a full recount after every operation), browse at depth,
delete, purge by filter, retry, hold and release, pause and resume."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

import pytest

from tests.api.conftest import Api, Clock, api_running, async_test
from tests.storage.conftest import (
    MINUTE,
    T0,
    StoreFactory,
    assert_consistent,
    queue_message,
)
from zoneq.protocol.ids import format_id, id_time_ms
from zoneq.protocol.retry import parse_duration
from zoneq.queue.admin import QueueAdmin
from zoneq.queue.service import QueueService
from zoneq.storage.base import Outcome
from zoneq.storage.records import NewRecipient, State
from zoneq.storage.store import QueueStore

pytestmark = pytest.mark.integration

HOUR = 60 * MINUTE


async def defer_all(store: QueueStore, zone: str, now: int = T0) -> int:
    """Lease every ready recipient of ``zone`` and defer it an hour."""
    leases = store.lease(zone, 100_000, "test")
    for lease in leases:
        await store.defer(lease, now, now + HOUR, Outcome(reply="451 4.3.0 try later"))
    return len(leases)


def states(body: dict[str, Any], zone: str) -> dict[str, int]:
    counts = body["zones"][zone]
    return {s: counts[s] for s in ("ready", "leased", "deferred", "held")}


async def counts(api: Api, zone: str = "default") -> dict[str, int]:
    status, body = await api.call("GET", "/api/v1/queue")
    assert status == 200
    return states(body, zone)


@async_test
async def test_counts_and_show_follow_the_store(store: QueueStore) -> None:
    one = await queue_message(store, [("a@ok.test", "default"), ("b@ok.test", "default")])
    await queue_message(store, [("c@other.test", "bulk")])
    await defer_all(store, "bulk")
    async with api_running(store) as api:
        assert await counts(api) == {"ready": 2, "leased": 0, "deferred": 0, "held": 0}
        assert await counts(api, "bulk") == {"ready": 0, "leased": 0, "deferred": 1, "held": 0}
        status, shown = await api.call("GET", f"/api/v1/messages/{format_id(one)}")
        assert status == 200
        assert shown["sender"] == "sender@example.org"
        assert {r["address"]: r["state"] for r in shown["recipients"]} == {
            "a@ok.test": "ready",
            "b@ok.test": "ready",
        }
        status, domains = await api.call("GET", "/api/v1/zones/bulk/domains?state=deferred")
        assert domains == {"other.test": 1}
        assert (await api.call("GET", "/api/v1/messages/00000000000000ff"))[0] == 404
        assert (await api.call("GET", "/api/v1/zones/nozone/recipients"))[0] == 404
        assert (await api.call("GET", "/api/v1/zones/default/recipients?state=x"))[0] == 400
        assert (await api.call("GET", "/api/v1/zones/default/recipients?limit=0"))[0] == 400


@async_test
async def test_browse_pages_through_20k_recipients_without_gaps_or_duplicates(
    store: QueueStore,
) -> None:
    expected = []
    for n in range(20):  # 20 messages of 1,000 recipients
        rcpts = [(f"r{n:02d}-{i:04d}@d{i % 7}.test", "default") for i in range(1000)]
        msg_id = await queue_message(store, rcpts, now_ms=T0 + n)
        expected += [(format_id(msg_id), a) for a, _ in sorted(rcpts)]
    leased = store.lease("default", 10, "worker")  # some are with a worker right now
    async with api_running(store) as api:
        seen: list[tuple[str, str]] = []
        states_seen: set[str] = set()
        cursor = first_cursor = ""
        pages = 0
        while True:
            query = f"?limit=997&cursor={cursor}" if cursor else "?limit=997"
            status, page = await api.call("GET", f"/api/v1/zones/default/recipients{query}")
            assert status == 200, page
            seen += [(r["message_id"], r["address"]) for r in page["recipients"]]
            states_seen |= {r["state"] for r in page["recipients"]}
            pages += 1
            cursor = page["cursor"]
            first_cursor = first_cursor or cursor
            if not cursor:
                break
        assert pages == 21
        assert seen == expected  # oldest message first, every recipient once
        assert states_seen == {"ready", "leased"}
        status, page = await api.call(
            "GET", "/api/v1/zones/default/recipients?state=leased&limit=1000"
        )
        assert len(page["recipients"]) == len(leased) == 10
        # A cursor of another listing is refused rather than paging the wrong thing.
        status, other = await api.call(
            "GET", "/api/v1/zones/bulk/recipients?cursor=" + first_cursor
        )
        assert status == 400, other
        status, _ = await api.call("GET", "/api/v1/zones/default/recipients?state=held&cursor=AAAA")
        assert status == 400


@async_test
async def test_delete_a_message_and_one_recipient(store: QueueStore) -> None:
    one = await queue_message(store, [("a@ok.test", "default"), ("b@ok.test", "default")])
    two = await queue_message(store, [("c@ok.test", "default")])
    async with api_running(store) as api:
        status, body = await api.call(
            "DELETE", f"/api/v1/messages/{format_id(one)}", params={"recipient": "a@ok.test"}
        )
        assert (status, body) == (200, {"count": 1})
        assert [q.recipient.address for q in store.recipients(one)] == ["b@ok.test"]
        status, body = await api.call("DELETE", f"/api/v1/messages/{format_id(two)}")
        assert (status, body) == (200, {"count": 1})
        assert store.message_count() == 1
        assert (await api.call("DELETE", f"/api/v1/messages/{format_id(two)}"))[0] == 404
        assert (await api.call("DELETE", "/api/v1/messages/nothex"))[0] == 400
    await assert_consistent(store)


async def purge_bed(store: QueueStore) -> dict[str, list[int]]:
    """Messages across zones, sender and recipient domains, states and ages."""
    ids: dict[str, list[int]] = {"old": [], "new": []}
    for age, when in (("old", T0 - 5 * HOUR), ("new", T0)):
        for sender in ("news@src.test", "shop@other.test"):
            for zone in ("default", "bulk"):
                rcpts = [(f"u{i}@{d}", zone) for i in range(3) for d in ("ok.test", "b.test")]
                msg = await queue_message(store, rcpts, now_ms=when, sender=sender)
                ids[age].append(msg)
    await defer_all(store, "bulk", T0)
    # hold one "new" default message: a held state to purge by
    await store.hold(ids["new"][0])
    return ids


PURGES: list[tuple[dict[str, Any], int]] = [
    # (filter, recipients removed) out of 48: 8 messages x 6 recipients
    ({"zone": "bulk"}, 24),
    ({"state": "deferred"}, 24),
    ({"state": "held"}, 6),
    ({"sender_domain": "other.test"}, 24),
    ({"recipient_domain": "b.test"}, 24),
    ({"older_than": "1h"}, 24),
    ({"zone": "default", "recipient_domain": "ok.test", "sender_domain": "src.test"}, 6),
    ({"zone": "default", "state": "ready", "older_than": "4h"}, 12),
    ({"all": True}, 48),
]


@pytest.mark.parametrize(("selection", "removed"), PURGES)
@async_test
async def test_purge_by_filter(
    stores: StoreFactory, selection: dict[str, Any], removed: int
) -> None:
    store = stores.open()
    await purge_bed(store)
    before = store.recount()
    async with api_running(store) as api:
        status, body = await api.call("POST", "/api/v1/queue/purge", json=selection)
        assert (status, body) == (200, {"count": removed})
    await assert_consistent(store)
    left = sum(
        v for k, v in store.recount().items() if b"domain-" not in k and b"messages" not in k
    )
    total = sum(v for k, v in before.items() if b"domain-" not in k and b"messages" not in k)
    assert total - left == removed
    # Every surviving recipient fails the filter: nothing that matched was left behind.
    for zone in ("default", "bulk"):
        for state in (State.READY, State.DEFERRED, State.HELD):
            for record in store.browse(zone, state, limit=1000)[0]:
                meta = store.message(record.msg_id)
                older = selection.get("older_than")
                cutoff = T0 - parse_duration(older) if older else None
                matches = (
                    selection.get("zone", zone) == zone
                    and selection.get("state", state.value) == state.value
                    and selection.get("recipient_domain", record.domain) == record.domain
                    and selection.get("sender_domain", meta.sender.split("@")[1])
                    == meta.sender.split("@")[1]
                    and (cutoff is None or id_time_ms(record.msg_id) < cutoff)
                )
                assert not matches, (selection, record)
    # Messages without recipients are gone with their last one.
    assert store.message_count() == len({r.msg_id for z in ("default", "bulk") for s in State
                                         if s is not State.LEASED
                                         for r in store.browse(z, s, limit=1000)[0]})  # fmt: skip


@async_test
async def test_purge_refuses_no_filter_and_unknown_input(store: QueueStore) -> None:
    await queue_message(store, [("a@ok.test", "default")])
    async with api_running(store) as api:
        for bad in ({}, {"state": "leased"}, {"older_than": "soon"}, {"zone": "nozone"}, {"x": 1}):
            status, body = await api.call("POST", "/api/v1/queue/purge", json=bad)
            assert status in (400, 404), (bad, body)
        assert store.message_count() == 1


@async_test
async def test_retry_message_domain_and_zone(store: QueueStore) -> None:
    m1 = await queue_message(store, [("a@ok.test", "default"), ("b@b.test", "default")])
    m2 = await queue_message(store, [("c@ok.test", "default"), ("d@b.test", "default")])
    await defer_all(store, "default")
    async with api_running(store) as api:
        assert await counts(api) == {"ready": 0, "leased": 0, "deferred": 4, "held": 0}
        status, body = await api.call("POST", f"/api/v1/messages/{format_id(m1)}/retry")
        assert (status, body) == (200, {"count": 2})
        status, body = await api.call("POST", f"/api/v1/messages/{format_id(m1)}/retry")
        assert status == 409  # nothing deferred any more
        status, body = await api.call("POST", "/api/v1/domains/b.test/retry")
        assert body == {"count": 1}  # d@b.test; b@b.test was ready already
        assert await counts(api) == {"ready": 3, "leased": 0, "deferred": 1, "held": 0}
        status, body = await api.call("POST", "/api/v1/zones/default/retry")
        assert body == {"count": 1}
        ready = store.browse("default", State.READY)[0]
        assert {r.address for r in ready} == {"a@ok.test", "b@b.test", "c@ok.test", "d@b.test"}
        assert all(r.next_attempt_ms == 0 and r.attempts == 1 for r in ready)
        assert m2
    await assert_consistent(store)


@async_test
async def test_retry_counts_recipients_on_the_wire(store: QueueStore) -> None:
    """A leased recipient is counted (its deferral will be due now), so a message with one
    on the wire is no 409; one with only a ready recipient, not leased, still is."""
    wire = await queue_message(store, [("a@ok.test", "default")])
    idle = await queue_message(store, [("b@b.test", "default")])
    (lease,) = store.lease("default", 1, "test")
    assert lease.recipient.msg_id == wire
    async with api_running(store) as api:
        status, body = await api.call("POST", f"/api/v1/messages/{format_id(wire)}/retry")
        assert (status, body) == (200, {"count": 1})
        status, body = await api.call("POST", f"/api/v1/messages/{format_id(idle)}/retry")
        assert status == 409 and "nothing on the wire" in body["error"]["message"]
        assert (await api.call("POST", "/api/v1/zones/default/retry"))[1] == {"count": 1}
        assert (await api.call("POST", "/api/v1/domains/ok.test/retry"))[1] == {"count": 1}
        assert (await api.call("POST", "/api/v1/domains/b.test/retry"))[1] == {"count": 0}
        await store.defer(lease, T0, T0 + HOUR, Outcome(reply="451 4.3.0 try later"))
        assert await counts(api) == {"ready": 2, "leased": 0, "deferred": 0, "held": 0}
    await assert_consistent(store)


@async_test
async def test_hold_and_release_a_message(store: QueueStore) -> None:
    msg = await queue_message(store, [("a@ok.test", "default"), ("b@ok.test", "default")])
    path = f"/api/v1/messages/{format_id(msg)}"
    async with api_running(store) as api:
        status, body = await api.call("POST", path + "/hold", json={"reason": "complaint #7"})
        assert (status, body) == (200, {"count": 2, "on_return": 0})
        assert {q.recipient.hold_reason for q in store.recipients(msg)} == {"complaint #7"}
        assert (await api.call("POST", path + "/hold"))[0] == 409
        status, body = await api.call("POST", path + "/release")
        assert (status, body) == (200, {"count": 2, "on_return": 0})
        assert (await api.call("POST", path + "/release"))[0] == 409
        assert await counts(api) == {"ready": 2, "leased": 0, "deferred": 0, "held": 0}
    await assert_consistent(store)


@async_test
async def test_hold_zone_takes_back_what_the_service_leased_ahead(store: QueueStore) -> None:
    """Recipients the service planned into jobs but has not handed out are held too (they
    must not go out); the one already with a worker finishes its attempt."""
    for n in range(3):
        await queue_message(store, [(f"r{n}@ok.test", "default"), (f"s{n}@b.test", "default")])
    async with api_running(store) as api:
        jobs = await api.service.lease("default", "worker-1", max_jobs=1)
        assert len(jobs) == 1 and store.leased("default") > len(jobs[0].recipients)
        status, body = await api.call("POST", "/api/v1/zones/default/hold")
        assert status == 200
        assert body["count"] == 6 - len(jobs[0].recipients)
        assert await api.service.lease("default", "worker-2", max_jobs=5) == []
        status, body = await api.call("POST", "/api/v1/zones/default/release")
        assert body["count"] == 6 - len(jobs[0].recipients)
        again = await api.service.lease("default", "worker-2", max_jobs=10)
        assert sum(len(j.recipients) for j in again) == 6 - len(jobs[0].recipients)
    await assert_consistent(store)


@async_test
async def test_pause_stops_leases_and_survives_a_restart(stores: StoreFactory) -> None:
    store = stores.open()
    await queue_message(store, [("a@ok.test", "default")])
    async with api_running(store) as api:
        planned = await api.service.lease("bulk", "w", max_jobs=1)  # another zone: unaffected
        assert planned == []
        status, body = await api.call("POST", "/api/v1/zones/default/pause")
        assert body == {"zone": "default", "paused": True}
        assert await api.service.lease("default", "w", max_jobs=1, wait_ms=50) == []
        # New mail for a paused zone still queues.
        status, _ = await api.call(
            "POST", "/api/v1/messages", json={"from": "a@src.test", "to": ["n@ok.test"]}
        )
        assert status == 201
        status, queue = await api.call("GET", "/api/v1/queue")
        assert queue["zones"]["default"]["paused"] is True
        assert queue["zones"]["default"]["ready"] == 2
        assert (await api.call("POST", "/api/v1/zones/nozone/pause"))[0] == 404
    await store.close()
    reopened = stores.open()
    async with api_running(reopened) as api:
        assert api.service.paused() == {"default"}
        assert await api.service.lease("default", "w", max_jobs=1) == []
        status, body = await api.call("POST", "/api/v1/zones/default/resume")
        assert body == {"zone": "default", "paused": False}
        jobs = await api.service.lease("default", "w", max_jobs=5)
        assert sum(len(j.recipients) for j in jobs) == 2
    await reopened.close()
    assert stores.open().paused_zones() == set()


@async_test
async def test_a_big_purge_leaves_the_event_loop_free(store: QueueStore) -> None:
    """50,000 recipients purged in batches of 1,000: the loop is never blocked for long (the
    longest stall is a small part of the whole purge)."""
    for n in range(50):
        rcpts: Sequence[NewRecipient] = [
            NewRecipient(f"u{i}@d{i % 50}.test", "default") for i in range(1000)
        ]
        await queue_message(store, rcpts, now_ms=T0 + n)
    service = QueueService.from_config(store, _config(), clock=Clock())
    admin = QueueAdmin(store, service, ["default"], clock=Clock(), batch=1000)
    gaps: list[float] = []
    done = asyncio.Event()

    async def ticker() -> None:
        last = time.perf_counter()
        while not done.is_set():
            await asyncio.sleep(0.001)
            now = time.perf_counter()
            gaps.append(now - last)
            last = now

    tick = asyncio.create_task(ticker())
    begun = time.perf_counter()
    from zoneq.queue.admin import Selection

    removed = await admin.purge(Selection(zone="default"))
    took = time.perf_counter() - begun
    done.set()
    await tick
    print(f"purge of 50,000: {took:.2f} s, longest loop stall {max(gaps) * 1000:.1f} ms")
    assert removed == 50_000
    assert store.message_count() == 0
    assert len(gaps) > 20, "the loop ran between batches"
    assert max(gaps) < max(0.25 * took, 0.05), (max(gaps), took)
    await assert_consistent(store)


def _config():  # type: ignore[no-untyped-def]
    from tests.api.conftest import make_config

    return make_config()
