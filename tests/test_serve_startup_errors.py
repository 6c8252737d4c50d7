"""Start-up errors of ``zoneq serve`` (and of a worker, and of check-config), as real
processes: each is one line naming the config key and the path, a non-zero exit status, and
no Python traceback.

* ``server.data_dir`` that cannot be created (under a regular file) or is a regular file;
* ``server.ipc_socket`` that another zoneq (other data directory, other ports) serves, or
  under a regular file (a missing directory for it is created, mode 0700);
* a worker started with no core listening;
* ``api.token_file`` missing: check-config says so, as serve does; readable by group or
  others: a warning from both, not a refusal.
"""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from tests.support.command import zoneq
from tests.support.serve import running_serve, set_config_line, write_serve_config

pytestmark = pytest.mark.integration


def a_config(directory: Path) -> Path:
    # No mail is delivered in these tests: the MX and DNS ports are never used.
    return write_serve_config(directory, mx_port=25, dns_port=53)


@pytest.mark.parametrize(
    ("where", "reason"),
    [("under-a-file/queue", "Not a directory"), ("a-file", "File exists")],
)
def test_a_data_dir_that_cannot_be_created_is_one_line_naming_the_key(
    tmp_path: Path, where: str, reason: str
) -> None:
    (tmp_path / "under-a-file").write_text("not a directory\n")
    (tmp_path / "a-file").write_text("not a directory\n")
    config = a_config(tmp_path / "zoneq")
    set_config_line(config, "api", f'data_dir = "{tmp_path / where!s}"')
    done = zoneq("serve", "--config", str(config))
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    expected = f"zoneq: server.data_dir: cannot create {tmp_path / where}: {reason}"
    assert done.stderr.strip() == expected


def test_a_second_serve_on_the_same_ipc_socket_is_one_line_naming_the_key(
    tmp_path: Path,
) -> None:
    first = a_config(tmp_path / "a")
    second = a_config(tmp_path / "b")  # its own data directory and ports
    socket_path = tmp_path / "a" / "zoneq.sock"
    set_config_line(second, "api", f'ipc_socket = "{socket_path!s}"')
    with running_serve(first, tmp_path / "a.log"):
        done = zoneq("serve", "--config", str(second))
        assert socket_path.exists()  # the first one's socket was left alone
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (  # after the queue's "open" line
        f"zoneq: server.ipc_socket {socket_path}: another process is accepting connections on it"
    )


def test_a_missing_directory_for_the_ipc_socket_is_created_0700(tmp_path: Path) -> None:
    config = a_config(tmp_path / "zoneq")
    socket_path = tmp_path / "run" / "zoneq" / "zoneq.sock"
    set_config_line(config, "server", f'ipc_socket = "{socket_path!s}"')
    with running_serve(config, tmp_path / "serve.log"):
        assert socket_path.is_socket()
        assert stat.S_IMODE(socket_path.parent.stat().st_mode) == 0o700


@pytest.mark.parametrize(
    ("where", "problem"),
    [
        ("a-file/zoneq.sock", "{tmp}/a-file is not a directory"),
        ("a-file/run/zoneq.sock", "cannot create its directory: Not a directory"),
    ],
)
def test_an_ipc_socket_under_a_regular_file_is_one_line_naming_the_key(
    tmp_path: Path, where: str, problem: str
) -> None:
    (tmp_path / "a-file").write_text("not a directory\n")
    config = a_config(tmp_path / "zoneq")
    socket_path = tmp_path / where
    set_config_line(config, "server", f'ipc_socket = "{socket_path!s}"')
    done = zoneq("serve", "--config", str(config))
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (  # after the queue's "open" line
        f"zoneq: server.ipc_socket {socket_path}: {problem.format(tmp=tmp_path)}"
    )


def test_a_worker_with_no_core_listening_exits_1_with_one_line(tmp_path: Path) -> None:
    config = a_config(tmp_path / "zoneq")
    done = zoneq("worker", "--zone", "default", "--name", "default-0", "--config", str(config))
    assert done.returncode == 1, done.stderr
    assert "Traceback" not in done.stderr, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot connect to the core at" in lines[0], done.stderr
    assert "worker default-0 of zone default" in lines[0]


def test_check_config_refuses_a_missing_token_file_as_serve_does(tmp_path: Path) -> None:
    config = a_config(tmp_path / "zoneq")
    missing = tmp_path / "no-such-token"
    set_config_line(config, "api", f'token_file = "{missing!s}"')
    checked = zoneq("check-config", str(config))
    served = zoneq("serve", "--config", str(config))
    for done in (checked, served):
        assert done.returncode != 0, done.stderr
        assert "Traceback" not in done.stderr, done.stderr
        assert f"api.token_file: cannot read the API token from {missing}" in done.stderr


@pytest.mark.parametrize(
    ("mode", "warned"),
    [(0o600, False), (0o640, True), (0o604, True)],
    ids=["0600", "0640", "0604"],
)
def test_a_token_file_others_can_read_is_a_warning_not_a_refusal(
    tmp_path: Path, mode: int, warned: bool
) -> None:
    config = a_config(tmp_path / "zoneq")
    token = tmp_path / "token"
    token.write_text("a-token-long-enough-for-the-api-0123456789\n")
    token.chmod(mode)
    set_config_line(config, "api", f'token_file = "{token!s}"')
    warning = f"api.token_file: {token} is readable by group or others (mode {mode:04o})"
    checked = zoneq("check-config", str(config))
    assert checked.returncode == 0, checked.stderr
    assert checked.stdout.strip() == f"{config}: ok"
    assert (warning in checked.stderr) is warned, checked.stderr
    if not warned:
        return
    with running_serve(config, tmp_path / "serve.log") as serve:
        assert warning in serve.log_text()
