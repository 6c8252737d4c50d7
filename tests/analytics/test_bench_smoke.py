"""tools/bench/analytics_bench.py still runs (a tiny count; the figure is not checked)."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration


def test_analytics_benchmark_runs(tmp_path: Path) -> None:
    done = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "bench" / "analytics_bench.py"),
            "--events",
            "3000",
            "--formats",
            "jsonl",
            "--dir",
            str(tmp_path),
            "--class-cache",
            "off",
        ],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "report s" in done.stdout and "3,000 jsonl" in done.stdout
    assert "facets:" in done.stdout  # the job's phase times are shown
