"""``[server] bounce_from``: the From of zoneq's notices, checked at load like the builder
checks it (an ASCII addr-spec), so a bad value names its key instead of failing a bounce."""

from __future__ import annotations

import pytest

from zoneq.config import loads_config
from zoneq.errors import ConfigError

ZONES = "[zones.default]\n[zones.bounces]\n"


def test_unset_by_default() -> None:
    assert loads_config(ZONES).server.bounce_from is None


@pytest.mark.parametrize("value", ["postmaster@example.com", "MAILER-DAEMON@mx.example.com"])
def test_an_address_is_taken(value: str) -> None:
    config = loads_config(f'[server]\nbounce_from = "{value}"\n{ZONES}')
    assert config.server.bounce_from == value


@pytest.mark.parametrize(
    "value",
    [
        '"postmaster"',
        '"@example.com"',
        '"post master@example.com"',
        '"jörg@example.com"',
        '""',
        "1",
    ],
    ids=["no-domain", "no-local-part", "space", "non-ascii", "empty", "not-a-string"],
)
def test_a_bad_value_names_the_key(value: str) -> None:
    with pytest.raises(ConfigError) as caught:
        loads_config(f"[server]\nbounce_from = {value}\n{ZONES}")
    assert caught.value.key == "server.bounce_from"
