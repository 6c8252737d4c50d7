"""``POST /api/v1/zones/{zone}/move`` and ``zoneq queue move``: a zone's recipients moved to
another configured zone, each in its state; those on the wire left and counted.

The API runs in-process on a real store (``conftest``); the command line and the start-up
move of a zone dropped from the config run against a real ``zoneq serve`` (smtp-sink as the
MX, dnsmasq as DNS).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.api.conftest import api_running, async_test, queue_message, store, stores
from tests.api.test_serve_cli import ok, zoneq
from tests.support.bed import ok_test_bed
from tests.support.serve import running_serve
from zoneq.storage.records import State
from zoneq.storage.store import QueueStore

__all__ = ["store", "stores"]

MOVE = "/api/v1/zones/{}/move"


@async_test
async def test_the_api_moves_a_zone_and_counts_those_on_the_wire(store: QueueStore) -> None:
    first = await queue_message(store, [("a@ok.test", "bulk"), ("b@ok.test", "bulk")])
    held = await queue_message(store, [("c@ok.test", "bulk")])
    await store.hold(held)
    async with api_running(store) as api:
        (lease,) = store.lease("bulk", 1, "worker")

        status, body = await api.call("POST", MOVE.format("bulk"), json={"to": "default"})

        assert (status, body) == (200, {"count": 2, "in_flight": 1})
        assert store.count("default", State.READY) == 1
        assert store.count("default", State.HELD) == 1
        assert store.is_leased(lease.key) and set(store.message(first).zones) == {"bulk", "default"}


@async_test
async def test_jobs_leased_ahead_and_not_handed_out_are_moved_too(store: QueueStore) -> None:
    await queue_message(store, [("a@one.test", "bulk")])
    await queue_message(store, [("b@two.test", "bulk")])
    async with api_running(store) as api:
        (_handed_out,) = await api.service.lease("bulk", "worker", max_jobs=1)
        assert store.leased("bulk") == 2  # the other job waits in the service's queue

        status, body = await api.call("POST", MOVE.format("bulk"), json={"to": "default"})

        assert (status, body) == (200, {"count": 1, "in_flight": 1})
        assert store.count("default", State.READY) == 1


@async_test
async def test_the_api_moves_one_state_only(store: QueueStore) -> None:
    await queue_message(store, [("a@ok.test", "bulk")])
    held = await queue_message(store, [("c@ok.test", "bulk")])
    await store.hold(held)
    async with api_running(store) as api:
        move = {"to": "default", "state": "held"}
        status, body = await api.call("POST", MOVE.format("bulk"), json=move)

        assert (status, body) == (200, {"count": 1, "in_flight": 0})
        assert store.count("bulk", State.READY) == 1 and store.count("default", State.HELD) == 1


@pytest.mark.parametrize(
    ("zone", "move", "status", "named"),
    [
        ("nosuch", {"to": "default"}, 404, "'nosuch'"),
        ("bulk", {"to": "nosuch"}, 404, "'nosuch'"),
        ("bulk", {"to": "bulk"}, 400, "'bulk'"),
        ("bulk", {"to": ""}, 400, "to"),
        ("bulk", {"to": "default", "state": "leased"}, 400, "state"),
        ("bulk", {}, 400, "to"),
    ],
)
@async_test
async def test_the_api_refuses_a_move_naming_why(
    store: QueueStore, zone: str, move: dict[str, str], status: int, named: str
) -> None:
    await queue_message(store, [("a@ok.test", "bulk")])
    async with api_running(store) as api:
        answer, body = await api.call("POST", MOVE.format(zone), json=move)

        assert answer == status and named in body["error"]["message"]
        assert store.count("bulk", State.READY) == 1  # nothing moved


MESSAGE = b"From: news@news.test\r\nTo: bob@ok.test\r\nSubject: {}\r\n\r\nHello.\r\n"
BULK = """
[zones.bulk]
processes = 1

[[routing.rules]]
sender_domain = ["news.test"]
zone = "bulk"
"""


@pytest.mark.integration
def test_the_command_moves_and_a_restart_without_the_zone_delivers_its_mail(
    tmp_path: Path,
) -> None:
    with ok_test_bed(tmp_path) as (sink, config):
        without = config.read_text()
        config.write_text(without + BULK)
        mails = []
        for subject in (b"ready", b"held"):
            path = tmp_path / f"{subject.decode()}.eml"
            path.write_bytes(MESSAGE.replace(b"{}", subject))
            mails.append(path)
        with running_serve(config, tmp_path / "serve.log", expected_workers=3):
            ok(config, "queue", "pause", "bulk")  # nothing leaves while the test looks
            ready, held = (ok(config, "send", str(mail)) for mail in mails)
            assert ready["zones"] == held["zones"] == ["bulk"]
            assert ok(config, "queue", "hold", held["id"])["count"] == 1

            unknown = zoneq(config, "queue", "move", "--zone", "nosuch", "--to", "default")
            assert unknown.returncode == 1 and "'nosuch'" in unknown.stderr
            assert "(404)" in unknown.stderr
            itself = zoneq(config, "queue", "move", "--zone", "bulk", "--to", "bulk")
            assert itself.returncode == 1 and "(400)" in itself.stderr
            moved = zoneq(config, "queue", "move", "--zone", "bulk", "--to", "default",
                          "--state", "held")  # fmt: skip
            assert moved.returncode == 0 and moved.stdout.strip() == "1 moved, 0 in flight left"
            assert ok(config, "queue", "counts")["zones"]["default"]["held"] == 1

        # Restarted on a config without the zone: its ready recipient goes to the default
        # zone at start-up, is delivered there; the held one stays held.
        config.write_text(without)
        with running_serve(config, tmp_path / "serve2.log"):
            delivered = sink.messages(1, timeout=30)
            assert len(delivered) == 1 and b"Subject: ready" in delivered[0].content
            counts = ok(config, "queue", "counts")["zones"]
            assert "bulk" not in counts and counts["default"]["held"] == 1
            shown = ok(config, "queue", "show", held["id"])
            assert shown["zones"] == ["default"]
        log = (tmp_path / "serve2.log").read_text()
        assert re.search(r"WARNING zone bulk is not in the config but holds ready 1,", log)
        assert "zone bulk: 1 recipient(s) moved" in log
