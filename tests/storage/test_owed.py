"""The ``owed`` family's keys and values (``zoneq/storage/owed.py``): pure round trips."""

from __future__ import annotations

import pytest

from zoneq.errors import StorageCorruption
from zoneq.storage import keys
from zoneq.storage.owed import OwedFailure, OwedOriginal
from zoneq.storage.records import MessageMeta

MSG = 0x1A2004BA127000
HEADERS = b"From: a@src.test\r\nSubject: s\r\n\r\n"


@pytest.mark.parametrize(
    "failure",
    [
        OwedFailure("default", "u@dest.test", "5.1.1", "550 5.1.1 no", "mx.dest.test", 1, None),
        OwedFailure("a b", "us\x00er@dest.test", "4.4.7", None, None, 2**40, "rfc822;u@x"),
        OwedFailure("z\x01", "jörg@dést.test", "5.0.0", "", None, 0, "utf-8;j\\x{F6}rg"),
    ],
)
def test_an_owed_failure_reads_back_from_its_key_and_value(failure: OwedFailure) -> None:
    key = keys.owed_failure(MSG, failure.zone, failure.address)
    assert key.startswith(keys.owed_prefix(MSG))
    assert keys.decode_owed(key) == MSG
    assert OwedFailure.decode(key, failure.encode()) == failure


@pytest.mark.parametrize("full", [None, HEADERS + b"body\r\n"])
def test_an_owed_original_reads_back(full: bytes | None) -> None:
    meta = MessageMeta(MSG, "s@src.test", 40, 1, 5, zones=("default",), ret="FULL", envid="e")
    original = OwedOriginal(meta, full if full is not None else HEADERS, full)
    key = keys.owed_original(MSG)
    assert OwedOriginal.decode(key, MSG, original.encode()) == original


def test_one_messages_owed_keys_are_not_anothers() -> None:
    """Prefix-safe (``keys.py``, promise 1): a scan of one message's records never reads
    the next message's, and the original sorts before the failures."""
    mine = [keys.owed_original(MSG), keys.owed_failure(MSG, "z", "a@b")]
    theirs = [keys.owed_original(MSG + 1), keys.owed_failure(MSG + 1, "z", "a@b")]
    assert all(k.startswith(keys.owed_prefix(MSG)) for k in mine)
    assert not any(k.startswith(keys.owed_prefix(MSG)) for k in theirs)
    assert sorted(mine) == mine


@pytest.mark.parametrize("value", [b"", b"\x93\x02\xa1x\xc0", b"\xc1"])
def test_a_damaged_owed_value_is_corruption(value: bytes) -> None:
    key = keys.owed_failure(MSG, "z", "a@b")
    with pytest.raises(StorageCorruption):
        OwedFailure.decode(key, value)
    with pytest.raises(StorageCorruption):
        OwedOriginal.decode(keys.owed_original(MSG), MSG, value)
