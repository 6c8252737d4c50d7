"""The free-space floor and the recovery reserve (zoneq/storage/space.py), on a real directory."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from zoneq.errors import InsufficientStorage
from zoneq.storage.space import SpaceGuard


def free_bytes(path: Path) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def test_no_floor_admits_anything(tmp_path: Path) -> None:
    SpaceGuard(tmp_path).admit(10**18)


def test_floor_refuses_when_the_message_would_cross_it(tmp_path: Path) -> None:
    free = free_bytes(tmp_path)
    guard = SpaceGuard(tmp_path, min_free=free // 2, interval=0.0)
    guard.admit(free // 8)
    with pytest.raises(InsufficientStorage, match="min_free"):
        guard.admit(free)  # this message would leave less than the floor
    with pytest.raises(InsufficientStorage):
        SpaceGuard(tmp_path, min_free=free * 2).admit()


def test_free_space_is_read_at_most_once_per_interval(tmp_path: Path) -> None:
    now = [0.0]
    guard = SpaceGuard(tmp_path, interval=5.0, clock=lambda: now[0])
    first = guard.free_bytes()
    (tmp_path / "big").write_bytes(b"x" * (4 << 20))
    assert guard.free_bytes() == first  # cached
    now[0] = 5.0
    assert guard.free_bytes() <= first  # read again


def test_reserve_is_really_allocated_then_released_and_restored(tmp_path: Path) -> None:
    guard = SpaceGuard(tmp_path, reserve=2 << 20)
    assert guard.restore()
    stat = guard.reserve_path.stat()
    assert stat.st_size == 2 << 20
    assert stat.st_blocks * 512 >= 2 << 20  # not sparse: deleting it frees real space
    assert not guard.restore()  # already there
    assert guard.release()
    assert not guard.reserve_path.exists()
    assert not guard.release()
    assert guard.restore()


def test_no_reserve_when_there_is_no_room_for_it_and_the_floor(tmp_path: Path) -> None:
    guard = SpaceGuard(tmp_path, reserve=free_bytes(tmp_path))
    assert not guard.restore()
    assert not guard.reserve_path.exists()
    assert not list(tmp_path.iterdir())  # no partial file left behind
