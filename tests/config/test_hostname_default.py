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
from zoneq.config import InvalidConfig, loads_config
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
        ("192.0.2.7", "mx.example.com", "mx.example.com"),  # an address is no EHLO name
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


ZONES = "[zones.default]\n[zones.bounces]\n"

# Every key whose value zoneq sends as its EHLO name, as (the key, its config text).
EHLO_KEYS = [
    ("server.hostname", '[server]\nhostname = "{}"\n' + ZONES),
    ("zones.default.ehlo_name", '[zones.default]\nehlo_name = "{}"\n[zones.bounces]\n'),
    (
        "zones.default.pool[0].ehlo_name",
        ZONES + '[[zones.default.pool]]\naddress = "127.0.0.1"\nehlo_name = "{}"\n',
    ),
]
EHLO_KEY_PARAMS = [pytest.param(key, text, id=key) for key, text in EHLO_KEYS]


@pytest.mark.parametrize(("key", "text"), EHLO_KEY_PARAMS)
@pytest.mark.parametrize(
    ("address", "literal"),
    [
        ("192.0.2.1", "[192.0.2.1]"),
        ("2001:db8::1", "[IPv6:2001:db8::1]"),
        ("2001:DB8:0::1", "[IPv6:2001:db8::1]"),
    ],
)
def test_a_bare_address_as_an_ehlo_name_is_refused_with_its_literal(
    key: str, text: str, address: str, literal: str
) -> None:
    """RFC 5321 sections 4.1.1.1 and 4.1.3: EHLO takes a domain or an address literal;
    ``EHLO 192.0.2.1`` is neither."""
    with pytest.raises(InvalidConfig) as info:
        loads_config(text.format(address))
    problems = {p.key: p.text for p in info.value.problems}
    assert list(problems) == [key]
    assert f"write {literal!r}" in problems[key]


@pytest.mark.parametrize(("key", "text"), EHLO_KEY_PARAMS)
@pytest.mark.parametrize("name", ["127.1", "1234", "10.0.0.1."])
def test_a_numeric_name_as_an_ehlo_name_is_refused(key: str, text: str, name: str) -> None:
    """Forms of an address ``ip_address`` does not take are no domain either."""
    with pytest.raises(InvalidConfig) as info:
        loads_config(text.format(name))
    problems = {p.key: p.text for p in info.value.problems}
    assert list(problems) == [key]
    assert "last label is all digits" in problems[key]


@pytest.mark.parametrize(("key", "text"), EHLO_KEY_PARAMS)
@pytest.mark.parametrize(
    "name", ["[192.0.2.1]", "[IPv6:2001:db8::1]", "mx.example.com", "192.0.2.1.example.com"]
)
def test_a_domain_or_an_address_literal_as_an_ehlo_name_loads(
    key: str, text: str, name: str
) -> None:
    loads_config(text.format(name))


def test_a_smarthost_may_still_be_named_by_its_literal() -> None:
    """Not an EHLO name: the smarthost's own key keeps the host-name rule."""
    text = ZONES + '[zones.default.smarthost]\nhost = "[192.0.2.25]"\n'
    assert loads_config(text).zones["default"].smarthost is not None
