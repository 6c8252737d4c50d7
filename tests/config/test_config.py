"""Configuration loading: the shipped files load, and every bad config names its key."""

from __future__ import annotations

import pickle
import re
import tomllib
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from pydantic import BaseModel, ValidationError

from zoneq.config import (
    Config,
    InvalidConfig,
    check_config,
    default_config_text,
    load_config,
    loads_config,
)
from zoneq.config.loader import dotted_key
from zoneq.config.model import ServerConfig, ZoneConfig
from zoneq.errors import ConfigError

REPO = Path(__file__).resolve().parents[2]
EXAMPLE = REPO / "config" / "zones.toml"

# The two zones the default routing names; most bad configs below need them to be
# otherwise valid, so that the fault under test is the only one.
ZONES = "[zones.default]\n[zones.bounces]\n"


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "zoneq.toml"
    path.write_text(text, encoding="utf-8")
    return path


# --- the shipped configurations ------------------------------------------------------------


def test_embedded_default_loads() -> None:
    config = load_config()
    assert set(config.zones) == {"default", "bounces"}
    assert config.routing.default_zone == "default"
    assert config.routing.bounce_zone == "bounces"


def test_embedded_default_restates_the_model_defaults() -> None:
    # default.toml says it doubles as the list of defaults; keep that true.
    assert load_config() == Config.model_validate({"zones": {"default": {}, "bounces": {}}})


def default_blocks() -> dict[str, str]:
    """default.toml's text under each ``[table]`` header, up to the next one."""
    blocks: dict[str, list[str]] = {"": []}
    table = ""
    for line in default_config_text().splitlines():
        if header := re.fullmatch(r"\[([^\]]+)\]\s*", line):
            table = header[1]
            blocks[table] = []
        else:
            blocks[table].append(line)
    return {name: "\n".join(lines) for name, lines in blocks.items()}


def section_models() -> list[tuple[str, type[BaseModel]]]:
    """Each table of default.toml with the model its keys are the fields of."""
    sections = [
        (name, field.annotation)
        for name, field in Config.model_fields.items()
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)
    ]
    return [*sections, ("zones.default", ZoneConfig), ("zones.bounces", ZoneConfig)]


@pytest.mark.parametrize(("table", "model"), section_models())
def test_embedded_default_lists_every_key(table: str, model: type[BaseModel]) -> None:
    """A key missing from default.toml leaves the comparison above equal (the model fills
    it in), so the file would stop being the list of defaults unseen.  A key whose
    default is unset (None) may be named in a comment instead, as there is no value."""
    block = default_blocks()[table]
    values = tomllib.loads(f"[{table}]\n{block}")
    for part in table.split("."):
        values = values[part]
    notes = " ".join(line.partition("#")[2] for line in block.splitlines())
    missing = [
        name
        for name, field in model.model_fields.items()
        if name not in values and not (field.default is None and re.search(rf"\b{name}\b", notes))
    ]
    assert missing == [], f"[{table}] in default.toml lacks {missing}"


def test_embedded_default_names_every_section() -> None:
    text = default_config_text()
    for name in Config.model_fields:  # plugins: none by default, so only named
        assert re.search(rf"^#? ?\[{name}[.\]]", text, re.MULTILINE), name


def test_embedded_default_is_declared_as_package_data() -> None:
    # Without this entry the wheel would ship without default.toml and load_config() would
    # fail only once installed.
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
    assert "config/default.toml" in pyproject["tool"]["setuptools"]["package-data"]["zoneq"]
    assert "[zones.default]" in default_config_text()


def test_shipped_example_loads() -> None:
    config = load_config(EXAMPLE)
    assert {"default", "transactional", "bulk", "bounces"} <= set(config.zones)
    assert config.zones["bulk"].ipv6 is False
    assert check_config(EXAMPLE) == []


