"""Key encoding: round trips for every family and the three promises of ``keys.py``.

The promises (module docstring): no key of one tuple is a prefix of another tuple's key of
the same family, bytewise key order equals tuple order (strings compared by their UTF-8
bytes), and every element decodes back.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from zoneq.storage import keys

# --- strategies -------------------------------------------------------------------------

NO_SURROGATES: tuple[Literal["Cs"]] = ("Cs",)

# Text the encoding must survive: spaces, "~" (above every ASCII letter), NUL (the
# terminator), U+00FF (whose UTF-8 bytes surround the escape byte), and any other
# surrogate-free code point.
_TRICKY = st.sampled_from([" ", "~", "\x00", "\xff", "\u00e9", "\U0001f4e7", "@", "a", "b"])
TEXT = st.text(alphabet=st.one_of(_TRICKY, st.characters(exclude_categories=NO_SURROGATES)))
SHORT_TEXT = st.text(alphabet=_TRICKY, max_size=4)
ANY_TEXT = st.one_of(TEXT, SHORT_TEXT)

U64_MAX = 2**64 - 1
# Any u64, with the edges (a first byte of 0x00, 0x01 or 0xFF right after a text terminator
# once broke isolation and order) always tried.
IDS = st.one_of(
    st.integers(0, U64_MAX),
    st.sampled_from([0, 1, 255, 256, 2**32, 1_700_000_000_000 << 12, 0xFF << 56, U64_MAX]),
)


def utf8(value: str) -> bytes:
    return value.encode("utf-8")


# --- table-driven round trips ------------------------------------------------------------

ZONES = ["default", "", "a b", "a~", "a\x00b", "\x00", "z\u00e9", "\U0001f4e7 zone"]
ADDRESSES = ["user@example.org", "", '"a b"@x.example', "~@x", "n\x00l@x", "\u00e9@\u00e9.fr"]


@pytest.mark.parametrize("family", keys.RECORD_FAMILIES, ids=["ready", "deferred", "held"])
@pytest.mark.parametrize("zone", ZONES)
@pytest.mark.parametrize("address", ADDRESSES)
@pytest.mark.parametrize("msg_id", [0, 1, 0x0123_4567_89AB_CDEF, U64_MAX])
def test_record_round_trip(family: bytes, zone: str, address: str, msg_id: int) -> None:
    key = keys.record(family, zone, msg_id, address)
    assert keys.decode_record(key) == (family, zone, msg_id, address)
    assert key.startswith(keys.zone_prefix(family, zone))
    assert key.startswith(keys.record_message_prefix(family, zone, msg_id))


@pytest.mark.parametrize("zone", ZONES)
@pytest.mark.parametrize("address", ADDRESSES)
@pytest.mark.parametrize("due_ms", [0, 1, 1_700_000_000_000])
def test_due_round_trip(zone: str, address: str, due_ms: int) -> None:
    key = keys.due(zone, due_ms, 42 << 12, address)
    assert keys.decode_due(key) == (zone, due_ms, 42 << 12, address)
    assert key.startswith(keys.zone_prefix(keys.DUE, zone))


@pytest.mark.parametrize("msg_id", [0, 1, 1_700_000_000_000 << 12, U64_MAX])
def test_message_keys_round_trip(msg_id: int) -> None:
    head = keys.message_head(msg_id)
    meta = keys.message_meta(msg_id)
    assert keys.decode_message_key(head) == (msg_id, keys.HEAD_PART, None)
    assert keys.decode_message_key(meta) == (msg_id, keys.META_PART, None)
    for index in (0, 1, 9, 10, 255, 256, 2**32 - 1):
        chunk = keys.message_chunk(msg_id, index)
        assert keys.decode_message_key(chunk) == (msg_id, keys.CHUNK_PART, index)
        assert chunk.startswith(keys.chunk_prefix(msg_id))
        assert chunk.startswith(keys.message_prefix(msg_id))
    assert head.startswith(keys.message_prefix(msg_id))
    assert meta.startswith(keys.message_prefix(msg_id))
    assert not head.startswith(keys.chunk_prefix(msg_id))
    assert keys.decode_receiving(keys.receiving(msg_id)) == msg_id


def test_chunks_sort_numerically() -> None:
    chunk_keys = [keys.message_chunk(7, i) for i in (0, 1, 2, 9, 10, 11, 100, 1000, 65_536)]
    assert sorted(chunk_keys) == chunk_keys


@pytest.mark.parametrize("event_id", [0, 1, 1_700_000_000_000 << 12, U64_MAX])
def test_event_round_trip(event_id: int) -> None:
    assert keys.decode_event(keys.event(event_id)) == event_id


@pytest.mark.parametrize("name", ["ready", "domain-deferred", "messages", "a b", "\x00"])
@pytest.mark.parametrize("zone", ZONES)
@pytest.mark.parametrize("sub", ["", "example.org", "a\x00b", "\u00e9.fr"])
def test_counter_round_trip(name: str, zone: str, sub: str) -> None:
    assert keys.decode_counter(keys.counter(name, zone, sub)) == (name, zone, sub)


@pytest.mark.parametrize("name", ["schema", "", "a\x00b", "floor id"])
def test_meta_round_trip(name: str) -> None:
    key = keys.meta(name)
    assert key.startswith(keys.META)
    assert keys.split_text(key, len(keys.META)) == (name, len(key))


@pytest.mark.parametrize("value", ["", "plain", "a\x00", "\x00\x00", "\x00\xff", "\U0010ffff"])
def test_text_element_round_trip(value: str) -> None:
    encoded = keys.text(value)
    assert encoded.endswith(b"\x00")
    assert keys.split_text(encoded + b"trailing") == (value, len(encoded))


def test_families_are_distinct_and_prefix_free() -> None:
    families = [
        keys.MESSAGE,
        keys.RECEIVING,
        keys.READY,
        keys.DEFERRED,
        keys.DUE,
        keys.HELD,
        keys.EVENT,
        keys.COUNTER,
        keys.META,
    ]
    assert len(set(families)) == len(families)
    for a in families:
        for b in families:
            if a is not b:
                assert not a.startswith(b), (a, b)


def test_family_names_are_readable() -> None:
    # As in ZoneMTA, a key dump reads like the design document.
    assert keys.READY == b"delivery-zone\x00"
    assert keys.record(keys.READY, "default", 1, "a@b").startswith(b"delivery-zone\x00default\x00")


@pytest.mark.parametrize(
    "bad",
    [
        b"",
        b"garbage",
        keys.DUE + b"zone\x00" + bytes(16) + b"r\x00",  # a due key is not a record key
        keys.READY + b"zone-without-terminator",
        keys.READY + b"zone\x00" + bytes(8) + b"rcpt-without-terminator",
        keys.record(keys.READY, "z", 1, "r") + b"trailing",
        keys.READY + b"\xff\xfe\x00" + bytes(8) + b"r\x00",  # not UTF-8
    ],
)
def test_decode_record_rejects_garbage(bad: bytes) -> None:
    with pytest.raises(ValueError):  # UnicodeDecodeError is a ValueError
        keys.decode_record(bad)


@pytest.mark.parametrize(
    ("decoder", "bad"),
    [
        (keys.decode_due, keys.record(keys.DEFERRED, "z", 1, "r")),
        (keys.decode_due, keys.due("z", 1, 2, "r") + b"x"),
        (keys.decode_message_key, keys.MESSAGE + b"\x00\x01"),
        (keys.decode_message_key, keys.READY + bytes(9)),
    ],
)
def test_other_decoders_reject_garbage(decoder: Callable[[bytes], object], bad: bytes) -> None:
    with pytest.raises(ValueError):
        decoder(bad)


def test_zones_in_yields_each_zone_once_in_order() -> None:
    zones = ["", "a", "a b", "a\x00", "a~", "b"]
    stream = sorted(
        keys.record(keys.READY, zone, msg_id, rcpt)
        for zone in zones
        for msg_id in (1, 2)
        for rcpt in ("x@y", "z@y")
    )
    assert list(keys.zones_in(iter(stream), keys.READY)) == sorted(zones, key=utf8)


# --- properties -------------------------------------------------------------------------

RECORD_TUPLES = st.tuples(ANY_TEXT, IDS, ANY_TEXT)


def _record_order(t: tuple[str, int, str]) -> tuple[bytes, int, bytes]:
    zone, msg_id, rcpt = t
    return utf8(zone), msg_id, utf8(rcpt)


@given(a=RECORD_TUPLES, b=RECORD_TUPLES)
@example(a=("a", 1, "x"), b=("a b", 0, "x"))
@example(a=("a", 1, "x"), b=("a\x00", 0, "x"))
@example(a=("a", 5, "r"), b=("a", 5, "r\x00"))
@example(a=("a", 5, "r"), b=("a", 5, "r~"))
@example(a=("", 0, ""), b=("\x00", 0, ""))
@example(a=("\x00", 0, "\x00\x00"), b=("\x00", 0, "\x00\x01"))
@settings(max_examples=500)
def test_record_key_order_equals_tuple_order(
    a: tuple[str, int, str], b: tuple[str, int, str]
) -> None:
    for family in keys.RECORD_FAMILIES:
        ka = keys.record(family, *a)
        kb = keys.record(family, *b)
        oa, ob = _record_order(a), _record_order(b)
        assert (ka < kb) == (oa < ob)
        assert (ka == kb) == (oa == ob)


@given(st.lists(RECORD_TUPLES, min_size=2, max_size=30))
def test_sorting_keys_sorts_tuples(tuples: list[tuple[str, int, str]]) -> None:
    by_key = sorted(tuples, key=lambda t: keys.record(keys.READY, *t))
    assert [_record_order(t) for t in by_key] == sorted(_record_order(t) for t in tuples)


@given(RECORD_TUPLES, st.sampled_from(keys.RECORD_FAMILIES))
def test_record_decode_inverts_encode(t: tuple[str, int, str], family: bytes) -> None:
    assert keys.decode_record(keys.record(family, *t)) == (family, *t)


@given(ANY_TEXT, IDS, IDS, ANY_TEXT)
def test_due_decode_inverts_encode(zone: str, due_ms: int, msg_id: int, rcpt: str) -> None:
    assert keys.decode_due(keys.due(zone, due_ms, msg_id, rcpt)) == (zone, due_ms, msg_id, rcpt)


@given(ANY_TEXT, ANY_TEXT, ANY_TEXT)
def test_counter_decode_inverts_encode(name: str, zone: str, sub: str) -> None:
    assert keys.decode_counter(keys.counter(name, zone, sub)) == (name, zone, sub)


@given(st.integers(0, U64_MAX), st.integers(0, U64_MAX))
def test_event_keys_order_by_event_id(a: int, b: int) -> None:
    assert (keys.event(a) < keys.event(b)) == (a < b)
    assert keys.decode_event(keys.event(a)) == a


# Zone names for the isolation properties: anything, NUL and 0x01 (the escape bytes)
# included.
ZONES_ANY = st.text(
    alphabet=st.one_of(
        st.sampled_from([" ", "~", "\xff", "\u00e9", "\U0001f4e7", "a", "b", "\x00", "\x01"]),
        st.characters(exclude_categories=NO_SURROGATES),
    )
)


@given(zone_a=ZONES_ANY, zone_b=ZONES_ANY, msg_id=IDS, rcpt=ANY_TEXT)
@example(zone_a="a", zone_b="a b", msg_id=1, rcpt="x")
@example(zone_a="a b", zone_b="a", msg_id=1, rcpt="x")
@example(zone_a="a", zone_b="a\x01", msg_id=0, rcpt="\x00")
@example(zone_a="a", zone_b="", msg_id=0, rcpt="")
@example(zone_a="a", zone_b="b", msg_id=U64_MAX, rcpt="\x00")
@settings(max_examples=500)
def test_zone_prefix_isolation(zone_a: str, zone_b: str, msg_id: int, rcpt: str) -> None:
    assume(zone_a != zone_b)
    for family in (*keys.RECORD_FAMILIES, keys.DUE):
        prefix_b = keys.zone_prefix(family, zone_b)
        if family == keys.DUE:
            key = keys.due(zone_a, msg_id, msg_id, rcpt)
        else:
            key = keys.record(family, zone_a, msg_id, rcpt)
        assert not key.startswith(prefix_b)
    # Nor does a message's record prefix pick up a neighbouring zone.
    assert not keys.record(keys.READY, zone_a, msg_id, rcpt).startswith(
        keys.record_message_prefix(keys.READY, zone_b, msg_id)
    )


@given(st.tuples(ANY_TEXT, IDS, ANY_TEXT), IDS)
def test_message_record_prefix_isolation(t: tuple[str, int, str], other_id: int) -> None:
    zone, msg_id, rcpt = t
    assume(other_id != msg_id)
    key = keys.record(keys.READY, zone, msg_id, rcpt)
    assert key.startswith(keys.record_message_prefix(keys.READY, zone, msg_id))
    assert not key.startswith(keys.record_message_prefix(keys.READY, zone, other_id))


@given(ANY_TEXT, ZONES_ANY, ZONES_ANY, ANY_TEXT)
def test_counter_zone_prefix_isolation(name: str, zone_a: str, zone_b: str, sub: str) -> None:
    # Counters.items() scans counter(name, zone, "") without its last terminator.
    assume(zone_a != zone_b)
    prefix_b = keys.counter(name, zone_b, "")[:-1]
    assert not keys.counter(name, zone_a, sub).startswith(prefix_b)


DUE_TUPLES = st.tuples(ANY_TEXT, IDS, IDS, ANY_TEXT)


@given(a=DUE_TUPLES, b=DUE_TUPLES)
@example(a=("z", 1000, 9, "r"), b=("z", 2000, 1, "r"))
@example(a=("z", 1000, 1, "r"), b=("z", 1000, 2, "a"))
@example(a=("a", 9000, 1, "r"), b=("a b", 0, 1, "r"))
@settings(max_examples=500)
def test_due_key_order(a: tuple[str, int, int, str], b: tuple[str, int, int, str]) -> None:
    def order(t: tuple[str, int, int, str]) -> tuple[bytes, int, int, bytes]:
        return utf8(t[0]), t[1], t[2], utf8(t[3])

    ka, kb = keys.due(*a), keys.due(*b)
    assert (ka < kb) == (order(a) < order(b))
    assert (ka == kb) == (order(a) == order(b))


@given(prefix=st.binary(max_size=12), suffix=st.binary(max_size=12), other=st.binary(max_size=16))
@example(prefix=b"", suffix=b"x", other=b"")
@example(prefix=b"\xff", suffix=b"\xff\xff", other=b"\xff")
@example(prefix=b"a\xff", suffix=b"\xff", other=b"b")
@example(prefix=b"a\xff\xff", suffix=b"", other=b"a\xff\xff\xff")
@example(prefix=keys.zone_prefix(keys.READY, "z"), suffix=b"\xff" * 9, other=b"")
@settings(max_examples=500)
def test_prefix_upper_bound(prefix: bytes, suffix: bytes, other: bytes) -> None:
    bound = keys.prefix_upper_bound(prefix)
    key = prefix + suffix
    if bound is None:
        # Only a prefix of 0xFF bytes (or the empty prefix) has no upper bound.
        assert prefix.strip(b"\xff") == b""
        return
    assert key < bound
    assert not bound.startswith(prefix)
    # The smallest such bound: anything below it either has the prefix or sorts before it.
    if other < bound:
        assert other.startswith(prefix) or other < prefix
    # And the range [prefix, bound) is exactly the keys with the prefix.
    assert (prefix <= other < bound) == other.startswith(prefix)


@given(ANY_TEXT)
def test_zone_scan_range_holds_exactly_the_zone(zone: str) -> None:
    prefix = keys.zone_prefix(keys.READY, zone)
    bound = keys.prefix_upper_bound(prefix)
    assert bound is not None
    inside = keys.record(keys.READY, zone, U64_MAX, "\U0010ffff" * 3)
    assert prefix <= inside < bound


# --- regressions: the first encoding was FoundationDB's 00 -> 00 FF escape ---------------

# With it ``text(x)`` was a prefix of ``text(x + "\x00" + y)``, so a scan of zone "a" saw
# zone "a\x00b", and a raw u64 starting with FF right after a terminator read as an escaped
# NUL.  The encoding is now prefix-free (00 -> 01 01, 01 -> 01 02, 00 terminates).


@pytest.mark.parametrize(
    "family", [*keys.RECORD_FAMILIES, keys.DUE], ids=["ready", "deferred", "held", "due"]
)
def test_prefix_isolation_for_zone_continued_by_nul(family: bytes) -> None:
    if family == keys.DUE:
        key = keys.due("a\x00b", 1, 1, "r")
    else:
        key = keys.record(family, "a\x00b", 1, "r")
    assert not key.startswith(keys.zone_prefix(family, "a"))


def test_counter_prefix_isolation_for_zone_continued_by_nul() -> None:
    prefix = keys.counter("domain-ready", "", "")[:-1]
    assert not keys.counter("domain-ready", "\x00", "example.org").startswith(prefix)


_HIGH_ID = 0xFF00_0000_0000_0001


def test_order_holds_for_ids_with_high_first_byte() -> None:
    low = keys.record(keys.READY, "a", _HIGH_ID, "r")  # ("a", ...) < ("a\x00", ...)
    high = keys.record(keys.READY, "a\x00", 0, "r")
    assert low < high


def test_prefix_isolation_holds_for_ids_with_high_first_byte() -> None:
    key = keys.record(keys.READY, "a", _HIGH_ID, "r")
    assert not key.startswith(keys.zone_prefix(keys.READY, "a\x00"))
