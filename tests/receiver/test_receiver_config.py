"""``[receiver]`` TLS and AUTH settings are checked at load, each problem under its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.receiver.conftest import TlsFiles
from zoneq.config import check_config, load_config
from zoneq.receiver.passwords import hash_password

BASE = "[zones.default]\n[zones.bounces]\n[receiver]\n"


def problems(tmp_path: Path, receiver: str) -> list[str]:
    path = tmp_path / "zones.toml"
    path.write_text(BASE + receiver)
    return check_config(path)


def test_a_valid_tls_and_auth_section_loads(tmp_path: Path, tls_files: TlsFiles) -> None:
    stored = hash_password("pw", log_n=4)
    text = (
        f'tls_cert = "{tls_files.cert}"\ntls_key = "{tls_files.key}"\n'
        f'[receiver.auth_users]\nalice = "{stored}"\n'
    )
    assert problems(tmp_path, text) == []
    receiver = load_config(tmp_path / "zones.toml").receiver
    assert receiver.tls_cert == tls_files.cert
    assert receiver.auth_users == {"alice": stored}


@pytest.mark.parametrize(
    ("case", "key", "words"),
    [
        ("missing file", "receiver.tls_cert", "no such file"),
        ("key of another certificate", "receiver.tls_cert", "do not load as a pair"),
        ("cert without key", "receiver.tls_key", "set together"),
        ("auth without tls", "receiver.auth_users", "only after STARTTLS"),
        ("not a hash", "receiver.auth_users.alice", "zoneq hash-password"),
    ],
)
def test_each_problem_names_its_key(
    tmp_path: Path, tls_files: TlsFiles, case: str, key: str, words: str
) -> None:
    tls = f'tls_cert = "{tls_files.cert}"\ntls_key = "{tls_files.key}"\n'
    text = {
        "missing file": f'tls_cert = "{tmp_path / "nope.crt"}"\ntls_key = "{tls_files.key}"\n',
        "key of another certificate": (
            f'tls_cert = "{tls_files.cert}"\ntls_key = "{tls_files.other_key}"\n'
        ),
        "cert without key": f'tls_cert = "{tls_files.cert}"\n',
        "auth without tls": f'[receiver.auth_users]\nalice = "{hash_password("p", log_n=4)}"\n',
        "not a hash": tls + '[receiver.auth_users]\nalice = "hunter2"\n',
    }[case]
    found = problems(tmp_path, text)
    assert len(found) == 1, found
    assert found[0].startswith(key), found
    assert words in found[0], found
    assert "hunter2" not in found[0]  # a password pasted by mistake is not echoed


@pytest.mark.parametrize(
    ("value", "loads"),
    [("0", 0), ("1", 1), ("4", 4), ("64", 64), ("-1", None), ("65", None), ('"two"', None)],
)
def test_processes_is_checked_and_defaults_to_the_core(
    tmp_path: Path, value: str, loads: int | None
) -> None:
    assert load_config(None).receiver.processes == 0  # in the core unless configured
    found = problems(tmp_path, f"processes = {value}\n")
    if loads is None:
        assert len(found) == 1 and found[0].startswith("receiver.processes"), found
    else:
        assert found == []
        assert load_config(tmp_path / "zones.toml").receiver.processes == loads


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ('postmaster = "hostmaster@admin.test"', None),
        ('postmaster = "postmaster"', "receiver.postmaster"),
        ('postmaster = "a b@c.test"', "receiver.postmaster"),
        ('postmaster = "<a@c.test>"', "receiver.postmaster"),
        ('postmaster = "a@"', "receiver.postmaster"),
        ("max_errors = 1", None),
        ("max_errors = 0", "receiver.max_errors"),
        # RFC 1870 section 4: "SIZE 0" in EHLO means no limit, the opposite of 0 here.
        ('max_message_size = "1KiB"', None),
        ("max_message_size = 0", "receiver.max_message_size"),
    ],
)
def test_postmaster_max_errors_and_max_message_size_are_checked(
    tmp_path: Path, line: str, problem: str | None
) -> None:
    defaults = load_config(None).receiver
    assert (defaults.postmaster, defaults.max_errors) == (None, 20)
    found = problems(tmp_path, line + "\n")
    if problem is None:
        assert found == []
    else:
        assert len(found) == 1 and found[0].startswith(problem), found
