"""A listen address that is not this host's: serve and check-config refuse it, and every
other process that loads the config starts all the same.

Only serve binds ``receiver.listen``, ``receiver.tls_listen`` and ``api.listen``.  The check
once ran in every load, so after a failover moved the receiver's address to another host a
restarted worker exited 2 and the supervisor restarted it for ever (the zone stopped
delivering), and the admin CLI could not run on a host sharing the config.

The same for the source-address pools, which only the zone workers bind: serve,
check-config and a worker refuse one that is not this host's; a receiver, the admin CLI
and export load the config all the same.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import pytest

from tests.support.command import zoneq
from tests.support.serve import api_port, smtp_port, write_serve_config
from tests.test_supervisor import CHILDREN, child_config
from zoneq.api.command import client_from
from zoneq.cli import _child_config, build_parser
from zoneq.config import check_config, load_config
from zoneq.errors import ConfigError

ZONES = "[zones.default]\n[zones.bounces]\n"
ELSEWHERE = "192.0.2.1"  # TEST-NET-1 (RFC 5737): on no interface of this host
TOKEN = "t" * 32

# (the key, the config text that puts it on ELSEWHERE)
LISTENERS = [
    pytest.param("receiver.listen", f'[receiver]\nlisten = "{ELSEWHERE}:2525"\n', id="receiver"),
    pytest.param("api.listen", f'[api]\nlisten = "{ELSEWHERE}:8025"\n', id="api"),
]


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "zoneq.toml"
    path.write_text(text + ZONES, encoding="utf-8")
    return path


@pytest.mark.parametrize(("key", "text"), LISTENERS)
def test_serve_and_check_config_refuse_it_naming_the_key(
    tmp_path: Path, key: str, text: str
) -> None:
    path = write(tmp_path, text)
    with pytest.raises(ConfigError) as info:
        load_config(path, serving=True)
    assert info.value.key == key
    assert f"{ELSEWHERE} is not an address of this host (bind failed: " in info.value.problem
    assert check_config(path)[0].startswith(f"{key}: {ELSEWHERE} is not an address")


@pytest.mark.integration
@pytest.mark.parametrize(("section", "port"), [("receiver", smtp_port), ("api", api_port)])
def test_serve_refuses_it_before_the_queue_opens(
    tmp_path: Path, section: str, port: Callable[[Path], int]
) -> None:
    """``zoneq serve`` itself: exit 2 naming the key, said before the queue is opened (no
    data directory made or locked) rather than as a bind failure after it."""
    directory = tmp_path / "zoneq"
    # No mail is delivered: the MX and DNS ports are never used.
    config = write_serve_config(directory, mx_port=25, dns_port=53)
    local = f"127.0.0.1:{port(config)}"
    config.write_text(config.read_text().replace(local, f"{ELSEWHERE}:{port(config)}"))
    done = zoneq("serve", "--config", str(config), timeout=60)
    assert done.returncode == 2, done.stderr
    assert f"{section}.listen: {ELSEWHERE} is not an address of this host" in done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert not (directory / "queue").exists()
    assert not (directory / "zoneq.sock").exists()


@pytest.mark.parametrize(("key", "text"), LISTENERS)
def test_a_load_that_binds_nothing_accepts_it(tmp_path: Path, key: str, text: str) -> None:
    config = load_config(write(tmp_path, text))
    section, name = key.split(".")
    assert getattr(getattr(config, section), name).startswith(f"{ELSEWHERE}:")


@pytest.mark.parametrize("child", CHILDREN, ids=lambda child: child[0])
@pytest.mark.parametrize("on_stdin", [True, False], ids=["stdin", "file"])
def test_a_restarted_child_starts_after_failover_moved_the_address(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, child: list[str], on_stdin: bool
) -> None:
    """The worker's and the receiver's own path (``_child_config``), with the text serve
    handed on (stdin) or a file named (a child started by hand)."""
    path = write(tmp_path, f'[receiver]\nlisten = "{ELSEWHERE}:2525"\n')
    if on_stdin:
        config = child_config(monkeypatch, child, path.read_text(), "--config", str(path))
    else:
        parsed = build_parser(internal_only=True).parse_args([*child, "--config", str(path)])
        config = _child_config(parsed)
    assert config.receiver.listen_address[0] == ELSEWHERE


def test_the_admin_cli_runs_on_a_host_without_the_addresses(tmp_path: Path) -> None:
    """``zoneq queue ...`` on another host of the cluster: the API it talks to is the one
    on ``api.listen``, which is not this host's, and the receiver's is not either."""
    path = write(
        tmp_path,
        f'[receiver]\nlisten = "{ELSEWHERE}:2525"\n'
        f'[api]\nlisten = "{ELSEWHERE}:8025"\ntoken = "{TOKEN}"\n',
    )
    args = build_parser().parse_args(["queue", "counts", "--config", str(path)])
    client = client_from(args)
    assert (client.host, client.port, client.token) == (ELSEWHERE, 8025, TOKEN)


# --- source-address pools: bound by the zone workers only ------------------------------

POOL = f'[[zones.default.pool]]\naddress = "{ELSEWHERE}"\n'
POOL_KEY = "zones.default.pool[0].address"


def test_serve_and_check_config_refuse_a_pool_address_elsewhere(tmp_path: Path) -> None:
    path = write(tmp_path, POOL)
    with pytest.raises(ConfigError) as info:
        load_config(path, serving=True)
    assert info.value.key == POOL_KEY
    assert f"{ELSEWHERE} is not an address of this host (bind failed: " in info.value.problem
    assert check_config(path)[0].startswith(f"{POOL_KEY}: {ELSEWHERE} is not an address")


@pytest.mark.parametrize("on_stdin", [True, False], ids=["stdin", "file"])
def test_a_worker_refuses_a_pool_address_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_stdin: bool
) -> None:
    """A worker binds its zone's pool addresses: one that is gone fails at its start,
    naming the key, not at every connection."""
    path = write(tmp_path, POOL)
    worker = CHILDREN[0]
    with pytest.raises(ConfigError) as info:
        if on_stdin:
            child_config(monkeypatch, worker, path.read_text(), "--config", str(path))
        else:
            parsed = build_parser(internal_only=True).parse_args([*worker, "--config", str(path)])
            _child_config(parsed)
    assert info.value.key == POOL_KEY


@pytest.mark.parametrize("on_stdin", [True, False], ids=["stdin", "file"])
def test_a_receiver_accepts_a_pool_address_elsewhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, on_stdin: bool
) -> None:
    path = write(tmp_path, POOL)
    receiver = CHILDREN[1]
    if on_stdin:
        config = child_config(monkeypatch, receiver, path.read_text(), "--config", str(path))
    else:
        parsed = build_parser(internal_only=True).parse_args([*receiver, "--config", str(path)])
        config = _child_config(parsed)
    assert str(config.zones["default"].pool[0].address) == ELSEWHERE


def test_the_admin_cli_and_export_run_on_a_host_without_the_pool_addresses(
    tmp_path: Path,
) -> None:
    """The shared config of a cluster whose delivery host holds the pool addresses: the
    admin CLI and export load it as it is (``load_config`` with no check of this host)."""
    path = write(tmp_path, POOL + f'[api]\ntoken = "{TOKEN}"\n')
    assert str(load_config(path).zones["default"].pool[0].address) == ELSEWHERE
    args = build_parser().parse_args(["queue", "counts", "--config", str(path)])
    assert client_from(args).token == TOKEN
