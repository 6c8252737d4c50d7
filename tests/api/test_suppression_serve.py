"""The whole product: a real ``zoneq serve`` with the suppression plugin enabled, the list
edited with ``zoneq suppression ...`` (subprocesses, through the HTTP API), and the plugin,
loaded from the same config by a real ``PluginHost``, refusing the address at
``queue:route`` without a restart.

Every process is started and stopped by PID (``tests/support/serve.py``); the receiver and
the API listen on 127.0.0.1 only.
"""

from __future__ import annotations

import asyncio
import smtplib
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from tests.api.test_serve_cli import ok, zoneq
from tests.api.test_suppression import empty_list, on_disk
from tests.support.plugins import BUNDLED
from tests.support.serve import Serve, running_serve, smtp_port, write_serve_config
from zoneq.config import load_config
from zoneq.plugin import Hook, PluginHost, RouteArgs

pytestmark = pytest.mark.integration

REFUSED = "550 5.1.1 Recipient is on the suppression list"


@contextmanager
def suppressing_serve(tmp_path: Path) -> Iterator[tuple[Path, Path, Serve]]:
    """``zoneq serve`` with ``[plugins.suppression]`` enabled on an empty list: (config, the
    list's file, the serve).  Nothing is delivered in these tests, so no MX or DNS is
    needed."""
    listed = empty_list(tmp_path)
    config = write_serve_config(tmp_path / "zoneq", mx_port=9, dns_port=9)
    with config.open("a") as out:
        out.write(
            f'\n[plugins.suppression]\nmodule = "{BUNDLED / "suppression.py"}"\n'
            f'options.file = "{listed}"\noptions.action = "refuse"\n'
        )
    with running_serve(config, tmp_path / "serve.log") as serve:
        yield config, listed, serve


def plugin_decision(config: Path, recipient: str, zone: str = "default") -> str | None:
    """What the suppression plugin, loaded from ``config`` as serve loads it, answers at
    ``queue:route`` for ``recipient``: the refusal's text, or None."""
    host = PluginHost.from_config(load_config(config))
    args = RouteArgs("news@src.test", recipient, zone, "default")
    result = asyncio.run(host.call(Hook.QUEUE_ROUTE, args))
    return None if result.reply is None else str(result.reply)


def rcpt_reply(config: Path, recipient: str) -> tuple[int, str]:
    """RCPT TO for ``recipient`` at the serve's receiver (from 127.0.0.1, an allowed relay
    client); the reply's code and text.  Nothing is sent: RSET after the RCPT."""
    with smtplib.SMTP("127.0.0.1", smtp_port(config), timeout=30) as smtp:
        smtp.ehlo("client.test")
        code, _ = smtp.mail("news@src.test")
        assert code == 250
        code, text = smtp.rcpt(recipient)
        smtp.rset()
    return code, text.decode()


def test_suppressed_with_the_cli_refused_by_the_plugin(tmp_path: Path) -> None:
    with suppressing_serve(tmp_path) as (config, listed, _):
        # The same host loaded before the change (as serve's is): it must see the change.
        before = PluginHost.from_config(load_config(config))
        args = RouteArgs("news@src.test", "gone@ok.test", "default", "default")
        assert asyncio.run(before.call(Hook.QUEUE_ROUTE, args)).reply is None

        added = ok(config, "suppression", "add", "default", "Gone@OK.test", "left@ok.test")
        assert added == {"zone": "default", "added": 2, "total": 2}
        assert ok(config, "suppression", "add", "*", "everywhere@ok.test")["total"] == 1
        assert on_disk(listed) == {
            "*": ["everywhere@ok.test"],
            "default": ["gone@ok.test", "left@ok.test"],
        }
        assert str(asyncio.run(before.call(Hook.QUEUE_ROUTE, args)).reply) == REFUSED

        # For people: a table; for scripts: the API's JSON.
        people = zoneq(config, "suppression", "check", "default", "gone@ok.test", "new@ok.test")
        assert people.returncode == 0, people.stderr
        lines = [line.split() for line in people.stdout.splitlines()]
        assert lines == [
            ["address", "in", "default", "lists"],
            ["gone@ok.test", "suppressed", "default"],
            ["new@ok.test", "-"],
        ]
        listing = ok(config, "suppression", "list", "default", "--all")
        assert listing["addresses"] == ["gone@ok.test", "left@ok.test"]

        assert plugin_decision(config, "GONE@ok.test") == REFUSED
        assert plugin_decision(config, "everywhere@ok.test", zone="bounces") == REFUSED
        assert plugin_decision(config, "fine@ok.test") is None

        removed = ok(config, "suppression", "remove", "default", "gone@ok.test")
        assert removed == [{"zone": "default", "address": "gone@ok.test", "removed": True}]
        assert plugin_decision(config, "gone@ok.test") is None
        assert asyncio.run(before.call(Hook.QUEUE_ROUTE, args)).reply is None

        missing = zoneq(config, "suppression", "remove", "default", "gone@ok.test")
        assert missing.returncode == 1
        assert "not on the suppression list of default (404)" in missing.stderr


def test_suppressed_address_is_refused_at_rcpt(tmp_path: Path) -> None:
    with suppressing_serve(tmp_path) as (config, _, _):
        ok(config, "suppression", "add", "default", "gone@ok.test")
        assert rcpt_reply(config, "fine@ok.test")[0] == 250
        code, text = rcpt_reply(config, "Gone@ok.test")
        assert (code, text) == (550, "5.1.1 Recipient is on the suppression list")


def test_an_acknowledged_change_survives_a_kill(tmp_path: Path) -> None:
    """SIGKILL of the core right after the API's answers: both changes are on disk (the
    journal is fsynced before the 200), and a serve started again refuses the address."""
    with suppressing_serve(tmp_path) as (config, listed, serve):
        ok(config, "suppression", "add", "default", "gone@ok.test", "left@ok.test")
        ok(config, "suppression", "remove", "default", "left@ok.test")
        serve.kill()
    assert on_disk(listed) == {"default": ["gone@ok.test"]}
    with running_serve(config, tmp_path / "again.log"):
        assert rcpt_reply(config, "gone@ok.test")[0] == 550
        assert rcpt_reply(config, "left@ok.test")[0] == 250
