"""Filters that do not narrow are refused, naming the field, before anything changes: an
empty string (which used to count as no filter at all) and an age too small to select
anything but the whole queue.  And a message's hold says what it will hold on return."""

from __future__ import annotations

from typing import Any

import pytest

from tests.api.conftest import api_running, async_test
from tests.storage.conftest import T0, assert_consistent, queue_message
from zoneq.protocol.ids import format_id
from zoneq.queue.service import RecipientOutcome, Result
from zoneq.storage.base import Outcome
from zoneq.storage.records import State
from zoneq.storage.store import QueueStore

pytestmark = pytest.mark.integration

Z = "default"

REFUSED: list[tuple[str, dict[str, Any], str]] = [
    ("an age of zero", {"older_than": "0"}, "older_than: '0' is under an hour"),
    ("zero seconds", {"older_than": "0s"}, "older_than: '0s' is under an hour"),
    ("a minute short of an hour", {"older_than": "59m"}, "older_than: '59m' is under an hour"),
    ("an empty age", {"older_than": ""}, "older_than: "),
    ("an empty zone", {"zone": ""}, "zone: "),
    ("an empty sender domain", {"zone": Z, "sender_domain": ""}, "sender_domain: "),
    ("a blank recipient domain", {"zone": Z, "recipient_domain": "  "}, "recipient_domain: "),
    ("the root as a domain", {"zone": Z, "recipient_domain": "."}, "recipient_domain: "),
]


@pytest.mark.parametrize(
    ("selection", "message"), [(s, m) for _, s, m in REFUSED], ids=[i for i, _, _ in REFUSED]
)
@async_test
async def test_purge_refuses_a_filter_that_does_not_narrow(
    store: QueueStore, selection: dict[str, Any], message: str
) -> None:
    await queue_message(store, [("a@ok.test", Z), ("b@other.test", Z)])
    async with api_running(store) as api:
        status, body = await api.call("POST", "/api/v1/queue/purge", json=selection)
        assert status == 400, body
        assert body["error"]["message"].startswith(message), body
    assert store.count(Z, State.READY) == 2  # nothing purged


ALLOWED: list[tuple[str, dict[str, Any], int]] = [
    ("an age of an hour", {"older_than": "1h"}, 0),  # everything here is younger
    ("a small age with all", {"older_than": "0", "all": True}, 2),
    ("a small age within a zone", {"zone": Z, "older_than": "0"}, 2),
    ("a domain with its root dot", {"zone": Z, "recipient_domain": "OK.test."}, 1),
]


@pytest.mark.parametrize(
    ("selection", "count"), [(s, c) for _, s, c in ALLOWED], ids=[i for i, _, _ in ALLOWED]
)
@async_test
async def test_purge_takes_a_filter_that_narrows_or_all(
    store: QueueStore, selection: dict[str, Any], count: int
) -> None:
    await queue_message(store, [("a@ok.test", Z), ("b@other.test", Z)])
    async with api_running(store) as api:
        api.clock.now += 60_000  # a minute after they were queued
        status, body = await api.call("POST", "/api/v1/queue/purge", json=selection)
        assert (status, body) == (200, {"count": count})
    assert store.count(Z, State.READY) == 2 - count
    await assert_consistent(store)


@async_test
async def test_retry_of_a_zone_refuses_an_empty_domain(store: QueueStore) -> None:
    await queue_message(store, [("a@ok.test", Z)])
    (lease,) = store.lease(Z, 1, "test")
    await store.defer(lease, T0, T0 + 3_600_000, Outcome(reply="451 4.3.0 later"))
    async with api_running(store) as api:
        for empty in ("", ".", " "):
            path = "/api/v1/zones/default/retry"
            status, body = await api.call("POST", path, params={"domain": empty})
            assert status == 400 and body["error"]["message"].startswith("domain: "), body
        assert store.count(Z, State.DEFERRED) == 1  # not retried
        status, body = await api.call("POST", path, params={"domain": "OK.test."})
        assert (status, body) == (200, {"count": 1})


@async_test
async def test_a_message_hold_counts_those_on_the_wire(store: QueueStore) -> None:
    msg = await queue_message(store, [("a@one.test", Z), ("b@one.test", Z), ("c@two.test", Z)])
    path = f"/api/v1/messages/{format_id(msg)}/hold"
    async with api_running(store) as api:
        jobs = await api.service.lease(Z, "w1", max_jobs=5)
        (job,) = [j for j in jobs if j.domain == "one.test"]
        (other,) = [j for j in jobs if j.domain == "two.test"]
        await api.service.report(
            "w1", [RecipientOutcome(other.recipients[0].token, Result.RETURNED)]
        )
        status, body = await api.call("POST", path, json={"reason": "audit"})
        assert (status, body) == (200, {"count": 1, "on_return": 2})
        again = await api.call("POST", path)
        assert again == (200, {"count": 0, "on_return": 2})  # still on the wire: not a 409
        await api.service.report(
            "w1", [RecipientOutcome(r.token, Result.RETURNED) for r in job.recipients]
        )
        await store.drain()
        assert store.count(Z, State.HELD) == 3
        assert (await api.call("POST", path))[0] == 409  # nothing left to hold
    await assert_consistent(store)
