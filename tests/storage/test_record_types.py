"""Stored values that decode but carry a wrong-typed field are corrupt, not "valid".

A ``*`` value with ``"chunks": "3"`` used to decode, reach a worker inside a job, be refused
there, and kill the worker; the next worker took the same job and died too, for ever.  Every
field of the metadata and the head is checked where it is decoded, so such a value takes
the quarantine path like any garbage.
"""

from __future__ import annotations

from typing import Any

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from zoneq.errors import StorageCorruption
from zoneq.storage.records import MessageMeta, decode_head, encode_head

KEY = b"message-key"
TEXT = st.text(max_size=20)
COUNT = st.integers(min_value=0, max_value=2**40)


def meta_map(**changes: Any) -> dict[str, Any]:
    data: dict[str, Any] = msgpack.unpackb(MessageMeta(1, "a@b.test", 10, 1, 5).encode())
    data.update(changes)
    return data


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("chunks", "3"),
        ("chunks", 3.0),
        ("chunks", True),
        ("chunks", -1),
        ("size", "10"),
        ("size", None),
        ("rcpts", [1]),
        ("received", "5"),
        ("sender", 7),
        ("sender", None),
        ("zones", "default"),
        ("zones", [1]),
        ("ret", 1),
        ("envid", b"bytes"),
        ("utf8", 1),
        ("8bit", "no"),
        ("bounce", 0),
        ("headers", ["Subject", "x"]),
        ("headers", {"Subject": 1}),
        ("source", {"client": None}),
    ],
)
def test_a_wrong_typed_metadata_field_is_corruption_naming_it(field: str, value: object) -> None:
    with pytest.raises(StorageCorruption) as caught:
        MessageMeta.decode(KEY, 1, msgpack.packb(meta_map(**{field: value})))
    assert caught.value.key == KEY
    assert field in caught.value.reason


@pytest.mark.parametrize("field", sorted(meta_map()))
def test_a_missing_metadata_field_is_corruption(field: str) -> None:
    data = meta_map()
    del data[field]
    with pytest.raises(StorageCorruption):
        MessageMeta.decode(KEY, 1, msgpack.packb(data))


@pytest.mark.parametrize("value", [b"\xc1", msgpack.packb([1, 2]), msgpack.packb("meta")])
def test_metadata_that_is_not_a_map_is_corruption(value: bytes) -> None:
    with pytest.raises(StorageCorruption):
        MessageMeta.decode(KEY, 1, value)


metas = st.builds(
    MessageMeta,
    msg_id=st.just(7),
    sender=TEXT,
    size=COUNT,
    chunks=COUNT,
    received_ms=COUNT,
    zones=st.lists(TEXT, max_size=3).map(tuple),
    recipient_count=COUNT,
    ret=st.none() | st.sampled_from(["FULL", "HDRS"]),
    envid=st.none() | TEXT,
    smtputf8=st.booleans(),
    body_8bit=st.booleans(),
    headers=st.dictionaries(TEXT, TEXT, max_size=3),
    source=st.dictionaries(TEXT, TEXT, max_size=3),
    is_bounce=st.booleans(),
)
# A value of another msgpack type than each field's (None is fine where None is allowed).
# Integers within what msgpack can pack (int64 to uint64), or packing fails, not decoding.
PACKABLE = st.integers(min_value=-(2**63), max_value=2**64 - 1)
OTHER = {
    str: PACKABLE | st.booleans() | st.lists(PACKABLE, max_size=2),
    int: TEXT | st.booleans() | st.floats(allow_nan=False) | st.none(),
    bool: PACKABLE | TEXT | st.none(),
    list: TEXT | PACKABLE | st.dictionaries(TEXT, TEXT, max_size=1),
    dict: TEXT | PACKABLE | st.lists(TEXT, max_size=2),
}
FIELD_TYPES = {
    "sender": str,
    "zones": list,
    "rcpts": int,
    "size": int,
    "chunks": int,
    "received": int,
    "utf8": bool,
    "8bit": bool,
    "headers": dict,
    "source": dict,
    "bounce": bool,
}


@given(metas)
def test_every_metadata_encoding_decodes_to_itself(meta: MessageMeta) -> None:
    assert MessageMeta.decode(KEY, 7, meta.encode()) == meta


@given(metas, st.data())
def test_any_field_of_another_type_is_corruption(meta: MessageMeta, data: st.DataObject) -> None:
    field = data.draw(st.sampled_from(sorted(FIELD_TYPES)))
    wrong = data.draw(OTHER[FIELD_TYPES[field]])
    value: dict[str, Any] = msgpack.unpackb(meta.encode())
    value[field] = wrong
    with pytest.raises(StorageCorruption):
        MessageMeta.decode(KEY, 7, msgpack.packb(value))


@given(COUNT, st.integers(min_value=1, max_value=2**40))
def test_every_head_decodes_to_itself(created: int, remaining: int) -> None:
    assert decode_head(KEY, encode_head(created, remaining)) == (created, remaining)


@pytest.mark.parametrize(
    "value",
    [
        b"\xc1\xff",
        msgpack.packb([1]),
        msgpack.packb([1, 2, 3]),
        msgpack.packb([1, "2"]),
        msgpack.packb([True, 2]),
        msgpack.packb([1, 0]),
        msgpack.packb([1.5, 2]),
        msgpack.packb({"created": 1}),
        msgpack.packb(None),
    ],
)
def test_a_damaged_head_is_corruption(value: bytes) -> None:
    with pytest.raises(StorageCorruption) as caught:
        decode_head(KEY, value)
    assert caught.value.key == KEY
