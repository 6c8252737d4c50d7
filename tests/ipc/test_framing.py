"""Frames: round trips in any chunking, oversize and garbage refused, partial frames kept."""

from __future__ import annotations

import struct

import msgpack
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from zoneq.errors import ProtocolError
from zoneq.ipc.framing import HEADER_SIZE, FrameDecoder, encode_frame

# Everything msgpack carries that survives a round trip unchanged (arrays come back as
# lists, so tuples are left out; floats without NaN, which is unequal to itself).
scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=-(2**63), max_value=2**64 - 1)
    | st.floats(allow_nan=False)
    | st.text()
    | st.binary()
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(), inner, max_size=5),
    max_leaves=20,
)


def chunked(data: bytes, cuts: list[int]) -> list[bytes]:
    points = sorted({cut % (len(data) + 1) for cut in cuts})
    pieces, start = [], 0
    for point in [*points, len(data)]:
        pieces.append(data[start:point])
        start = point
    return pieces


@given(objects=st.lists(values, max_size=10), cuts=st.lists(st.integers(min_value=0), max_size=20))
def test_any_chunking_decodes_the_same_sequence(objects: list[object], cuts: list[int]) -> None:
    stream = b"".join(encode_frame(obj) for obj in objects)
    decoder = FrameDecoder()
    decoded: list[object] = []
    for piece in chunked(stream, cuts):
        decoded.extend(decoder.feed(piece))
    assert decoded == objects
    assert decoder.buffered == 0


@given(objects=st.lists(values, min_size=1, max_size=5))
def test_byte_by_byte(objects: list[object]) -> None:
    stream = b"".join(encode_frame(obj) for obj in objects)
    decoder = FrameDecoder()
    decoded: list[object] = []
    for index in range(len(stream)):
        decoded.extend(decoder.feed(stream[index : index + 1]))
    assert decoded == objects


def test_bytes_and_str_stay_distinct() -> None:
    obj = {"data": b"\x00\xff", "text": "h\u00e9llo \u2603", "big": 2**64 - 1, "neg": -(2**63)}
    assert FrameDecoder().feed(encode_frame(obj)) == [obj]


def test_partial_frame_is_held() -> None:
    frame = encode_frame({"a": 1})
    decoder = FrameDecoder()
    assert decoder.feed(frame[:3]) == []
    assert decoder.feed(frame[3:-1]) == []
    assert decoder.buffered == len(frame) - 1
    assert decoder.feed(frame[-1:] + frame) == [{"a": 1}, {"a": 1}]


def test_oversize_header_refused_before_payload_arrives() -> None:
    decoder = FrameDecoder(max_frame=100)
    with pytest.raises(ProtocolError, match="exceeds"):
        decoder.feed(struct.pack(">I", 101))
    # A failed stream cannot be resynchronised.
    with pytest.raises(ProtocolError):
        decoder.feed(encode_frame(1))


@given(max_frame=st.integers(min_value=1, max_value=1000), extra=st.integers(1, 2**32 - 1001))
def test_any_oversize_length_refused(max_frame: int, extra: int) -> None:
    with pytest.raises(ProtocolError):
        FrameDecoder(max_frame=max_frame).feed(struct.pack(">I", max_frame + extra))


def test_frame_at_the_limit_accepted() -> None:
    frame = encode_frame(b"x" * 50)
    limit = len(frame) - HEADER_SIZE
    assert FrameDecoder(max_frame=limit).feed(frame) == [b"x" * 50]
    with pytest.raises(ProtocolError):
        FrameDecoder(max_frame=limit - 1).feed(frame)


def test_encode_refuses_oversize_and_unencodable() -> None:
    with pytest.raises(ValueError, match="exceeds"):
        encode_frame(b"x" * 100, max_frame=50)
    with pytest.raises(ValueError, match="cannot encode"):
        encode_frame(object())
    with pytest.raises(ValueError, match="cannot encode"):
        encode_frame(2**64)


@pytest.mark.parametrize(
    "payload",
    [
        b"",  # empty frame: no object at all
        b"\xc1",  # the one byte msgpack never uses
        b"\x92\x01",  # array of 2 with 1 element: truncated
        b"\x01\x02",  # two objects in one frame
        b"\xa2\xff\xfe",  # str that is not UTF-8
        b"\x81\x01\x02",  # map with an int key
        b"\x81\x91\x01\x02",  # map with an array key
    ],
)
def test_garbage_payload_refused(payload: bytes) -> None:
    with pytest.raises(ProtocolError, match="not valid msgpack"):
        FrameDecoder().feed(struct.pack(">I", len(payload)) + payload)


def test_deep_nesting_refused_not_crashing() -> None:
    payload = b"\x91" * 100_000 + b"\xc0"
    with pytest.raises(ProtocolError):
        FrameDecoder().feed(struct.pack(">I", len(payload)) + payload)


@settings(max_examples=300)
@given(garbage=st.binary(max_size=200))
def test_garbage_never_hangs_or_escapes(garbage: bytes) -> None:
    decoder = FrameDecoder(max_frame=1024)
    try:
        for obj in decoder.feed(garbage):
            # Whatever decodes is a plain msgpack value.
            msgpack.packb(obj, use_bin_type=True)
    except ProtocolError:
        pass
