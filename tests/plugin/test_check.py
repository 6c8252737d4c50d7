"""Plugins' own ``init`` checks run in ``zoneq check-config`` and refuse ``zoneq serve``.

One config with four faults only ``init`` can find (a DKIM key file that does not exist, a
rules_router rule naming an undefined zone, a webhook event that does not exist, a
suppression file that does not exist): the real commands must name all four, by plugin.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.command import zoneq
from tests.support.plugins import BUNDLED, write_plugin
from tests.support.serve import START_TIMEOUT, start_serve, write_serve_config
from zoneq.config import Config, load_config
from zoneq.config.loader import Problem
from zoneq.plugin.check import _named_plugins, config_problems, plugin_problems

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
    done = zoneq("check-config", str(config), timeout=60)
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


def test_a_plugin_that_does_not_import_hides_no_other_plugins_init_fault(tmp_path: Path) -> None:
    # The loader refuses the file for the syntax error; DKIM's missing key is only found by
    # its init, which check-config must still run, in the same run (plugins/README.md).
    broken = write_plugin(tmp_path, "broken", "def init(app)\n    pass\n")
    config = write_serve_config(tmp_path / "bed", mx_port=1, dns_port=1)
    config.write_text(
        config.read_text()
        + f"""
[plugins.broken]
module = "{broken}"

[plugins.dkim]
module = "{BUNDLED / "dkim.py"}"
[plugins.dkim.options.domains."shop.example"]
selector = "s1"
key_file = "{tmp_path / "no-such-key.pem"}"
"""
    )
    done = zoneq("check-config", str(config), timeout=60)
    assert done.returncode == 1, done
    assert "2 problem(s)" in done.stderr, done.stderr
    lines = [line.strip() for line in done.stderr.splitlines()[1:]]
    assert len(lines) == 2, done.stderr
    assert lines[0].startswith("plugins.broken.module: ") and "SyntaxError" in lines[0]
    assert lines[1].startswith('plugins.dkim.options.domains."shop.example".key_file: ')
    assert "no-such-key.pem" in lines[1]


ZONES = "[zones.default]\n[zones.bounces]\n"
INIT_FAILS = "def init(app):\n    raise RuntimeError('no key')\n"
SIZE_OPTION = (
    "from pydantic import BaseModel\n"
    "class Options(BaseModel):\n    size: int\n"
    "def init(app):\n    pass\n"
)


@pytest.mark.parametrize(
    ("extra", "plugins", "expected"),
    [
        pytest.param(  # a bad option; the plugin whose name is its prefix still runs init
            "",
            {"p2": (SIZE_OPTION, 'options.size = "big"'), "p": (INIT_FAILS, "")},
            ["plugins.p2.options.size: ", "plugins.p: init failed: RuntimeError: no key"],
            id="bad-option",
        ),
        pytest.param(  # top-level code that fails: reported once, and run once (below)
            "",
            {
                "top": ("open(MARK, 'a').write('x')\nraise OSError('top')\n", ""),
                "q": (INIT_FAILS, ""),
            },
            ["plugins.top.module: importing", "plugins.q: init failed: RuntimeError: no key"],
            id="import-fails",
        ),
        pytest.param(  # a pool address that is not this host's hides no plugin fault
            '[[zones.default.pool]]\naddress = "192.0.2.1"\n',
            {"q": (INIT_FAILS, "")},
            ["zones.default.pool[0].address: 192.0.2.1", "plugins.q: init failed: RuntimeError"],
            id="pool",
        ),
        pytest.param(  # the model itself refused: no plugin loaded, so no init to run
            "[zones.default.nonsense]\n",
            {"q": (INIT_FAILS, "")},
            ["zones.default.nonsense: "],
            id="model-fault",
        ),
        pytest.param(
            "",
            {"q": (INIT_FAILS, "")},
            ["plugins.q: init failed: RuntimeError: no key"],
            id="init-only",
        ),
        pytest.param("", {"ok": ("def init(app):\n    pass\n", "")}, [], id="clean"),
    ],
)
def test_config_problems_lists_the_loaders_faults_then_every_loaded_plugins_init(
    tmp_path: Path, extra: str, plugins: dict[str, tuple[str, str]], expected: list[str]
) -> None:
    mark = tmp_path / "imports"
    text = ZONES + extra
    for name, (source, table) in plugins.items():
        module = write_plugin(tmp_path, name, source.replace("MARK", repr(str(mark))))
        text += f'[plugins.{name}]\nmodule = "{module}"\n{table}\n'
    path = tmp_path / "zoneq.toml"
    path.write_text(text, encoding="utf-8")
    lines, config = config_problems(path)
    assert len(lines) == len(expected), lines
    for line, start in zip(lines, expected, strict=True):
        assert line.startswith(start), lines
    # The loader's config only when it found nothing (the token check needs it).
    assert (config is not None) == all("init failed" in line for line in lines)
    if "top" in plugins:  # the failing import ran once: not again for the init checks
        assert mark.read_text() == "x"


# Mostly from two letters, so that one name is often another's prefix (dkim, dkim2).
_PLUGIN_NAMES = st.from_regex(r"[ab][ab2_-]{0,3}", fullmatch=True) | st.from_regex(
    r"[A-Za-z][A-Za-z0-9_-]{0,63}", fullmatch=True
)
_SUFFIXES = st.sampled_from(["", ".module", ".options.size", '.options.domains."a.b"'])


@given(st.data(), st.sets(_PLUGIN_NAMES, min_size=1, max_size=6))
def test_named_plugins_are_exactly_those_a_problem_key_falls_under(
    data: st.DataObject, names: set[str]
) -> None:
    config = Config.model_validate(
        {"zones": {"default": {}, "bounces": {}}, "plugins": {name: {} for name in names}}
    )
    named = data.draw(st.sets(st.sampled_from(sorted(names))))
    problems = [Problem(f"plugins.{n}{data.draw(_SUFFIXES)}", "bad") for n in named]
    problems.append(Problem("zones.default.pool[0].address", "not local"))
    assert _named_plugins(config, problems) == named
