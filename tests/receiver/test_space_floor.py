"""A big message without SIZE= on a nearly full queue disk: 452 after DATA, never ENOSPC.

The queue lives on a small tmpfs (root only: ``tests/support/tmpfs.py``) with a floor of
10 MiB and a reserve of 8 MiB, and about 60 MiB free.  A client sends 100 MiB without
declaring SIZE= (RFC 1870 makes it optional), so only the chunk writes can see it coming:
the message must be refused with 452 4.3.1 at the floor, the database must never hit
ENOSPC, the session must go on, and one maintenance round must compact the abandoned
body's range so the free space (and new mail) come back.
"""

from __future__ import annotations

import base64
import os
from pathlib import Path

import pytest

from tests.receiver.harness import Raw, leftovers, make_config, nothing_left, run
from tests.support.tmpfs import mounted_tmpfs
from zoneq.receiver import SmtpReceiver
from zoneq.runtime import maintain
from zoneq.storage.space import SpaceGuard
from zoneq.storage.store import QueueStore

pytestmark = pytest.mark.integration

MIB = 1 << 20
MIN_FREE, RESERVE, LEFT_FREE = 10 * MIB, 8 * MIB, 60 * MIB
MESSAGE_MIB = 100


def free(path: Path) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


def text_mib() -> bytes:
    """1 MiB of base64 lines: valid message text that snappy cannot shrink."""
    line = base64.b64encode(os.urandom(57)) + b"\r\n"  # 78 octets
    return b"".join(base64.b64encode(os.urandom(57)) + b"\r\n" for _ in range(MIB // len(line)))


def test_undeclared_big_message_gets_452_at_the_floor_and_maintenance_heals(
    tmp_path: Path,
) -> None:
    for mount_point in mounted_tmpfs(tmp_path / "tmpfs", "90m"):

        async def body(rx: SmtpReceiver, store: QueueStore) -> None:
            queue = store.database.path
            store.space = SpaceGuard(queue, min_free=MIN_FREE, reserve=RESERVE)
            assert store.space.restore()
            fd = os.open(queue.parent / "filler", os.O_WRONLY | os.O_CREAT, 0o600)
            try:
                os.posix_fallocate(fd, 0, free(queue) - LEFT_FREE)
            finally:
                os.close(fd)
            store.space.free_bytes(fresh=True)  # as any reading after the filler would

            raw = await Raw.connect(rx.port)
            await raw.start()  # MAIL without SIZE=
            await raw.send(b"Subject: big\r\n\r\n")
            piece = text_mib()
            for _ in range(MESSAGE_MIB):
                await raw.send(piece)
                assert store.failure is None, "the database ran into ENOSPC"
            reply = await raw.cmd(".")
            assert reply.startswith("452 4.3.1"), reply
            assert store.failure is None
            assert store.space.reserve_path.exists()
            assert (await raw.cmd("NOOP")).startswith("250")  # the session goes on
            await nothing_left(store)
            assert leftovers(store) == []

            await maintain(store, make_config())  # one round: sweep, compact, reserve
            assert store.space.reserve_path.exists()
            assert free(queue) > MIN_FREE + RESERVE, free(queue) // MIB
            assert (await raw.cmd("MAIL FROM:<c@d.test>")).startswith("250")
            await raw.cmd("QUIT")
            await raw.close()

        run(mount_point, body, max_message_size="200MiB")
