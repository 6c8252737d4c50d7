"""Plugins' own ``init`` checks run in ``zoneq check-config`` and refuse ``zoneq serve``.

One config with four faults only ``init`` can find (a DKIM key file that does not exist, a
rules_router rule naming an undefined zone, a webhook event that does not exist, a
suppression file that does not exist): the real commands must name all four, by plugin.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.plugins import BUNDLED, write_plugin
from tests.support.serve import ROOT, START_TIMEOUT, start_serve, write_serve_config
from zoneq.config import load_config
from zoneq.plugin.check import plugin_problems

FAULTS = {  # each fault named down to its option
    'plugins.dkim.options.domains."shop.example".key_file': "key file",
    "plugins.rules_router.options.rules[0].zone": "nowhere",
    "plugins.webhooks.options.events": "exploded",
    "plugins.suppression.options.file": "missing.json",
}


def four_fault_config(tmp_path: Path) -> Path:
    config = write_serve_config(tmp_path / "bed", mx_port=1, dns_port=1)
    config.write_text(
        config.read_text()
        + f"""
[plugins.dkim]
module = "{BUNDLED / "dkim.py"}"
[plugins.dkim.options.domains."shop.example"]
selector = "s1"
key_file = "{tmp_path / "no-such-key.pem"}"

[plugins.rules_router]
module = "{BUNDLED / "rules_router.py"}"
options.rules = [{{ sender = "*@shop.example", zone = "nowhere" }}]

[plugins.webhooks]
module = "{BUNDLED / "webhooks.py"}"
options.url = "http://127.0.0.1:9/hook"
options.events = ["delivered", "exploded"]

[plugins.suppression]
module = "{BUNDLED / "suppression.py"}"
options.file = "{tmp_path / "missing.json"}"
"""
    )
    return config


def assert_names_every_fault(text: str) -> None:
    lines = [line.strip() for line in text.splitlines()]
    for key, detail in FAULTS.items():
        hits = [line for line in lines if line.startswith(key) and detail in line]
        assert len(hits) == 1, (key, text)


def test_check_config_names_every_plugins_init_fault(tmp_path: Path) -> None:
    config = four_fault_config(tmp_path)
    done = subprocess.run(
        [sys.executable, "-m", "zoneq", "check-config", str(config)],
        cwd=ROOT,
        check=False,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 1, done
    assert "4 problem(s)" in done.stderr
    assert_names_every_fault(done.stderr)
    assert 'plugins.dkim.options.domains."shop.example".key_file: ' in done.stderr


def test_serve_refuses_to_start_naming_every_fault(tmp_path: Path) -> None:
    config = four_fault_config(tmp_path)
    serve = start_serve(config, tmp_path / "serve.log")
    try:
        code = serve.process.wait(timeout=START_TIMEOUT)
    finally:
        serve.cleanup()
    assert code == 2
    assert_names_every_fault(serve.log_text())
    assert not serve.survivors()


def test_a_good_config_still_checks_ok_and_init_side_effects_are_closed(tmp_path: Path) -> None:
    closed = tmp_path / "closed"
    module = write_plugin(
        tmp_path,
        "closing",
        f"""
        from pathlib import Path

        def init(app):
            app.on_close(lambda: Path({str(closed)!r}).write_text("closed"))
        """,
    )
    config = write_serve_config(tmp_path / "bed", mx_port=1, dns_port=1)
    config.write_text(config.read_text() + f'\n[plugins.closing]\nmodule = "{module}"\n')
    assert plugin_problems(load_config(config)) == []
    assert closed.read_text() == "closed"


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (
            "from zoneq.plugin import OptionError\n"
            "def init(app):\n"
            "    raise ExceptionGroup('two', [OptionError(('a',), 'bad a'),"
            " OptionError(('b', 0, 'c d'), 'bad b')])\n",
            ["plugins.p.options.a: bad a", 'plugins.p.options.b[0]."c d": bad b'],
        ),
        (
            "def init(app):\n    raise SystemExit(3)\n",
            ["plugins.p: init failed: SystemExit: 3"],
        ),
    ],
)
def test_init_problems_name_the_option_the_plugin_blamed(
    tmp_path: Path, source: str, expected: list[str]
) -> None:
    module = write_plugin(tmp_path, "p", source)
    config = write_serve_config(tmp_path / "bed", mx_port=1, dns_port=1)
    config.write_text(config.read_text() + f'\n[plugins.p]\nmodule = "{module}"\n')
    assert [str(p) for p in plugin_problems(load_config(config))] == expected
