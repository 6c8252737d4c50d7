"""What a zone worker or receiver process imports when the supervisor starts it.

The supervisor runs ``python -m zoneq worker ...`` for every worker (and again for each
restart); importing all of zoneq there (the HTTP API, aiohttp, the exporters, a scrypt
at import) cost 0.78 s and 74 MB per process, against 0.45 s and 43 MB for what it uses.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from tests.support.command import zoneq
from tests.support.serve import ROOT
from zoneq.cli import _command_of

HEAVY = ("aiohttp", "zoneq.api.app", "zoneq.export.command", "zoneq.runtime")


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["worker", "--zone", "a", "--name", "b"], "worker"),
        (["--log-level", "DEBUG", "receiver", "--name", "r"], "receiver"),
        (["--log-level", "worker", "serve"], "serve"),  # "worker" is the level's value there
        (["queue", "list"], "queue"),
        (["--version"], None),
        ([], None),
    ],
)
def test_the_command_is_the_first_word_that_is_not_an_option(
    argv: list[str], command: str | None
) -> None:
    assert _command_of(argv) == command


@pytest.mark.parametrize("command", ["worker", "receiver"])
def test_internal_commands_leave_the_heavy_modules_alone(command: str) -> None:
    probe = (
        "import sys\n"
        "from zoneq.cli import build_parser, _command_of, _INTERNAL\n"
        f"assert _command_of([{command!r}]) in _INTERNAL\n"
        "build_parser(internal_only=True)\n"
        f"print([m for m in {HEAVY!r} if m in sys.modules])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]", out.stdout + out.stderr


def test_the_full_command_line_still_has_every_command() -> None:
    from zoneq.cli import build_parser

    help_text = build_parser().format_help()
    for command in ("serve", "worker", "receiver", "check-config", "queue", "send", "export"):
        assert command in help_text


@pytest.mark.parametrize("level", ["bogus", ""])
def test_an_unknown_log_level_is_a_usage_error(level: str) -> None:
    done = zoneq("--log-level", level, "check-config", timeout=60)
    assert done.returncode == 2, done.stderr
    assert "argument --log-level: invalid choice" in done.stderr
    assert "Traceback" not in done.stderr


def test_the_log_level_is_read_in_any_case() -> None:
    done = zoneq("--log-level", "warning", "check-config", timeout=60)
    assert done.returncode == 0, done.stderr
    assert "the built-in configuration: ok" in done.stdout


@pytest.mark.parametrize("args", [("check-config",), ("check-config", "config/zones.toml")])
def test_a_reader_gone_is_no_traceback(args: tuple[str, ...]) -> None:
    """``zoneq queue show ID | head``: the reader closed the pipe; stop quietly, exit 1."""
    read, write = os.pipe()
    os.close(read)  # gone before a word is written: every write is EPIPE
    try:
        done = subprocess.run(
            [sys.executable, "-m", "zoneq", *args],
            cwd=ROOT,
            stdout=write,
            stderr=subprocess.PIPE,
            text=True,
            timeout=60,
            check=False,
        )
    finally:
        os.close(write)
    assert done.returncode == 1, done.stderr
    # Only check-config's own warnings (the built-in config's hostname on a machine without
    # a FQDN) go to stderr: nothing about the closed pipe.
    assert all(": warning: " in line for line in done.stderr.splitlines()), done.stderr
