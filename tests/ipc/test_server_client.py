"""Server and client over a real Unix socket, with a fake core handler that records calls.

pytest-asyncio is not installed: each test body runs under asyncio.run with a time limit,
so a hang fails the test instead of stalling the suite.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import stat
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from zoneq.errors import LeaseError, NotFound, ProtocolError, TemporaryFailure, ZoneqError
from zoneq.ipc.client import ConnectionLost, CoreUnavailable, IpcClient
from zoneq.ipc.framing import FrameDecoder, encode_frame
from zoneq.ipc.messages import (
    ChunkReply,
    ChunkRequest,
    CoreFailure,
    ErrorReply,
    Hello,
    Job,
    JobRecipient,
    LeaseReply,
    LeaseRequest,
    Outcome,
    RecipientReport,
    Report,
    ReportReply,
    Welcome,
    decode_reply,
    open_envelope,
    seal,
)
from zoneq.ipc.server import ConnectionInfo, IpcServer, SocketInUse

TIMEOUT = 5.0
HELLO = Hello(zone="bulk", worker="w1", pid=4242)


def run(body: Callable[[], Coroutine[Any, Any, None]]) -> None:
    async def bounded() -> None:
        await asyncio.wait_for(body(), TIMEOUT)

    asyncio.run(bounded())


async def within(awaitable: Awaitable[Any], seconds: float = 2.0) -> Any:
    return await asyncio.wait_for(awaitable, seconds)


def make_job(msg_id: int, chunks: int, tokens: tuple[int, ...] = (1,)) -> Job:
    return Job(
        msg_id=msg_id,
        sender="sender@example.org",
        size=chunks * 10,
        chunks=chunks,
        domain="example.net",
        recipients=tuple(JobRecipient(token=t, address=f"r{t}@example.net") for t in tokens),
    )


class FakeCore:
    """A CoreHandler that records what it was asked and can be told to stall or fail."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, str, object]] = []
        self.disconnects: list[ConnectionInfo] = []
        self.disconnected_event = asyncio.Event()
        self.jobs: tuple[Job, ...] = (make_job(7, 3, tokens=(11, 12)),)
        self.bodies: dict[int, list[bytes]] = {7: [b"chunk-0;", b"chunk-1;", b"chunk-2."]}
        self.lease_gate: asyncio.Event | None = None  # lease waits for it when set
        self.report_gate: asyncio.Event | None = None  # report waits for it when set
        self.fail: dict[str, BaseException] = {}
        self.running_leases = 0
        self.peak_leases = 0
        self.cancelled_leases = 0
        self.hello_delay = 0.0

    def _enter(self, verb: str, conn: ConnectionInfo, msg: object) -> None:
        self.calls.append((verb, conn.owner, msg))
        if verb in self.fail:
            raise self.fail[verb]

    async def hello(self, conn: ConnectionInfo, msg: Hello) -> Welcome:
        await asyncio.sleep(self.hello_delay)
        self._enter("hello", conn, msg)
        return Welcome(core_pid=os.getpid())

    async def lease(self, conn: ConnectionInfo, msg: LeaseRequest) -> LeaseReply:
        self._enter("lease", conn, msg)
        self.running_leases += 1
        self.peak_leases = max(self.peak_leases, self.running_leases)
        try:
            if self.lease_gate is not None:
                await self.lease_gate.wait()
        except asyncio.CancelledError:
            self.cancelled_leases += 1
            raise
        finally:
            self.running_leases -= 1
        return LeaseReply(jobs=self.jobs[: msg.max_jobs])

    async def chunk(self, conn: ConnectionInfo, msg: ChunkRequest) -> ChunkReply:
        self._enter("chunk", conn, msg)
        try:
            return ChunkReply(data=self.bodies[msg.msg_id][msg.index])
        except (KeyError, IndexError):
            raise NotFound(f"no chunk {msg.index} of message {msg.msg_id}") from None

    async def report(self, conn: ConnectionInfo, msg: Report) -> ReportReply:
        self._enter("report", conn, msg)
        if self.report_gate is not None:
            await self.report_gate.wait()
        tokens = [r.token for r in msg.results]
        return ReportReply(
            accepted=tuple(t for t in tokens if t < 100),
            refused=tuple(t for t in tokens if t >= 100),
            jobs=self.jobs[: msg.lease_jobs],
        )

    def disconnected(self, conn: ConnectionInfo) -> None:
        # Every request task of the connection has finished by now.
        assert self.running_leases == 0
        self.disconnects.append(conn)
        self.disconnected_event.set()

    def verbs(self) -> list[str]:
        return [verb for verb, _, _ in self.calls]


