"""A plugin's ``timeout`` may be under a second (issue 5), down to a sane minimum."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.plugins import config_with, write_plugin
from zoneq.config import InvalidConfig
from zoneq.config.types import MIN_TIME_LIMIT_MS, time_limit_s


@pytest.mark.parametrize(
    ("text", "seconds"),
    [
        ("500ms", 0.5),
        ("100ms", 0.1),
        ("0.5s", 0.5),
        (".25s", 0.25),
        ("0.5", 0.5),
        ("1.5s", 1.5),
        ("5s", 5.0),
        ("2", 2.0),
        ("1m30s", 90.0),
        (" 250ms ", 0.25),
    ],
)
def test_time_limits_in_seconds(text: str, seconds: float) -> None:
    assert time_limit_s(text) == seconds


@pytest.mark.parametrize(
    ("text", "problem"),
    [
        ("0.05s", "too short: at least 100ms"),
        ("99ms", "too short"),
        ("0", "too short"),
        ("0.5ms", "under a second, write e.g. '500ms'"),
        ("1.5m", "invalid duration"),
        ("0.0001s", "invalid duration"),
        ("-1s", "negative duration"),
    ],
)
def test_bad_time_limits_name_the_plugins_timeout_key(
    tmp_path: Path, text: str, problem: str
) -> None:
    module = write_plugin(tmp_path, "p", "def init(app):\n    pass\n")
    with pytest.raises(InvalidConfig) as info:
        config_with({"p": {"module": module, "timeout": text}})
    [fault] = info.value.problems
    assert fault.key == "plugins.p.timeout" and problem in fault.text, fault


def test_a_sub_second_timeout_is_the_plugins_limit(tmp_path: Path) -> None:
    module = write_plugin(tmp_path, "p", "def init(app):\n    pass\n")
    config = config_with({"p": {"module": module, "timeout": "300ms"}})
    assert config.plugins["p"].timeout_s == 0.3


@given(st.integers(min_value=MIN_TIME_LIMIT_MS, max_value=10**7))
def test_milliseconds_and_decimal_seconds_agree(ms: int) -> None:
    decimal = f"{ms // 1000}.{ms % 1000:03d}s"
    assert time_limit_s(f"{ms}ms") == pytest.approx(ms / 1000)
    assert time_limit_s(decimal) == pytest.approx(ms / 1000)
