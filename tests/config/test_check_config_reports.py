"""What ``zoneq check-config`` says of mistakes that it once reported misleadingly, or only
one at a time: a plugin's unknown option answered with the top-level sections as the known
keys; a fault of ``Config``'s own checks hidden behind a bad value in another section; a
zone's second fault hidden behind its first; and the recovery reserve (``storage.reserve``),
which had no ceiling and, when there was no room for it at start-up, was silently absent.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.support.command import zoneq
from tests.support.plugins import BUNDLED
from tests.support.tmpfs import mounted_tmpfs
from zoneq.cli import main
from zoneq.config import loads_config
from zoneq.runtime import open_store

ZONES = "[zones.default]\n[zones.bounces]\n"


def check_config_lines(tmp_path: Path, text: str, capsys: pytest.CaptureFixture[str]) -> list[str]:
    """The problems the real check-config command prints for ``text``, one per line."""
    path = tmp_path / "zoneq.toml"
    path.write_text(text, encoding="utf-8")
    assert main(["check-config", str(path)]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert lines[0] == f"{path}: {len(lines) - 1} problem(s)"
    return [line.strip() for line in lines[1:]]


def plugin(name: str, options: str) -> str:
    return ZONES + f'[plugins.{name}]\nmodule = "{BUNDLED / name}.py"\noptions = {{ {options} }}\n'


# --- a plugin's options: the plugin's own keys ----------------------------------------------------


@pytest.mark.parametrize(
    ("text", "line"),
    [
        pytest.param(
            plugin("suppression", 'file = "s.txt", zzzz = "drop"'),
            "plugins.suppression.options.zzzz: unknown key; known keys here: file, action",
            id="lists-the-plugins-options",
        ),
        pytest.param(
            plugin("suppression", 'file = "s.txt", acton = "drop"'),
            "plugins.suppression.options.acton: unknown key (did you mean 'action'?)",
            id="suggests-the-plugins-option",
        ),
        pytest.param(
            plugin("webhooks", 'url = "http://127.0.0.1:9/", retry = 3'),
            "plugins.webhooks.options.retry: unknown key (did you mean 'retries'?)",
            id="another-plugin-another-model",
        ),
        pytest.param(
            plugin("dkim", 'domains = { "a.example" = { selector = "s", key_file = "k", x = 1 } }'),
            'plugins.dkim.options.domains."a.example".x: unknown key; known keys here: selector, ',
            id="a-table-inside-the-options",
        ),
    ],
)
def test_an_unknown_plugin_option_is_answered_with_that_plugins_keys(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, line: str
) -> None:
    lines = check_config_lines(tmp_path, text, capsys)
    assert [entry for entry in lines if entry.startswith(line)] == lines[:1], lines
    assert "server, storage, zones" not in "\n".join(lines)


def test_check_config_takes_the_file_as_serve_does(tmp_path: Path) -> None:
    """The report's reproduction: ``--config FILE``, as for serve, is the file checked (it
    was a usage error), in a new process."""
    path = tmp_path / "zoneq.toml"
    path.write_text(plugin("suppression", 'file = "s.txt", zzzz = "drop"'), encoding="utf-8")
    done = zoneq("check-config", "--config", str(path), timeout=60)
    assert done.returncode == 1, done.stderr
    assert "zzzz: unknown key; known keys here: file, action" in done.stderr


# --- every fault of the model in one run ----------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "keys"),
    [
        pytest.param(
            '[storage]\nchunk_size = 1\n[routing]\ndefault_zone = "nope"\n' + ZONES,
            ["storage.chunk_size", "routing.default_zone"],
            id="a-bad-value-and-an-undefined-zone",
        ),
        pytest.param(
            '[delivery]\nmx_port = 0\n[api]\nlisten = "127.0.0.1:2525"\n' + ZONES,
            ["delivery.mx_port", "api.listen"],
            id="a-bad-value-and-the-api-on-the-receivers-port",
        ),
        pytest.param(
            '[zones.default]\nretry = "2h"\nmax_age = "1h"\nipv6 = false\n'
            '[[zones.default.pool]]\naddress = "::1"\n[zones.bounces]\n',
            ["zones.default.max_age", "zones.default.ipv6"],
            id="both-faults-of-one-zone",
        ),
        # The check alone at fault: reported once, not again by the second look.
        pytest.param(
            ZONES + '[[routing.rules]]\nsender_domain = ["a.example"]\nzone = "bulk"\n',
            ["routing.rules[0].zone"],
            id="only-the-check-at-fault",
        ),
        # A fault in a section the checks read: they are not run on a stand-in default,
        # which would blame api.listen for the default receiver.listen it equals.
        pytest.param(
            '[receiver]\nlisten = "127.0.0.1"\n[api]\nlisten = "127.0.0.1:2525"\n' + ZONES,
            ["receiver.listen"],
            id="no-guess-when-a-checked-section-is-at-fault",
        ),
    ],
)
def test_every_fault_of_the_model_in_one_run(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, keys: list[str]
) -> None:
    lines = check_config_lines(tmp_path, text, capsys)
    assert [line.split(": ", 1)[0] for line in lines] == keys, lines


# --- the recovery reserve at start-up -------------------------------------------------------------


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    """A 32 MiB tmpfs: room for an 8 MiB reserve, not for a 1 GiB one."""
    yield from mounted_tmpfs(tmp_path / "tmpfs", "32m")


@pytest.mark.parametrize(("reserve", "in_place"), [("8MiB", True), ("1GiB", False)])
def test_a_reserve_without_room_is_a_warning_naming_the_key(
    small_disk: Path, caplog: pytest.LogCaptureFixture, reserve: str, in_place: bool
) -> None:
    config = loads_config(
        f'[server]\ndata_dir = "{small_disk / "queue"}"\n'
        f'[storage]\nmin_free = "1MiB"\nreserve = "{reserve}"\n' + ZONES
    )
    with caplog.at_level(logging.WARNING, logger="zoneq"):
        store = open_store(config)  # a real LevelDB queue, on a disk really that small
    try:
        assert store.space.reserve_path.exists() == in_place
        warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        if in_place:
            assert warnings == []
        else:
            assert len(warnings) == 1 and warnings[0].startswith(
                "storage.reserve: the recovery reserve of 1073741824 bytes is not in place: "
            )
    finally:
        asyncio.run(store.close())
