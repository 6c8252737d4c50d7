"""The import rules of ARCHITECTURE.md section 8, checked with import-linter.

The contracts live in pyproject.toml: layers that import downwards only, a protocol core
that imports no I/O, and plyvel imported by zoneq/storage/leveldb.py alone.
"""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_import_contracts_are_kept() -> None:
    lint_imports = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run(
        [str(lint_imports), "--no-cache"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout
