"""A small tmpfs for a test that needs a disk that really fills up.

``mount -t tmpfs`` needs root.  A tmpfs that cannot be had is ``missing`` under the test
bed's rule (``testbed.py``): it fails the test when the bed was set up (``ZONEQ_TESTBED``,
as in CI), where a skip would hide that the full-disk tests never ran, and skips it in a
run by hand.  Used by the storage tests and by the fault suite's bed alike.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

from tests.support.testbed import missing


def mounted_tmpfs(mount_point: Path, size: str) -> Iterator[Path]:
    """Mount a tmpfs of ``size`` at ``mount_point`` for the test, unmount after."""
    if os.geteuid() != 0:
        missing("mounting a tmpfs needs root")
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(mount_point)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        missing(f"cannot mount a tmpfs here: {mounted.stderr.strip() or mounted.returncode}")
    try:
        yield mount_point
    finally:
        done = subprocess.run(["umount", str(mount_point)], capture_output=True, check=False)
        if done.returncode != 0:
            # Busy (a process still holds a file there): detach it now, gone when released.
            subprocess.run(["umount", "-l", str(mount_point)], capture_output=True, check=False)