def test_defaults_of_every_key() -> None:
    config = loads_config(ZONES)
    assert config.server.hostname is None
    assert config.server.data_dir == Path("./data/queue")
    assert config.storage.sync_commits is True
    assert config.storage.chunk_size == 65536
    assert config.storage.event_retention_ms == 30 * 86_400_000
    assert config.storage.sweep_interval_ms == 10 * 60_000
    assert config.storage.receive_timeout_ms == 10 * 60_000
    zone = config.zones["default"]
    assert (zone.processes, zone.connections, zone.ehlo_name, zone.ipv6) == (1, 10, None, True)
    assert zone.schedule.intervals_ms == (15 * 60_000, 30 * 60_000, 2 * 3_600_000, 4 * 3_600_000)
    assert zone.max_age_ms == 72 * 3_600_000
    assert config.routing.bounce_max_age_ms == 24 * 3_600_000
    # Issue 4: the API and the receiver are bound to loopback unless configured otherwise.
    for built in (config, load_config()):
        assert built.api.listen == "127.0.0.1:8025"
        assert built.receiver.listen_address[0] == "127.0.0.1"
        assert built.receiver.tls_listen is None and built.receiver.postmaster is None


def test_schedules_are_parsed() -> None:
    config = loads_config(
        '[zones.default]\nretry = "1m | 5m"\nmax_age = "2h"\n'
        '[zones.bounces]\nretry = "10m | 1h"\n'
        '[routing]\nbounce_max_age = "6h"\n'
    )
    assert config.zones["default"].schedule.intervals_ms == (60_000, 300_000)
    assert config.zones["default"].schedule.max_age_ms == 7_200_000
    # Our own bounces: the bounce zone's intervals, with routing.bounce_max_age.
    assert config.bounce_schedule.intervals_ms == (600_000, 3_600_000)
    assert config.bounce_schedule.max_age_ms == 6 * 3_600_000


