"""Kept connections under the core's connection slots (issue 5), against real SMTP servers.

One slot stands for one connection: a job on a slot takes the connection kept under it, a
connection taken up by a job on another slot frees its old slot, and a close is reported
only once the QUIT is done (``zoneq/delivery/transport/cache.py``).
"""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from tests.delivery.test_connection_cache import HangsUpAfterOneMessage, send
from tests.storage.conftest import async_test
from tests.support.faultserver import Faults, FaultServer
from zoneq.delivery.transport import ConnectionCache
from zoneq.protocol.replies import Verdict


async def job(server_port: int, cache: ConnectionCache, slot: int, rcpt: str = "a@ok.test") -> Any:
    """One job on ``slot``, as the worker runs it: begin, deliver, end; whether kept."""
    cache.begin(slot)
    result = await send("127.0.0.1", server_port, cache, rcpt, slot)
    assert [r.verdict for r in result.recipients] == [Verdict.DONE]
    return cache.end(slot)


@async_test
async def test_a_job_on_a_slot_takes_the_connection_kept_under_it() -> None:
    cache = ConnectionCache()
    async with FaultServer(Faults()) as server:
        assert await job(server.port, cache, 7)  # kept under 7: the report says so
        assert await job(server.port, cache, 7, "b@ok.test")
        assert len(server.sessions) == 1 and cache.reused == 1
        assert cache.released() == ()  # nothing closed, nothing to tell
        await cache.close()


@async_test
async def test_a_connection_taken_up_under_another_slot_frees_its_old_one() -> None:
    cache = ConnectionCache()
    async with FaultServer(Faults()) as server:
        assert await job(server.port, cache, 1)
        assert await job(server.port, cache, 2)  # same destination, the core said slot 2
        assert len(server.sessions) == 1
        assert cache.released() == (1,)  # rides with the next report ...
        assert not cache.urgent.is_set()  # ... not a report of its own: nothing closed
        assert not cache.end(1) and cache.end(2)
        await cache.close()


class NoticesTheOther(HangsUpAfterOneMessage):
    """A second server that notes, at each connection, what the first one had seen."""

    def __init__(self, other: FaultServer) -> None:
        super().__init__()
        self.other = other
        self.other_at_accept: list[list[bytes]] = []

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.other_at_accept.append([c[:4] for s in self.other.sessions for c in s.commands])
        await super().handle(reader, writer)


@async_test
async def test_a_slot_connection_to_elsewhere_is_closed_before_the_job_opens_another() -> None:
    cache = ConnectionCache()
    async with FaultServer(Faults()) as first:
        second = NoticesTheOther(first)
        listener = await asyncio.start_server(second.handle, "127.0.0.1", 0)
        try:
            assert await job(first.port, cache, 5)
            assert await job(listener.sockets[0].getsockname()[1], cache, 5)
            # The one under slot 5 had said QUIT before the other connection was made.
            assert second.other_at_accept == [[b"EHLO", b"MAIL", b"RCPT", b"DATA", b"QUIT"]]
            assert cache.released() == ()  # the job on slot 5 settles it, not this close
            assert len(cache) == 1
            await cache.close()
        finally:
            listener.close()
            await listener.wait_closed()


@pytest.mark.parametrize("on_the_slot", [False, True])
@async_test
async def test_an_idle_close_is_reported_at_once_once_the_quit_is_done(on_the_slot: bool) -> None:
    now = [0.0]
    cache = ConnectionCache(idle_s=5.0, clock=lambda: now[0])
    async with FaultServer(Faults()) as server:
        assert await job(server.port, cache, 3)
        if on_the_slot:
            cache.begin(3)  # the core gave slot 3 to a job meanwhile: it settles the slot
        now[0] = 6.0
        assert cache.prune() == 1
        if on_the_slot:
            await asyncio.sleep(0.1)
        else:
            await asyncio.wait_for(cache.urgent.wait(), 5.0)
        assert server.sessions[0].commands[-1] == b"QUIT"
        assert cache.released() == (() if on_the_slot else (3,))
        assert not cache.urgent.is_set()
        await cache.close()


@async_test
async def test_the_core_asks_for_closes_and_hears_back_of_each_even_one_already_gone() -> None:
    cache = ConnectionCache()
    async with FaultServer(Faults()) as server:
        assert await job(server.port, cache, 4)
        cache.close_slots([4, 99])
        assert cache.urgent.is_set()  # 99 is not here: free at once
        await asyncio.sleep(0.1)
        assert server.sessions[0].commands[-1] == b"QUIT"
        assert cache.released() == (4, 99)
        assert len(cache) == 0
        await cache.close()


@async_test
async def test_without_slots_connections_are_kept_and_nothing_is_reported() -> None:
    """A core of the previous release sends no slot (0): reuse as before, no reports."""
    cache = ConnectionCache()
    async with FaultServer(Faults()) as server:
        assert not await job(server.port, cache, 0)
        assert not await job(server.port, cache, 0)
        assert len(server.sessions) == 1 and cache.reused == 1
        cache.prune()
        assert cache.released() == ()
        await cache.close()
