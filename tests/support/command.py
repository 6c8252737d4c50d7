"""The ``zoneq`` command as a new process, from the repository (as a user or set-up runs it)."""

from __future__ import annotations

import subprocess
import sys

from tests.support.serve import ROOT


def zoneq(
    *args: str, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """Run ``python -m zoneq ARGS`` to the end (bounded by ``timeout``); never raises for a
    non-zero exit status: the tests read it."""
    return subprocess.run(
        [sys.executable, "-m", "zoneq", *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