def test_resolved_hostname(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr("socket.getfqdn", lambda: "host.from.resolver")
    assert ServerConfig().resolved_hostname() == "host.from.resolver"
    assert ServerConfig(hostname="mx.example.com").resolved_hostname() == "mx.example.com"


def test_config_is_frozen() -> None:
    config = load_config()
    with pytest.raises(ValidationError):
        config.storage.chunk_size = 4096  # type: ignore[misc]


def test_zone_name_with_dot_is_accepted_and_quoted_in_keys() -> None:
    text = ZONES + '[zones."eu.bulk"]\nconnections = 0\n'
    with pytest.raises(InvalidConfig) as info:
        loads_config(text)
    assert info.value.key == 'zones."eu.bulk".connections'
    assert "eu.bulk" in loads_config(ZONES + '[zones."eu.bulk"]\n').zones


# --- bad configurations ----------------------------------------------------------------------

BAD = [
    pytest.param("colour = 1\n" + ZONES, "colour", "unknown key", id="unknown-top-level-key"),
    pytest.param(
        '[server]\nhost = "mx.example.com"\n' + ZONES,
        "server.host",
        "did you mean 'hostname'",
        id="unknown-server-key-suggests",
    ),
    pytest.param(
        "[zones.default]\nconections = 3\n[zones.bounces]\n",
        "zones.default.conections",
        "did you mean 'connections'",
        id="unknown-zone-key",
    ),
    pytest.param(
        "[zones.default]\nspeed = 3\n[zones.bounces]\n",
        "zones.default.speed",
        "known keys here: processes, connections",
        id="unknown-zone-key-lists-known",
    ),
    pytest.param(
        '[zones.default]\nconnections = "ten"\n[zones.bounces]\n',
        "zones.default.connections",
        'expected an integer, got string "ten"',
        id="connections-not-integer",
    ),
    pytest.param(
        '[zones.default]\nconnections = "10"\n[zones.bounces]\n',
        "zones.default.connections",
        "expected an integer",
        id="no-string-to-integer-coercion",
    ),
    pytest.param(
        '[zones.default]\nipv6 = "yes"\n[zones.bounces]\n',
        "zones.default.ipv6",
        'expected true or false, got string "yes"',
        id="ipv6-not-boolean",
    ),
    pytest.param(
        "[zones.default]\nprocesses = 0\n[zones.bounces]\n",
        "zones.default.processes",
        "must be 1 or more, got integer 0",
        id="zero-processes",
    ),
    pytest.param(
        "[zones.default]\nprocesses = -2\n[zones.bounces]\n",
        "zones.default.processes",
        "must be 1 or more, got integer -2",
        id="negative-processes",
    ),
    pytest.param(
        ZONES + '[zones."bulk mail"]\n',
        'zones."bulk mail"',
        "invalid zone name 'bulk mail'",
        id="zone-name-with-space",
    ),
    pytest.param(
        ZONES + f"[zones.{'z' * 65}]\n",
        f"zones.{'z' * 65}",
        "1 to 64 letters",
        id="zone-name-too-long",
    ),
    pytest.param(
        "zones.default = 3\n[zones.bounces]\n",
        "zones.default",
        "expected a table, got integer 3",
        id="zone-not-a-table",
    ),
    pytest.param(
        '[zones.default]\nretry = "15m | soon"\n[zones.bounces]\n',
        "zones.default.retry",
        "entry 2",
        id="bad-retry-spec",
    ),
    pytest.param(
        '[zones.default]\nretry = "15m || 1h"\n[zones.bounces]\n',
        "zones.default.retry",
        "entry 2 is empty",
        id="empty-retry-entry",
    ),
    pytest.param(
        '[zones.default]\nmax_age = "3 days"\n[zones.bounces]\n',
        "zones.default.max_age",
        "invalid duration '3 days'",
        id="bad-zone-duration",
    ),
    pytest.param(
        '[storage]\nsweep_interval = "10min"\n' + ZONES,
        "storage.sweep_interval",
        "invalid duration '10min'",
        id="bad-storage-duration",
    ),
    pytest.param(
        '[storage]\nreceive_timeout = "0s"\n' + ZONES,
        "storage.receive_timeout",
        "greater than zero",
        id="zero-duration",
    ),
    pytest.param(
        "[storage]\nevent_retention = 30\n" + ZONES,
        "storage.event_retention",
        "expected a string, got integer 30",
        id="duration-not-a-string",
    ),
    pytest.param(
        '[zones.default]\nretry = "2h | 4h"\nmax_age = "1h"\n[zones.bounces]\n',
        "zones.default.max_age",
        "'1h' is shorter than the first retry interval (2h)",
        id="max-age-shorter-than-first-retry",
    ),
    pytest.param(
        "[storage]\nchunk_size = 1024\n" + ZONES,
        "storage.chunk_size",
        "must be 4096 or more, got integer 1024",
        id="chunk-size-too-small",
    ),
    pytest.param(
        "[storage]\nchunk_size = 2097152\n" + ZONES,
        "storage.chunk_size",
        "must be 1048576 or less",
        id="chunk-size-too-large",
    ),
    pytest.param(
        '[server]\nhostname = "mail server"\n' + ZONES,
        "server.hostname",
        "invalid host name 'mail server'",
        id="bad-hostname",
    ),
    pytest.param(
        '[zones.default]\nehlo_name = "-bad-.example"\n[zones.bounces]\n',
        "zones.default.ehlo_name",
        "invalid host name",
        id="bad-ehlo-name",
    ),
    pytest.param(
        '[routing]\ndefault_zone = "outbound"\n' + ZONES,
        "routing.default_zone",
        "names zone 'outbound', which is not defined in [zones]",
        id="default-zone-missing",
    ),
    pytest.param(
        "[zones.default]\n",
        "routing.bounce_zone",
        "names zone 'bounces', which is not defined in [zones]",
        id="bounce-zone-missing",
    ),
    pytest.param(
        '[zones.default]\n[zones.bounces]\nretry = "2d"\nmax_age = "3d"\n',
        "routing.bounce_max_age",
        "'24h' is shorter than the first retry interval of zone 'bounces' (2d)",
        id="bounce-max-age-shorter-than-bounce-retry",
    ),
    pytest.param(
        '[server]\nhostname = "mx.example.com"\n',
        "zones",
        "no zones defined",
        id="no-zones",
    ),
    pytest.param("zones = {}\n", "zones", "no zones defined", id="empty-zones"),
    # Issue 4: values check-config used to pass and serve then crashed or misbehaved on.
    pytest.param(
        '[storage]\nevent_retention = "100000d"\n' + ZONES,
        "storage.event_retention",
        "duration '100000d' is longer than 100 years: at most '36500d'",
        id="duration-past-the-ceiling",
    ),
    pytest.param(
        f'[storage]\nevent_retention = "{"9" * 30}d"\n' + ZONES,
        "storage.event_retention",
        "is longer than 100 years: at most '36500d'",
        id="duration-of-30-digits",
    ),
    pytest.param(
        '[delivery]\nnameservers = ["127.0.0.1", "not-an-ip"]\n' + ZONES,
        "delivery.nameservers[1]",
        "invalid IP address 'not-an-ip'",
        id="nameserver-not-an-address",
    ),
    *(
        pytest.param(
            f'[{section}]\n{key} = ""\n' + ZONES,
            f"{section}.{key}",
            "must not be empty",
            id=f"empty-{key}",
        )
        for section, key in (
            ("server", "data_dir"),
            ("server", "ipc_socket"),
            ("api", "token_file"),
            ("receiver", "tls_cert"),
            ("receiver", "tls_key"),
        )
    ),
    pytest.param(
        "[zones.default]\nconnections = 99999999999999\n[zones.bounces]\n",
        "zones.default.connections",
        "must be 1000 or less, got integer 99999999999999",
        id="connections-unbounded",
    ),
    pytest.param(
        "[zones.default]\nprocesses = 65\n[zones.bounces]\n",
        "zones.default.processes",
        "must be 64 or less, got integer 65",
        id="processes-unbounded",
    ),
    pytest.param(
        f'[server]\nipc_socket = "/run/{"s" * 103}"\n' + ZONES,
        "server.ipc_socket",
        "is 108 bytes, and a Unix socket path may have at most 107",
        id="ipc-socket-past-sun-path",
    ),
    pytest.param(
        '[api]\nlisten = "no such host:8025"\n' + ZONES,
        "api.listen",
        "the host must be an IP address or 'localhost'",
        id="listen-host-not-an-address",
    ),
    pytest.param(
        '[receiver]\nlisten = "2001:db8::25"\n' + ZONES,
        "receiver.listen",
        "an IPv6 address goes in brackets and is followed by a port",
        id="listen-ipv6-unbracketed",
    ),
    pytest.param(
        '[api]\nlisten = "127.0.0.1:2525"\n' + ZONES,
        "api.listen",
        "the same address as receiver.listen (127.0.0.1:2525): use another port",
        id="api-on-the-receivers-address",
    ),
    pytest.param(
        '[api]\nlisten = "localhost:2525"\n[receiver]\nlisten = "0.0.0.0:2525"\n' + ZONES,
        "api.listen",
        "the same address as receiver.listen (0.0.0.0:2525)",
        id="api-on-the-receivers-wildcard",
    ),
    pytest.param(
        '[receiver]\ntls_cert = "/nonexistent/cert.pem"\ntls_key = "/nonexistent/key.pem"\n'
        + ZONES,
        "receiver.tls_cert",
        "cannot read /nonexistent/cert.pem: no such file",
        id="tls-cert-missing-names-the-path",
    ),
    pytest.param(
        '[zones.default]\nretry = "15m | 40000d"\n[zones.bounces]\n',
        "zones.default.retry",
        "entry 2: duration '40000d' is longer than 100 years: at most '36500d'",
        id="retry-interval-past-the-ceiling",
    ),
    *(
        pytest.param(
            f"[{section}]\n{key} = {value}\n" + ZONES,
            f"{section}.{key}",
            f'expected an integer number of bytes or a string like "50MiB", got {got}',
            id=f"size-{key}-{got.split()[0]}",
        )
        for section, key, value, got in (
            ("receiver", "max_message_size", "true", "boolean true"),
            ("storage", "min_free", "1000.7", "float 1000.7"),
            ("storage", "reserve", '"lots"', 'string "lots"'),
        )
    ),
    pytest.param(
        '[storage]\nreserve = "1KiB"\n' + ZONES,
        "storage.reserve",
        "1024 bytes is too small to recover with: 0 for none, or at least 8MiB",
        id="reserve-too-small",
    ),
    # check-config accepted these, or named the key with a message that misled.
    pytest.param(
        "[storage]\nreserve = 1000000000000000\n" + ZONES,
        "storage.reserve",
        "1000000000000000 bytes is more than recovery can use: at most 1GiB",
        id="reserve-too-large",
    ),
    pytest.param(
        '[storage]\nreserve = "1025MiB"\n' + ZONES,
        "storage.reserve",
        "at most 1GiB",
        id="reserve-just-past-its-ceiling",
    ),
    pytest.param(
        "[storage]\nmin_free = -1\n" + ZONES,
        "storage.min_free",
        "must be 0 or more, got integer -1",
        id="size-negative-integer",
    ),
    pytest.param(
        '[delivery]\ntls = "always"\n' + ZONES,
        "delivery.tls",
        "must be one of 'opportunistic', 'required' or 'none', got string \"always\"",
        id="tls-not-one-of-the-choices",
    ),
    pytest.param(
        '[api]\ntoken = "abc"\n' + ZONES,
        "api.token",
        "must be at least 16 characters long",
        id="api-token-too-short",
    ),
    pytest.param(
        ZONES + '[[routing.rules]]\nsender_domian = ["a.example"]\nzone = "default"\n',
        "routing.rules[0].sender_domian",
        "did you mean 'sender_domain'",
        id="unknown-key-in-an-array-of-tables",
    ),
    # A listen address not on this host: only serve's load refuses it, in
    # test_listen_addresses_elsewhere.py (no other process binds it).
]


@pytest.mark.parametrize(("text", "key", "problem"), BAD)
def test_bad_config_names_key_and_problem(
    tmp_path: Path, text: str, key: str, problem: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert info.value.key == key
    assert problem in info.value.problem
    assert str(info.value).startswith(f"{key}: ")
    assert f"{key}: " in check_config(path)[0]


def test_every_problem_is_listed_one_per_line() -> None:
    text = (
        "[storage]\nchunk_size = 1\n"
        '[zones.default]\nconnections = "ten"\nprocesses = 0\n'
        '[zones.bounces]\nretry = "x"\n'
    )
    with pytest.raises(InvalidConfig) as info:
        loads_config(text)
    error = info.value
    keys = [p.key for p in error.problems]
    assert keys == [
        "storage.chunk_size",
        "zones.default.processes",
        "zones.default.connections",
        "zones.bounces.retry",
    ]
    # .key/.problem describe the first fault, as for any ConfigError.
    assert error.key == "storage.chunk_size"
    assert "4096" in error.problem
    assert str(error).splitlines() == [str(p) for p in error.problems]


def test_invalid_config_survives_pickling() -> None:
    # Worker processes report exceptions to their parent by pickling them.
    with pytest.raises(InvalidConfig) as info:
        loads_config("[zones.main]\n")
    copy = pickle.loads(pickle.dumps(info.value))
    assert (copy.key, copy.problems, str(copy)) == (
        info.value.key,
        info.value.problems,
        str(info.value),
    )


def test_both_missing_routing_zones_are_reported() -> None:
    with pytest.raises(InvalidConfig) as info:
        loads_config("[zones.main]\n")
    assert [p.key for p in info.value.problems] == ["routing.default_zone", "routing.bounce_zone"]


def test_toml_syntax_error_names_file_and_line(tmp_path: Path) -> None:
    path = write(tmp_path, '[server]\nhostname = "mx.example.com"\ndata_dir = = "x"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "invalid TOML" in message
    assert "line 3" in message
    assert str(path) in message
    assert check_config(path) == [message]


def test_missing_file_names_path(tmp_path: Path) -> None:
    path = tmp_path / "absent.toml"
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert str(path) in str(info.value)
    assert "does not exist" in str(info.value)
    assert check_config(path) == [str(info.value)]


def test_directory_instead_of_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as info:
        load_config(tmp_path)
    assert "cannot read config file" in str(info.value)


def test_file_not_utf8(tmp_path: Path) -> None:
    path = tmp_path / "latin1.toml"
    path.write_bytes(b'[server]\nhostname = "caf\xe9"\n')
    with pytest.raises(ConfigError) as info:
        load_config(path)
    assert "not UTF-8" in str(info.value)


# --- dotted keys ------------------------------------------------------------------------------

# "[key]" is excluded: it is pydantic's marker for a fault in a dict key, which
# dotted_key drops by design (test_dotted_key_drops_pydantic_dict_key_marker).
_KEY_PART = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=["Cs"]),
    min_size=1,
    max_size=20,
).filter(lambda part: part != "[key]")


@given(st.lists(_KEY_PART, min_size=1, max_size=4))
def test_dotted_key_is_a_toml_key_for_the_same_path(parts: list[str]) -> None:
    # The key we print must lead back to the same place if pasted into a TOML file.
    data = tomllib.loads(f"{dotted_key(tuple(parts))} = 1\n")
    node: object = data
    for part in parts:
        assert isinstance(node, dict)
        node = node[part]
    assert node == 1


def test_dotted_key_drops_pydantic_dict_key_marker() -> None:
    assert dotted_key(("zones", "bad name", "[key]")) == 'zones."bad name"'
    assert dotted_key(("zones", "bulk", "connections")) == "zones.bulk.connections"


@pytest.mark.parametrize(
    ("text", "expected"),
    [('min_free = "1GiB"', 1 << 30), ('min_free = "512MB"', 512_000_000), ("min_free = 0", 0)],
)
def test_storage_sizes_parse_with_units(text: str, expected: int) -> None:
    config = loads_config(f"[storage]\n{text}\n[zones.default]\n[zones.bounces]\n")
    assert int(config.storage.min_free) == expected


@pytest.mark.parametrize("value", ['"lots"', '"-5MB"', "true"])
def test_bad_storage_size_names_the_key(value: str) -> None:
    with pytest.raises(ConfigError) as caught:
        loads_config(f"[storage]\nreserve = {value}\n[zones.default]\n[zones.bounces]\n")
    assert caught.value.key == "storage.reserve"


def test_tls_policy_per_domain_overrides_the_default_case_insensitively() -> None:
    config = loads_config(
        '[delivery]\ntls = "opportunistic"\ntls_policy = { "Bank.Example" = "required" }\n'
        "[zones.default]\n[zones.bounces]\n"
    )
    assert config.delivery.tls_for("bank.example") == "required"
    assert config.delivery.tls_for("BANK.example") == "required"
    assert config.delivery.tls_for("other.example") == "opportunistic"


def test_a_bad_tls_policy_names_the_key() -> None:
    with pytest.raises(ConfigError) as caught:
        loads_config(
            '[delivery]\ntls_policy = { "bank.example" = "maybe" }\n'
            "[zones.default]\n[zones.bounces]\n"
        )
    assert caught.value.key.startswith("delivery.tls_policy")


@pytest.mark.parametrize(
    "text",
    [
        '[storage]\nreserve = 0\nevent_retention = "36500d"\n',
        '[storage]\nreserve = "8MiB"\n',
        '[storage]\nreserve = "1GiB"\n',
        '[delivery]\nnameservers = ["127.0.0.1", "::1"]\n',
        '[receiver]\nlisten = "[::1]:2525"\n[api]\nlisten = "localhost:8025"\n',
        '[receiver]\nlisten = "0.0.0.0:25"\n[api]\nlisten = "127.0.0.1:8025"\n',
        # The API off holds no port, so it cannot collide with the receiver.
        '[receiver]\nlisten = "127.0.0.1:2525"\n'
        '[api]\nenabled = false\nlisten = "127.0.0.1:2525"\n',
        '[receiver]\nlisten = "127.0.0.1:0"\n[api]\nlisten = "127.0.0.1:0"\n',
        # A wildcard takes its own family's addresses only (IPv6 sockets are V6ONLY).
        '[receiver]\nlisten = "[::]:8025"\n[api]\nlisten = "127.0.0.1:8025"\n',
        '[receiver]\nlisten = "0.0.0.0:8025"\n[api]\nlisten = "[::1]:8025"\n',
        '[receiver]\nlisten = "Localhost.:2525"\n',
        f'[server]\nipc_socket = "/run/{"s" * 102}"\n',  # 107 bytes: the most sun_path holds
    ],
)
def test_the_limits_themselves_are_accepted(text: str) -> None:
    loads_config(text + ZONES)
