"""A U-label domain and its A-label are one destination, on a real store.

``bob@bücher.example`` and ``ann@xn--bcher-kva.example`` share one per-domain count, one
job queue and connection limit, and one purge or retry by either form; records queued
before domains were normalised (U-label in their value and in their counters) join them
when the store opens.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from tests.queue.test_service import Clock, outcome
from tests.storage.conftest import StoreFactory, assert_consistent, async_test, queue_message
from zoneq.config import loads_config
from zoneq.queue.admin import QueueAdmin, Selection
from zoneq.queue.routing import Route, Router
from zoneq.queue.service import QueueService, Result
from zoneq.storage import keys
from zoneq.storage.counters import _VALUE
from zoneq.storage.records import Recipient, State
from zoneq.storage.store import QueueStore

U_LABEL = "bücher.example"
A_LABEL = "xn--bcher-kva.example"
BOTH = (f"bob@{U_LABEL}", f"ann@{A_LABEL}", "cy@BÜCHER.Example")
CONFIG = f'[zones.default]\n[zones.bounces]\n[delivery]\ndomain_limits = {{ "{U_LABEL}" = 1 }}\n'


def world(store: QueueStore) -> tuple[QueueService, QueueAdmin]:
    clock = Clock()
    service = QueueService(store, loads_config(CONFIG), hostname="mx.zoneq.test", clock=clock)
    return service, QueueAdmin(store, service, ["default", "bounces"], clock=clock)


async def queue_each(store: QueueStore) -> None:
    for address in BOTH:  # one message each: one job each, unless the domain limit says no
        await queue_message(store, [(address, "default")])


@async_test
async def test_both_forms_share_one_count_and_keep_the_address_as_given(
    store: QueueStore,
) -> None:
    await queue_each(store)
    assert store.domain_counts("default", State.READY) == {A_LABEL: 3}
    # Leased is kept in memory, not in counters: counted from the leases out, in one form.
    assert store.domain_counts("default", State.LEASED) == {}
    leases = store.lease("default", 2, "w1")
    assert store.domain_counts("default", State.LEASED) == {A_LABEL: 2}
    assert store.domain_counts("bounces", State.LEASED) == {}
    for lease in leases:
        store.release(lease)
    for form in (U_LABEL, A_LABEL, "Bücher.EXAMPLE"):
        assert store.domain_count("default", form, State.READY) == 3
    queued, _ = store.browse("default", State.READY, limit=10)
    assert sorted(r.address for r in queued) == sorted(BOTH)  # RCPT TO goes out unchanged
    assert {r.domain for r in queued} == {A_LABEL}
    await assert_consistent(store)


@async_test
async def test_both_forms_share_one_job_queue_and_connection_limit(store: QueueStore) -> None:
    service, _ = world(store)
    await queue_each(store)
    # domain_limits names the U-label with a limit of 1: one job at a time for all three.
    (job,) = await service.lease("default", "w1", max_jobs=10)
    assert job.domain == A_LABEL  # the name the MX lookup asks (dnspython: A-labels)
    assert await service.lease("default", "w1", max_jobs=10) == []
    await service.report("w1", outcome(job, Result.DELIVERED))
    (following,) = await service.lease("default", "w1", max_jobs=10)
    assert following.domain == A_LABEL
    await service.report("w1", outcome(following, Result.DELIVERED))
    await assert_consistent(store)


@pytest.mark.parametrize("form", [U_LABEL, A_LABEL, "BÜCHER.example."])
@async_test
async def test_one_purge_by_either_form_removes_both(store: QueueStore, form: str) -> None:
    _, admin = world(store)
    await queue_each(store)
    await queue_message(store, [("dee@other.example", "default")])
    assert await admin.purge(Selection(recipient_domain=form)) == 3
    assert store.domain_counts("default", State.READY) == {"other.example": 1}
    await assert_consistent(store)


def _make_old(store: QueueStore, msg_id: int, address: str, zone: str) -> None:
    """Rewrite a recipient as zoneq wrote it before domains were normalised: its value
    and its per-domain counter under the lower-cased U-label."""
    key = keys.record(keys.READY, zone, msg_id, address)
    value = store.database.get(key)
    assert value is not None
    record = Recipient.decode(key, zone, msg_id, address, value)
    old_domain = address.rpartition("@")[2].lower()
    counter = keys.counter("domain-ready", zone, A_LABEL)
    old_counter = keys.counter("domain-ready", zone, old_domain)
    count = _VALUE.unpack(store.database.get(counter) or b"")[0]
    store.database.write(
        [
            (key, replace(record, domain=old_domain).encode()),
            (counter, None),
            (old_counter, _VALUE.pack(count)),
        ],
        sync=True,
    )


@async_test
async def test_records_queued_before_normalisation_are_counted_and_purged_with_the_rest(
    stores: StoreFactory,
) -> None:
    store = stores.open()
    old_id = await queue_message(store, [(f"bob@{U_LABEL}", "default")])
    await store.close()
    store = stores.open()
    _make_old(store, old_id, f"bob@{U_LABEL}", "default")
    await store.close()
    store = stores.open()  # the counters are folded when the store opens
    assert store.domain_counts("default", State.READY) == {A_LABEL: 1}
    (old,), _ = store.browse("default", State.READY, limit=10)
    assert old.domain == U_LABEL  # the record itself is not rewritten
    await queue_message(store, [(f"ann@{A_LABEL}", "default")])
    assert store.domain_count("default", U_LABEL, State.READY) == 2
    await assert_consistent(store)
    _, admin = world(store)
    assert await admin.purge(Selection(recipient_domain=A_LABEL)) == 2
    assert store.domain_counts("default", State.READY) == {}
    await assert_consistent(store)


@pytest.mark.parametrize(
    ("rule", "recipient"),
    [
        (U_LABEL, f"bob@{A_LABEL}"),
        (A_LABEL, f"bob@{U_LABEL}"),
        ("." + U_LABEL, "bob@mail.XN--BCHER-KVA.example"),
        ("." + A_LABEL, "bob@mail.Bücher.example."),
    ],
)
def test_a_routing_rule_in_either_form_routes_both(rule: str, recipient: str) -> None:
    config = loads_config(
        CONFIG + f'[zones.books]\n[[routing.rules]]\nrecipient_domain = ["{rule}"]\n'
        'zone = "books"\n'
    )
    assert Router.from_config(config).decide(recipient) == Route("books", "recipient_domain")
