"""The EHLO name (``[server] hostname``): unset, it is this machine's FQDN, never the
"localhost" that ``socket.getfqdn()`` answers when /etc/hosts names 127.0.0.1 first; a name
that is still not a FQDN (RFC 5321 sections 2.3.5 and 4.1.1.1) is a warning from
check-config and from serve at start-up, not a refusal (test set-ups use such names)."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from tests.support.command import zoneq
from tests.support.serve import running_serve, set_config_line, write_serve_config
from zoneq.config.model import ServerConfig, machine_hostname


@pytest.mark.parametrize(
    ("fqdn", "host", "expected"),
    [
        ("mx.example.com", "mx", "mx.example.com"),
        ("localhost", "mx.example.com", "mx.example.com"),  # the reviewer's machine, named
        ("localhost.localdomain", "mx.example.com", "mx.example.com"),
        ("localhost", "vm", "vm"),  # no FQDN anywhere: the name that is not localhost
        ("vm", "vm", "vm"),
        ("localhost", "localhost", "localhost"),
    ],
)
def test_the_default_hostname_is_a_fqdn_when_the_machine_has_one(
    monkeypatch: pytest.MonkeyPatch, fqdn: str, host: str, expected: str
) -> None:
    # The machine's answers are the input here: the test host's /etc/hosts is not ours.
    monkeypatch.setattr(socket, "getfqdn", lambda: fqdn)
    monkeypatch.setattr(socket, "gethostname", lambda: host)
    assert machine_hostname() == expected
    assert ServerConfig().resolved_hostname() == expected


@pytest.mark.parametrize(
    ("hostname", "warned"),
    [
        ("mx.zoneq.test", False),
        ("MX.Example.COM", False),
        ("[192.0.2.1]", False),  # an address literal is the RFC's other form
        ("localhost", True),
        ("localhost.localdomain", True),
        ("mailhost", True),
    ],
)
def test_a_configured_hostname_that_is_not_a_fqdn_is_a_warning(hostname: str, warned: bool) -> None:
    warning = ServerConfig(hostname=hostname).hostname_warning()
    assert (warning is not None) is warned
    if warning is not None:
        assert warning.startswith(f"server.hostname {hostname!r} is not a fully-qualified")


def test_an_unset_hostname_without_a_fqdn_says_it_is_the_machines(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(socket, "getfqdn", lambda: "localhost")
    monkeypatch.setattr(socket, "gethostname", lambda: "vm")
    warning = ServerConfig().hostname_warning()
    assert warning is not None and "'vm' (unset: this machine's own name)" in warning
    assert "set [server] hostname" in warning


@pytest.mark.integration
def test_check_config_and_serve_warn_of_a_hostname_that_is_not_a_fqdn(tmp_path: Path) -> None:
    # No mail is delivered: the MX and DNS ports are never used.
    config = write_serve_config(tmp_path / "zoneq", mx_port=25, dns_port=53)
    set_config_line(config, "server", 'hostname = "localhost"')
    warning = "server.hostname 'localhost' is not a fully-qualified domain name"
    checked = zoneq("check-config", str(config), timeout=60)
    assert checked.returncode == 0, checked.stderr  # a warning, not a refusal
    assert f"{config}: warning: {warning}" in checked.stderr, checked.stderr
    with running_serve(config, tmp_path / "serve.log") as serve:
        assert warning in serve.log_text()
