"""The routing header's recorded name (``zone_header``) is optional in every encoding that
carries it, so values and frames without it read as before and old readers ignore it:
``MessageMeta`` (a key only when set), the worker's ``Job`` and the intake frame."""

from __future__ import annotations

import msgpack
import pytest

from zoneq.ipc.intake_messages import ReceivedMessage, decode_message, encode_message
from zoneq.ipc.messages import Job
from zoneq.storage.records import MessageMeta

META = MessageMeta(7, "a@b.test", 10, 1, 1_700_000_000_000)


@pytest.mark.parametrize("name", [None, "X-Sending-Zone"])
def test_each_encoding_keeps_the_name(name: str | None) -> None:
    meta = MessageMeta(7, "a@b.test", 10, 1, 1_700_000_000_000, zone_header=name)
    assert MessageMeta.decode(b"k", 7, meta.encode()).zone_header == name
    job = Job(msg_id=7, sender="a@b.test", size=10, chunks=1, domain="b.test", zone_header=name)
    assert Job.from_wire(job.to_wire(), "job").zone_header == name
    message = ReceivedMessage(7, "a@b.test", 10, 1, 0, zone_header=name)
    assert decode_message(encode_message(message)) == message


def test_without_a_name_nothing_new_is_written() -> None:
    """The usual message's value, job and frame are what they were before the field."""
    assert "zone_header" not in msgpack.unpackb(META.encode())
    assert "zone_header" not in Job(msg_id=7, sender="", size=0, chunks=0, domain="").to_wire()
    assert len(encode_message(ReceivedMessage(7, "", 0, 0, 0))) == 11
