"""The benchmarks still run (tiny sizes; figures are not checked, only that they print)."""

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.testbed import missing

ROOT = Path(__file__).resolve().parents[1]
EXIT_MISSING = 77  # what a benchmark needing the test bed exits with when it is incomplete


@pytest.mark.parametrize(
    ("script", "args", "expect"),
    [
        (
            "store_bench.py",
            ["--messages", "256", "--producers", "8", "--deliveries", "3000", "--rounds", "1"],
            "oldest ready recipient",
        ),
        ("encoder_bench.py", ["--megabytes", "1"], "MB/s"),
        (
            "delivery_bench.py",
            [
                "--messages",
                "50",
                "--domains",
                "5",
                "--processes",
                "1",
                "--connections",
                "2",
                "--bulk-recipients",
                "50",
                "--timeout",
                "60",
            ],
            "result: zoneq",
        ),
    ],
)
def test_benchmark_runs(script: str, args: list[str], expect: str, tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench" / script), *args],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    if result.returncode == EXIT_MISSING:  # a test-bed program is not installed
        missing(result.stderr.strip())
    assert result.returncode == 0, result.stderr
    assert expect in result.stdout
