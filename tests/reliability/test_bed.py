"""The tmpfs of the fault suite and the storage tests follows the test bed's rule: what it
cannot have fails under ``ZONEQ_TESTBED`` (CI), and only skips when the bed was not set up
(a run by hand)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import tmpfs


@pytest.fixture(params=["under the test bed", "by hand"])
def outcome(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> type[Exception]:
    """The environment of one case, and what a missing part must then raise."""
    if request.param == "by hand":
        monkeypatch.delenv("ZONEQ_TESTBED", raising=False)
        return pytest.skip.Exception
    monkeypatch.setenv("ZONEQ_TESTBED", "1")
    return pytest.fail.Exception


# (euid, size, what the message says): not root; root, but mount(8) refuses the size (it
# cannot parse it, root or not), which is the real failure path of the mount itself.
CASES = [(1000, "1m", "needs root"), (0, "not-a-size", "cannot mount a tmpfs")]


@pytest.mark.parametrize("case", CASES, ids=["not root", "mount refused"])
def test_a_tmpfs_that_cannot_be_had_is_missing_under_the_bed_rule(
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    outcome: type[Exception],
    case: tuple[int, str, str],
) -> None:
    euid, size, says = case
    monkeypatch.setattr(tmpfs.os, "geteuid", lambda: euid)
    with pytest.raises(outcome, match=says):
        next(tmpfs.mounted_tmpfs(tmp_path / "disk", size))
    assert not (tmp_path / "disk").is_mount()
