"""The intake frames and connection counts: pure, so tables and Hypothesis properties."""

from __future__ import annotations

import contextlib

import msgpack
import pytest
from hypothesis import given
from hypothesis import strategies as st

from zoneq.errors import InsufficientStorage, ProtocolError, StorageUnavailable, TemporaryFailure
from zoneq.ipc.intake_messages import (
    ConnectionCounts,
    ReceivedMessage,
    ReceivedRecipient,
    Status,
    decode_message,
    decode_recipients,
    encode_message,
    encode_recipients,
    error_from_reply,
    status_of,
)

text = st.text(max_size=40)
small_map = st.dictionaries(text, text, max_size=4)
u64 = st.integers(min_value=0, max_value=2**64 - 1)

messages = st.builds(
    ReceivedMessage,
    msg_id=u64,
    sender=text,
    size=u64,
    chunks=st.integers(min_value=0, max_value=2**32),
    received_ms=u64,
    ret=st.none() | st.sampled_from(["FULL", "HDRS"]),
    envid=st.none() | text,
    smtputf8=st.booleans(),
    body_8bit=st.booleans(),
    headers=small_map,
    source=small_map,
)
recipients = st.lists(
    st.builds(
        ReceivedRecipient,
        address=text,
        zone=text,
        notify=st.lists(st.sampled_from(["SUCCESS", "FAILURE", "DELAY", "NEVER"])).map(tuple),
        orcpt=st.none() | text,
    ),
    min_size=1,
    max_size=5,
)


def wire(obj: object) -> object:
    """Through msgpack as the frames carry it."""
    return msgpack.unpackb(msgpack.packb(obj, use_bin_type=True), raw=False)


@given(messages)
def test_a_message_survives_the_wire(message: ReceivedMessage) -> None:
    assert decode_message(wire(encode_message(message))) == message


@given(recipients)
def test_recipients_survive_the_wire(given_recipients: list[ReceivedRecipient]) -> None:
    assert decode_recipients(wire(encode_recipients(given_recipients))) == given_recipients


msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**63), 2**64 - 1) | text | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=12) | st.dictionaries(text, inner, max_size=4),
    max_leaves=30,
)


@given(msgpack_values)
def test_anything_else_is_a_protocol_error_never_a_crash(obj: object) -> None:
    for decode in (decode_message, decode_recipients):
        with contextlib.suppress(ProtocolError):
            decode(obj)


@pytest.mark.parametrize(
    ("field", "value"),
    [
        (0, -1),  # a negative id
        (0, True),  # a bool is not an id
        (1, b"bytes"),  # the sender must be text
        (5, 7),  # RET
        (7, 1),  # a flag that is not a bool
        (9, {"k": 1}),  # header values must be text
        (10, []),  # source must be a map
    ],
)
def test_a_bad_field_is_refused(field: int, value: object) -> None:
    good = encode_message(ReceivedMessage(1, "a@b", 10, 1, 5))
    good[field] = value
    with pytest.raises(ProtocolError):
        decode_message(good)


@pytest.mark.parametrize(
    "obj",
    [[], "x", [["a@b", "z", [], None, "extra"]], [["a@b", "z", ["NEVER", 1], None]]],
)
def test_bad_recipient_lists_are_refused(obj: object) -> None:
    with pytest.raises(ProtocolError):
        decode_recipients(obj)


@pytest.mark.parametrize(
    ("error", "status", "raised"),
    [
        (InsufficientStorage("floor"), Status.FULL, InsufficientStorage),
        (StorageUnavailable("sync failed"), Status.FAULT, TemporaryFailure),
        (ValueError("bad commit"), Status.FAULT, TemporaryFailure),
    ],
)
def test_store_errors_come_back_in_the_family_the_receiver_answers(
    error: Exception, status: Status, raised: type[Exception]
) -> None:
    assert status_of(error) is status
    back = error_from_reply(status_of(error), str(error))
    assert type(back) is raised
    assert str(error) in str(back)


def test_an_unknown_status_is_a_protocol_error() -> None:
    assert isinstance(error_from_reply(9, "?"), ProtocolError)


@given(st.lists(st.tuples(st.booleans(), st.sampled_from(["a", "b", "c"])), max_size=60))
def test_counts_never_pass_the_limit_and_follow_a_model(steps: list[tuple[bool, str]]) -> None:
    counts = ConnectionCounts(3)
    model: dict[str, int] = {}
    for opening, client in steps:
        if opening:
            expected = model.get(client, 0) < 3
            assert counts.admit(client) is expected
            if expected:
                model[client] = model.get(client, 0) + 1
        else:
            counts.release(client)
            model[client] = max(0, model.get(client, 0) - 1)
        assert counts.open(client) == model.get(client, 0) <= 3


def test_a_limit_below_one_is_refused() -> None:
    with pytest.raises(ValueError):
        ConnectionCounts(0)