@asynccontextmanager
async def serving(tmp_path: Path, **options: int) -> AsyncIterator[tuple[IpcServer, FakeCore]]:
    core = FakeCore()
    server = IpcServer(tmp_path / "core.sock", core, **options)
    await server.start()
    try:
        yield server, core
    finally:
        await within(server.close())


class RawPeer:
    """A worker that writes whatever frames (or bytes) the test wants."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader = reader
        self.writer = writer
        self.decoder = FrameDecoder()

    @classmethod
    async def connect(cls, path: Path) -> RawPeer:
        return cls(*await asyncio.open_unix_connection(path))

    def send(self, req_id: int, msg: Any) -> None:
        self.writer.write(encode_frame(seal(req_id, msg)))

    async def replies(self, count: int) -> list[tuple[int, object]]:
        out: list[tuple[int, object]] = []
        while len(out) < count:
            data = await within(self.reader.read(65536))
            assert data, "server hung up"
            for obj in self.decoder.feed(data):
                envelope = open_envelope(obj)
                out.append((envelope.id, decode_reply(envelope)))
        return out

    async def replies_until_eof(self) -> list[tuple[int, object]]:
        """Every reply until the server hangs up; then our end is closed too."""
        out: list[tuple[int, object]] = []
        while data := await within(self.reader.read(65536)):
            for obj in self.decoder.feed(data):
                envelope = open_envelope(obj)
                out.append((envelope.id, decode_reply(envelope)))
        self.writer.close()
        await within(self.writer.wait_closed())
        return out


# ---------------------------------------------------------------------------------------


def test_hello_lease_chunk_report(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path) as (_, core):
            client = await within(IpcClient.connect(tmp_path / "core.sock", HELLO))
            assert client.welcome == Welcome(core_pid=os.getpid())
            assert await within(client.lease(max_jobs=5)) == core.jobs
            assert await within(client.chunk(7, 1)) == b"chunk-1;"
            reply = await within(
                client.report(
                    (
                        RecipientReport(token=11, outcome=Outcome.DELIVERED, reply="250 ok"),
                        RecipientReport(token=100, outcome=Outcome.DEFERRED, code=451),
                    )
                )
            )
            assert reply == ReportReply(accepted=(11,), refused=(100,))
            assert core.verbs() == ["hello", "lease", "chunk", "report"]
            # The owner is fixed at hello and unique per connection.
            assert {owner for _, owner, _ in core.calls} == {"w1#1"}
            await within(client.close())
            await within(core.disconnected_event.wait())
            assert core.disconnects == [
                ConnectionInfo(owner="w1#1", serial=1, zone="bulk", worker="w1", pid=4242)
            ]

    run(body)


def test_each_connection_has_its_own_owner(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path) as (_, core):
            first = await within(IpcClient.connect(tmp_path / "core.sock", HELLO))
            second = await within(IpcClient.connect(tmp_path / "core.sock", HELLO))
            await within(asyncio.gather(first.lease(), second.lease()))
            owners = {owner for verb, owner, _ in core.calls if verb == "lease"}
            assert owners == {"w1#1", "w1#2"}
            await first.close()
            await second.close()

    run(body)


def test_request_before_hello_is_refused_and_disconnected(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path) as (_, core):
            peer = await RawPeer.connect(tmp_path / "core.sock")
            peer.send(5, LeaseRequest())
            replies = await peer.replies_until_eof()
            assert len(replies) == 1
            req_id, reply = replies[0]
            assert req_id == 5
            assert isinstance(reply, ErrorReply)
            assert reply.kind == "protocol"
            assert "before hello" in reply.message
            await within(core.disconnected_event.wait())
            assert len(core.disconnects) == 1
            assert core.disconnects[0].zone is None  # never helloed
            assert core.calls == []

    run(body)


def test_pipelined_requests_after_hello_see_the_hello(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path) as (_, core):
            core.hello_delay = 0.05  # the lease is already in the socket when hello ends
            peer = await RawPeer.connect(tmp_path / "core.sock")
            peer.send(1, HELLO)
            peer.send(2, LeaseRequest())
            replies = dict(await peer.replies(2))
            assert isinstance(replies[1], Welcome)
            assert isinstance(replies[2], LeaseReply)
            assert core.calls[1][1] == "w1#1"
            peer.writer.close()

    run(body)


def test_other_protocol_version_is_refused(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path) as (_, core):
            with pytest.raises(ProtocolError, match="version 2"):
                await within(
                    IpcClient.connect(tmp_path / "core.sock", Hello("z", "w", 1, version=2))
                )
            await within(core.disconnected_event.wait())
            assert len(core.disconnects) == 1
            assert core.calls == []

    run(body)


def test_refused_hello_raises_and_disconnects(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path) as (_, core):
            core.fail["hello"] = NotFound("no zone 'bulk'")
            with pytest.raises(NotFound, match="no zone"):
                await within(IpcClient.connect(tmp_path / "core.sock", HELLO))
            await within(core.disconnected_event.wait())
            assert len(core.disconnects) == 1

    run(body)


def test_slow_lease_does_not_block_chunk(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path) as (_, core):
            core.lease_gate = asyncio.Event()
            client = await within(IpcClient.connect(tmp_path / "core.sock", HELLO))
            lease = asyncio.create_task(client.lease(wait_ms=60_000))
            await asyncio.sleep(0.01)
            assert await within(client.chunk(7, 0)) == b"chunk-0;"
            assert not lease.done()
            assert core.verbs() == ["hello", "lease", "chunk"]
            core.lease_gate.set()
            assert await within(lease) == core.jobs[:1]
            await client.close()

    run(body)


def test_many_concurrent_requests_on_one_connection(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path) as (_, _core):
            client = await within(IpcClient.connect(tmp_path / "core.sock", HELLO))
            indexes = [i % 3 for i in range(300)]
            chunks = await within(asyncio.gather(*(client.chunk(7, i) for i in indexes)))
            assert chunks == [f"chunk-{i}".encode() + (b"." if i == 2 else b";") for i in indexes]
            await client.close()

    run(body)


def test_concurrent_requests_per_connection_are_bounded(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path, max_in_flight=2) as (_, core):
            core.lease_gate = asyncio.Event()
            client = await within(IpcClient.connect(tmp_path / "core.sock", HELLO))
            leases = [asyncio.create_task(client.lease()) for _ in range(5)]
            await asyncio.sleep(0.05)
            assert core.running_leases == 2
            core.lease_gate.set()
            await within(asyncio.gather(*leases))
            assert core.peak_leases == 2
            await client.close()

    run(body)


@pytest.mark.parametrize(
    ("error", "expected"),
    [
        (LeaseError("lease 11 is not current"), LeaseError),
        (NotFound("message gone"), NotFound),
        (TemporaryFailure("store busy"), TemporaryFailure),
        (ProtocolError("token 0 is reserved"), ProtocolError),
        (ZoneqError("something else"), ZoneqError),
    ],
)
def test_handler_errors_are_raised_by_the_client(
    tmp_path: Path, error: ZoneqError, expected: type[ZoneqError]
) -> None:
    async def body() -> None:
        async with serving(tmp_path) as (_, core):
            core.fail["report"] = error
            client = await within(IpcClient.connect(tmp_path / "core.sock", HELLO))
            with pytest.raises(expected, match=str(error)) as raised:
                await within(client.report(()))
            assert type(raised.value) is expected
            # The connection carries on.
            assert await within(client.chunk(7, 2)) == b"chunk-2."
            assert not client.closed
            await client.close()
            assert len(core.disconnects) <= 1

    run(body)


def test_not_found_from_a_real_handler_lookup(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path):
            client = await within(IpcClient.connect(tmp_path / "core.sock", HELLO))
            with pytest.raises(NotFound, match="no chunk 3"):
                await within(client.chunk(7, 3))
            await client.close()

    run(body)


def test_handler_crash_becomes_error_reply(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def body() -> None:
        async with serving(tmp_path) as (_, core):
            core.fail["lease"] = RuntimeError("bug in the core")
            client = await within(IpcClient.connect(tmp_path / "core.sock", HELLO))
            with pytest.raises(CoreFailure) as raised:
                await within(client.lease())
            assert isinstance(raised.value, TemporaryFailure)
            assert "bug in the core" not in str(raised.value)
            del core.fail["lease"]
            assert await within(client.lease()) == core.jobs[:1]
            await client.close()
            await within(core.disconnected_event.wait())
            assert len(core.disconnects) == 1

    with caplog.at_level(logging.ERROR, logger="zoneq.ipc.server"):
        run(body)
    assert "bug in the core" in caplog.text  # logged in full on the core's side


def test_garbage_frame_closes_only_that_connection(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path) as (_, core):
            client = await within(IpcClient.connect(tmp_path / "core.sock", HELLO))
            peer = await RawPeer.connect(tmp_path / "core.sock")
            peer.send(1, Hello(zone="bulk", worker="raw", pid=1))
            assert isinstance((await peer.replies(1))[0][1], Welcome)
            payload = b"\xc1\xc1\xc1"
            peer.writer.write(len(payload).to_bytes(4, "big") + payload)
            assert await peer.replies_until_eof() == []  # returns: the server hung up
            await within(core.disconnected_event.wait())
            await asyncio.sleep(0.05)  # room for a wrong second call
            assert [conn.owner for conn in core.disconnects] == ["raw#2"]
            # The well-behaved worker is unaffected.
            assert await within(client.chunk(7, 0)) == b"chunk-0;"
            await client.close()

    run(body)


def test_oversize_frame_closes_the_connection(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path, max_frame=1024) as (_, core):
            peer = await RawPeer.connect(tmp_path / "core.sock")
            peer.writer.write((1 << 30).to_bytes(4, "big"))
            assert await peer.replies_until_eof() == []
            await within(core.disconnected_event.wait())
            assert len(core.disconnects) == 1

    run(body)


def test_reused_request_id_is_a_protocol_error(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path) as (_, core):
            core.lease_gate = asyncio.Event()
            peer = await RawPeer.connect(tmp_path / "core.sock")
            peer.send(1, HELLO)
            peer.send(2, LeaseRequest())
            while core.running_leases == 0:
                await asyncio.sleep(0.005)
            peer.send(2, ChunkRequest(msg_id=7, index=0))
            replies = await peer.replies_until_eof()
            assert isinstance(replies[0][1], Welcome)
            assert replies[1][0] == 2
            assert isinstance(replies[1][1], ErrorReply)
            assert "already in use" in replies[1][1].message
            await within(core.disconnected_event.wait())
            assert core.cancelled_leases == 1  # the running lease was stopped first

    run(body)


def test_client_killed_abruptly_is_disconnected_once(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path) as (_, core):
            core.lease_gate = asyncio.Event()
            client = await within(IpcClient.connect(tmp_path / "core.sock", HELLO))
            lease = asyncio.create_task(client.lease(wait_ms=60_000))
            await asyncio.sleep(0.02)
            assert core.running_leases == 1
            client.abort()
            with pytest.raises(ConnectionLost):
                await within(lease)
            await within(core.disconnected_event.wait())
            await asyncio.sleep(0.05)
            assert [conn.owner for conn in core.disconnects] == ["w1#1"]
            # The lease in flight was cancelled before disconnected() ran (it asserts so).
            assert core.cancelled_leases == 1
            assert client.closed
            with pytest.raises(ConnectionLost):
                await within(client.chunk(7, 0))

    run(body)


def test_server_close_fails_pending_requests(tmp_path: Path) -> None:
    async def body() -> None:
        core = FakeCore()
        core.lease_gate = asyncio.Event()
        server = IpcServer(tmp_path / "core.sock", core)
        await server.start()
        client = await within(IpcClient.connect(tmp_path / "core.sock", HELLO))
        pending = [asyncio.create_task(client.lease(wait_ms=60_000)) for _ in range(3)]
        await asyncio.sleep(0.02)
        await within(server.close())
        results = await within(asyncio.gather(*pending, return_exceptions=True))
        assert all(isinstance(result, ConnectionLost) for result in results)
        assert all(isinstance(result, TemporaryFailure) for result in results)
        assert len(core.disconnects) == 1
        assert not (tmp_path / "core.sock").exists()
        await asyncio.sleep(0)
        assert client.closed
        with pytest.raises(ConnectionLost):  # fails fast, nothing is written
            await within(client.lease(), 0.5)
        await client.close()
        await client.close()  # idempotent

    run(body)


def test_connect_without_a_core(tmp_path: Path) -> None:
    async def body() -> None:
        with pytest.raises(CoreUnavailable):
            await within(IpcClient.connect(tmp_path / "core.sock", HELLO))

    run(body)


def test_socket_file_is_private(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path) as (server, _):
            mode = os.stat(server.path).st_mode
            assert stat.S_ISSOCK(mode)
            assert stat.S_IMODE(mode) == 0o600

    run(body)


def test_stale_socket_file_is_replaced(tmp_path: Path) -> None:
    path = tmp_path / "core.sock"
    # A socket file left behind by a core that died: bound, never unlinked, nobody listening.
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(os.fspath(path))
    dead.close()
    assert path.exists()

    async def body() -> None:
        async with serving(tmp_path):
            client = await within(IpcClient.connect(path, HELLO))
            assert await within(client.chunk(7, 0)) == b"chunk-0;"
            await client.close()
        assert not path.exists()

    run(body)


def test_live_socket_and_other_files_are_not_replaced(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path) as (server, _):
            second = IpcServer(server.path, FakeCore())
            with pytest.raises(SocketInUse, match="another process"):
                await second.start()
            # The first server still works.
            client = await within(IpcClient.connect(server.path, HELLO))
            await client.close()
        other = tmp_path / "not-a-socket"
        other.write_text("keep me")
        with pytest.raises(SocketInUse, match="not a socket"):
            await IpcServer(other, FakeCore()).start()
        assert other.read_text() == "keep me"

    run(body)


@pytest.mark.parametrize("read_ahead", [True, False])
def test_iter_body_yields_chunks_in_order(tmp_path: Path, read_ahead: bool) -> None:
    async def body() -> None:
        async with serving(tmp_path) as (_, core):
            core.bodies[8] = [bytes([i]) * 1000 for i in range(20)]
            client = await within(IpcClient.connect(tmp_path / "core.sock", HELLO))
            job = make_job(8, 20)
            pieces = [piece async for piece in client.iter_body(job, read_ahead=read_ahead)]
            assert pieces == core.bodies[8]
            asked = [msg.index for verb, _, msg in core.calls if verb == "chunk"]  # type: ignore[attr-defined]
            assert asked == list(range(20))
            assert [piece async for piece in client.iter_body(make_job(9, 0))] == []
            await client.close()

    run(body)


def test_iter_body_stops_early_and_reports_missing_chunks(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path) as (_, core):
            client = await within(IpcClient.connect(tmp_path / "core.sock", HELLO))
            stream = client.iter_body(make_job(7, 3))
            assert await within(anext(stream)) == b"chunk-0;"
            await within(stream.aclose())  # cancels the read-ahead; nothing left dangling
            # The job says 5 chunks but the core has 3: the fourth fetch fails.
            got = []
            with pytest.raises(NotFound):
                async for piece in client.iter_body(make_job(7, 5)):
                    got.append(piece)
            assert got == core.bodies[7]
            await client.close()

    run(body)


@pytest.mark.parametrize("asking", ["lease", "report-and-lease"])
def test_cancelled_leasing_request_gives_its_jobs_back(tmp_path: Path, asking: str) -> None:
    async def body() -> None:
        async with serving(tmp_path) as (_, core):
            gate = asyncio.Event()
            client = await within(IpcClient.connect(tmp_path / "core.sock", HELLO))
            done = (RecipientReport(token=5, outcome=Outcome.DELIVERED),)
            if asking == "lease":
                core.lease_gate = gate
                request = client.lease(wait_ms=60_000)
            else:
                core.report_gate = gate
                request = client.report(done, lease_jobs=1)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(request, 0.05)
            gate.set()  # the core grants the jobs after the worker gave up
            returned: list[Report] = []
            for _ in range(200):
                returned = [
                    msg
                    for verb, _, msg in core.calls
                    if isinstance(msg, Report) and msg.results[0].outcome is Outcome.RETURNED
                ]
                if returned:
                    break
                await asyncio.sleep(0.01)
            (give_back,) = returned
            assert give_back.lease_jobs == 0  # giving back must not lease again
            assert {(r.token, r.outcome) for r in give_back.results} == {
                (11, Outcome.RETURNED),
                (12, Outcome.RETURNED),
            }
            assert not client.closed
            await client.close()

    run(body)


def test_report_without_lease_jobs_is_not_given_back_when_cancelled(tmp_path: Path) -> None:
    async def body() -> None:
        async with serving(tmp_path) as (_, core):
            core.report_gate = asyncio.Event()
            client = await within(IpcClient.connect(tmp_path / "core.sock", HELLO))
            done = (RecipientReport(token=5, outcome=Outcome.DELIVERED),)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(client.report(done), 0.05)
            core.report_gate.set()
            await within(client.lease())  # a later round trip: the first reply is in
            assert core.verbs() == ["hello", "report", "lease"]
            await client.close()

    run(body)


def test_requests_of_one_turn_leave_in_one_write(tmp_path: Path) -> None:
    """Frames written in the same turn of the loop go out in one write, in order; and a
    reply the core finishes in one turn for several requests comes back in one write."""

    async def body() -> None:
        async with serving(tmp_path) as (_, core):
            client = await within(IpcClient.connect(tmp_path / "core.sock", HELLO))
            writes: list[bytes] = []
            write = client._writer.write

            def counted(data: bytes) -> None:
                writes.append(bytes(data))
                write(data)

            client._writer.write = counted  # type: ignore[method-assign]
            replies = await within(asyncio.gather(*(client.chunk(7, index) for index in range(3))))
            assert replies == [b"chunk-0;", b"chunk-1;", b"chunk-2."]
            assert len(writes) == 1  # three requests, one send
            frames = FrameDecoder().feed(writes[0])
            assert [open_envelope(f).body["index"] for f in frames] == [0, 1, 2]  # type: ignore[index]
            await within(client.report((RecipientReport(1, Outcome.DELIVERED),)))
            assert len(writes) == 2  # the next turn's request is a write of its own
            assert core.verbs() == ["hello", "chunk", "chunk", "chunk", "report"]
            await client.close()

    run(body)


def test_server_close_with_idle_and_unhelloed_connections(tmp_path: Path) -> None:
    async def body() -> None:
        core = FakeCore()
        server = IpcServer(tmp_path / "core.sock", core)
        await server.start()
        client = await within(IpcClient.connect(server.path, HELLO))
        peer = await RawPeer.connect(server.path)
        await asyncio.sleep(0.02)
        assert server.connection_count == 2
        await within(server.close())
        assert sorted(conn.owner for conn in core.disconnects) == ["?#2", "w1#1"]
        assert await peer.replies_until_eof() == []
        await client.close()

    run(body)


def test_client_against_a_misbehaving_core(tmp_path: Path) -> None:
    """A core answering with the wrong verb, then with garbage, as the client sees it."""

    async def body() -> None:
        async def bad_core(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            decoder = FrameDecoder()
            answers: list[bytes] = [
                encode_frame(seal(1, Welcome(core_pid=1))),
                encode_frame(seal(2, ChunkReply(data=b"not a lease reply"))),
                b"\x00\x00\x00\x01\xc1",
            ]
            while answers and (data := await reader.read(65536)):
                for _ in decoder.feed(data):
                    writer.write(answers.pop(0))
            await reader.read()  # until the client hangs up
            writer.close()

        server = await asyncio.start_unix_server(bad_core, tmp_path / "bad.sock")
        async with server:
            client = await within(IpcClient.connect(tmp_path / "bad.sock", HELLO))
            with pytest.raises(ProtocolError, match="answered lease with chunk-data"):
                await within(client.lease())
            assert not client.closed
            with pytest.raises(ConnectionLost, match="protocol error"):
                await within(client.chunk(7, 0))
            assert client.closed
            await client.close()

    run(body)
