"""Recipients a plugin dropped, on the intake wire: the COMMIT frame's optional fifth field.

Pure properties of the encoding, then the real path: ``IntakeClient`` over a Unix socket
pair to ``IntakeServer`` on a LevelDB queue, where the DROPPED events must land in the
commit's batch (and, with every recipient dropped, nothing else but the events).
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.ipc.test_intake import T0, intake, message, run
from tests.ipc.test_intake_messages import recipients, wire
from zoneq.errors import ProtocolError
from zoneq.ipc import intake_client
from zoneq.ipc.intake_messages import (
    DroppedRecipient,
    Op,
    ReceivedRecipient,
    decode_dropped,
    decode_recipients,
    encode_dropped,
    encode_recipients,
)
from zoneq.protocol.events import Event, EventKind
from zoneq.protocol.ids import format_id, id_time_ms
from zoneq.storage import keys
from zoneq.storage.store import QueueStore

text = st.text(max_size=40)
dropped_lists = st.lists(
    st.builds(DroppedRecipient, address=text, zone=text, reason=text), min_size=1, max_size=5
)


def dropped_events(store: QueueStore) -> list[Event]:
    return [e for _, e in store.events() if e.kind is EventKind.DROPPED]


def drop_fields(event: Event) -> tuple[object, ...]:
    """What a DROPPED event says, to compare with :func:`expected_drop`."""
    e = event
    return (e.zone, e.message_id, e.recipient, e.domain, e.time_ms, e.queued_at_ms, e.size, e.text)


def expected_drop(
    msg_id: int, zone: str, recipient: str, *, now_ms: int, size: int, reason: str
) -> tuple[object, ...]:
    """The fields of the DROPPED event a commit writes for ``recipient`` of ``msg_id``."""
    domain = recipient.rpartition("@")[2].lower()
    return (zone, format_id(msg_id), recipient, domain, now_ms, id_time_ms(msg_id), size, reason)


@given(dropped_lists)
def test_dropped_recipients_survive_the_wire(dropped: list[DroppedRecipient]) -> None:
    assert decode_dropped(wire(encode_dropped(dropped))) == dropped


@given(recipients)
def test_an_empty_recipient_list_is_allowed_only_when_asked(
    given_recipients: list[ReceivedRecipient],
) -> None:
    assert decode_recipients([], allow_empty=True) == []
    assert decode_recipients(wire(encode_recipients(given_recipients)), allow_empty=True) == (
        given_recipients
    )
    with pytest.raises(ProtocolError):
        decode_recipients([])


@pytest.mark.parametrize(
    "obj",
    [[], "x", [["a@b", "z"]], [["a@b", "z", "why", "extra"]], [["a@b", "z", 3]], [None]],
)
def test_bad_dropped_lists_are_refused(obj: object) -> None:
    with pytest.raises(ProtocolError):
        decode_dropped(obj)


def test_the_usual_commit_frame_is_unchanged_and_drops_add_a_fifth_field(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No drops: four arguments, as before (the hot path pays nothing); drops: five."""

    async def body() -> None:
        async with intake(tmp_path) as (_, _, connect):
            frames: list[object] = []
            real = intake_client.encode_frame

            def spy(obj: object, *, max_frame: int) -> bytes:
                frames.append(obj)
                return real(obj, max_frame=max_frame)

            monkeypatch.setattr(intake_client, "encode_frame", spy)
            client = await connect("r0")
            for drops in ((), (DroppedRecipient("x@b.test", "default", "why"),)):
                msg_id = await client.begin(T0, 0)
                rcpts = [ReceivedRecipient("a@b.test", "default")]
                text = message(msg_id, b"hi\r\n", 1)
                await client.commit(text, rcpts, T0, tail=b"hi\r\n", dropped=drops)
            commits = [f for f in frames if isinstance(f, list) and f[0] == Op.COMMIT]
            assert [len(frame) for frame in commits] == [6, 7]  # op, rid and the arguments

    run(body())


def test_drops_travel_with_the_commit_and_land_as_events(tmp_path: Path) -> None:
    async def body() -> None:
        async with intake(tmp_path) as (store, _, connect):
            client = await connect("r0")
            # Some recipients queued, one dropped.
            msg_id = await client.begin(T0, 0)
            text = b"Subject: hi\r\n\r\nbody\r\n"
            queued = [ReceivedRecipient("a@b.test", "default")]
            dropped = [DroppedRecipient("Gone@B.test", "bulk", "suppressed in zone bulk")]
            await client.commit(
                message(msg_id, text, 1), queued, T0 + 5, tail=text, dropped=dropped
            )
            [event] = dropped_events(store)
            assert drop_fields(event) == expected_drop(
                msg_id,
                "bulk",
                "Gone@B.test",
                now_ms=T0 + 5,
                size=len(text),
                reason="suppressed in zone bulk",
            )
            assert [r.recipient.address for r in store.recipients(msg_id)] == ["a@b.test"]

            # Every recipient dropped: the chunks written go, only the event stays.
            gone = await client.begin(T0, 0)
            chunk = b"x" * 65_536
            await client.write_chunk(gone, 0, chunk)
            only = [DroppedRecipient("c@b.test", "default", "test drop")]
            await client.commit(message(gone, chunk + text, 2), [], T0, tail=text, dropped=only)
            await store.drain()
            assert list(store.database.keys(prefix=keys.chunk_prefix(gone))) == []
            assert list(store.database.keys(prefix=keys.receiving(gone))) == []
            last = dropped_events(store)[-1]
            assert (last.message_id, last.recipient, last.zone) == (
                format_id(gone),
                "c@b.test",
                "default",
            )
            assert store.message_count() == 1

    run(body())
