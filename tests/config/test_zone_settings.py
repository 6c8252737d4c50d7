"""Zone settings, routing rules and plugin tables: each fault names its dotted key."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.plugins import write_plugin
from zoneq.config import InvalidConfig, check_config, loads_config
from zoneq.config.zones import limit_for, parse_rate

ZONES = "[zones.default]\n[zones.bounces]\n"


def problems_of(text: str) -> dict[str, str]:
    with pytest.raises(InvalidConfig) as info:
        loads_config(text)
    return {p.key: p.text for p in info.value.problems}


@pytest.mark.parametrize(
    ("text", "key", "problem"),
    [
        # unknown key, wrong type
        (
            ZONES + '[zones.bulk]\nrate_limit = "10/s"\n',
            "zones.bulk.rate_limit",
            "unknown key; known keys here: processes, connections, retry, max_age, ehlo_name",
        ),
        (ZONES + "[zones.bulk]\nrate = 10\n", "zones.bulk.rate", "expected a string"),
        (
            ZONES + '[[zones.bulk.pool]]\naddress = "127.0.0.2"\nratio = "1"\n',
            "zones.bulk.pool[0].ratio",
            "",  # pydantic's own words; the key is what matters
        ),
        # impossible values
        (ZONES + '[zones.bulk]\nrate = "0/s"\n', "zones.bulk.rate", "a rate of zero"),
        (ZONES + '[zones.bulk]\nrate = "10/day"\n', "zones.bulk.rate", "invalid rate"),
        (
            ZONES + '[[zones.bulk.pool]]\naddress = "127.0.0.2"\nratio = 0\n',
            "zones.bulk.pool[0].ratio",
            "must be more than 0",
        ),
        (
            ZONES + '[[zones.bulk.pool]]\naddress = "127.0.0.300"\n',
            "zones.bulk.pool[0].address",
            "invalid IP address",
        ),
        # (a pool address not this host's: tests/config/test_listen_addresses_elsewhere.py)
        (
            ZONES
            + '[[zones.bulk.pool]]\naddress = "127.0.0.2"\n'
            + '[[zones.bulk.pool]]\naddress = "127.0.0.2"\n',
            "zones.bulk.pool[1].address",
            "already in this pool",
        ),
        (
            ZONES + '[zones.bulk.smarthost]\nhost = "relay.example"\nport = 465\n',
            "zones.bulk.smarthost.tls",
            "implicit",
        ),
        (
            ZONES + '[zones.bulk.smarthost]\nhost = "relay.example"\n[zones.bulk.smarthost.auth]\n'
            'username = "u"\n',
            "zones.bulk.smarthost.auth.password",
            "required key is missing",
        ),
        (
            ZONES + '[delivery]\nmx_limits = { ".google.com" = 0 }\n',
            'delivery.mx_limits.".google.com"',
            "must be 1 or more",
        ),
        # routing rules
        (
            ZONES + '[[routing.rules]]\nrecipient_domain = ["gmail.com"]\nzone = "gmail"\n',
            "routing.rules[0].zone",
            "names zone 'gmail', which is not defined",
        ),
        (
            ZONES + '[[routing.rules]]\nzone = "default"\n',
            "routing.rules[0]",
            "exactly one of sender_domain, recipient_domain, client_network",
        ),
        (
            ZONES
            + '[[routing.rules]]\nsender_domain = ["a.test"]\nclient_network = ["10.0.0.0/8"]\n'
            + 'zone = "default"\n',
            "routing.rules[0]",
            "got 2",
        ),
        (
            ZONES + '[[routing.rules]]\nclient_network = ["10.0.0.1/8"]\nzone = "default"\n',
            "routing.rules[0].client_network[0]",
            "invalid network",
        ),
        (
            ZONES + '[[routing.rules]]\nrecipient_domain = ["*.gmail.com"]\nzone = "default"\n',
            "routing.rules[0].recipient_domain[0]",
            "invalid domain",
        ),
        (ZONES + '[routing]\nzone_header = "X Zone:"\n', "routing.zone_header", "RFC 5322"),
        # plugins
        (
            ZONES + '[plugins.nothere]\nmodule = "/nonexistent/nothere.py"\n',
            "plugins.nothere.module",
            "does not exist",
        ),
        (
            ZONES + '[plugins.x]\nmodule = "no_such_module_anywhere"\n',
            "plugins.x.module",
            "cannot import 'no_such_module_anywhere'",
        ),
        (ZONES + "[plugins.x]\ntimeout = 5\n", "plugins.x.timeout", "expected a string"),
        (ZONES + '[plugins."bad name"]\n', 'plugins."bad name"', "invalid plugin name"),
    ],
)
def test_bad_zone_routing_and_plugin_settings_name_the_key(
    text: str, key: str, problem: str
) -> None:
    problems = problems_of(text)
    assert key in problems, problems
    assert problem in problems[key]


def test_a_plugin_that_cannot_be_imported_is_reported_by_check_config(tmp_path: Path) -> None:
    broken = write_plugin(tmp_path, "broken", "import no_such_dependency\n")
    no_init = write_plugin(tmp_path, "noinit", "X = 1\n")
    config = tmp_path / "zoneq.toml"
    config.write_text(
        ZONES
        + f'[plugins.broken]\nmodule = "{broken}"\n'
        + f'[plugins.noinit]\nmodule = "{no_init}"\n',
        encoding="utf-8",
    )
    lines = check_config(config)
    assert len(lines) == 2
    assert lines[0].startswith("plugins.broken.module: ")
    assert "No module named 'no_such_dependency'" in lines[0]
    assert lines[1].startswith("plugins.noinit.module: ") and "no init(app)" in lines[1]


def test_plugin_options_are_validated_by_the_plugins_own_model(tmp_path: Path) -> None:
    module = write_plugin(
        tmp_path,
        "opts",
        """
        from pydantic import BaseModel, ConfigDict

        class Options(BaseModel):
            model_config = ConfigDict(extra="forbid")
            url: str
            retries: int = 3

        def init(app):
            pass
        """,
    )
    problems = problems_of(ZONES + f'[plugins.opts]\nmodule = "{module}"\noptions.retries = "x"\n')
    assert set(problems) == {"plugins.opts.options.url", "plugins.opts.options.retries"}


def test_a_valid_zone_with_every_new_setting_loads() -> None:
    config = loads_config(
        ZONES
        + '[zones.bulk]\nrate = "6000/min"\nipv6 = false\n'
        + '[[zones.bulk.pool]]\naddress = "127.0.0.2"\nehlo_name = "a.example"\nratio = 3\n'
        + '[[zones.bulk.pool]]\naddress = "127.0.0.3"\nratio = 0.5\n'
        + '[zones.bulk.smarthost]\nhost = "[127.0.0.9]"\nport = 2525\ntls = "none"\n'
        + '[delivery]\ndomain_limits = { "Gmail.com." = 20 }\nmx_limits = { ".google.com" = 40 }\n'
        + '[[routing.rules]]\nrecipient_domain = ["Gmail.COM"]\nzone = "bulk"\n'
    )
    bulk = config.zones["bulk"]
    assert bulk.rate_limit == (6000, 60_000)
    assert [(p.address, p.ehlo_name, p.ratio) for p in bulk.pool] == [
        ("127.0.0.2", "a.example", 3.0),
        ("127.0.0.3", None, 0.5),
    ]
    assert bulk.smarthost is not None and bulk.smarthost.port == 2525
    assert config.delivery.domain_limits == {"gmail.com": 20}
    assert config.routing.rules[0].recipient_domain == ["gmail.com"]
    assert config.zones["default"].rate_limit is None and config.zones["default"].pool == []


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("100/s", (100, 1000)),
        ("100 / sec", (100, 1000)),
        ("6000/min", (6000, 60_000)),
        ("20000/h", (20000, 3_600_000)),
        ("1/Hour", (1, 3_600_000)),
        ("1000000/s", (1_000_000, 1000)),  # the most a limit can space out
        ("60000000/min", (60_000_000, 60_000)),
    ],
)
def test_parse_rate(text: str, expected: tuple[int, int]) -> None:
    assert parse_rate(text) == expected


@pytest.mark.parametrize("text", ["0/s", "-1/s", "1.5/s", "10", "10/d", "/s", "ten/s"])
def test_parse_rate_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="rate"):
        parse_rate(text)


@pytest.mark.parametrize("text", ["1000001/s", "60000001/min", "999999999/s"])
def test_a_rate_too_fast_to_space_is_refused_with_the_limit(text: str) -> None:
    with pytest.raises(ValueError, match=r"more than 1,000,000/s: leave the key out"):
        parse_rate(text)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("gmail.com", 20),
        ("GMAIL.com.", 20),
        ("alt1.gmail-smtp-in.l.google.com", 40),
        ("google.com", None),  # ".google.com" is below google.com only
        ("mx.l.google.com", 7),  # the closest parent wins
        ("example.net", None),
    ],
)
def test_limit_for(name: str, expected: int | None) -> None:
    limits = {"gmail.com": 20, ".google.com": 40, ".l.google.com": 7}
    assert limit_for(limits, name) == (7 if name.endswith(".l.google.com") else expected)
