"""The arguments of ``queue:route``, ``sender:connect`` and ``sender:headers``, checked
against what actually happened, through a real ``zoneq serve``.

A recording plugin (a real module loaded by path, as in ``test_send_hooks.py``) appends
each call's arguments to a JSON-lines file; both the core (``queue:route``) and the worker
(``sender:*``) load it.  The client connects from 127.0.0.7 with its own EHLO name, the
zone sends from its pool address 127.0.0.9, and smtp-sink (the MX of ok.test, answered by
dnsmasq: ``tests/support/bed.py``) dumps what it got, with the client address it saw.
"""

from __future__ import annotations

import json
import smtplib
import time
from pathlib import Path
from typing import Any

import pytest

from tests.support.bed import ok_test_bed
from tests.support.plugins import write_plugin
from tests.support.serve import running_serve, smtp_port
from zoneq.protocol.ids import parse_id

pytestmark = pytest.mark.integration

CLIENT, CLIENT_HELO, POOL = "127.0.0.7", "client.hooks.test", "127.0.0.9"
RECIPIENTS = ["a@ok.test", "b@ok.test"]

RECORDER = """
    import json
    from zoneq.plugin import Hook

    def init(app):
        path = app.options["path"]
        def write(line):
            with open(path, "a") as out:
                out.write(json.dumps(line) + "\\n")
        def route(args):
            session = args.session
            write({"hook": "queue:route", "recipient": args.recipient, "sender": args.sender,
                   "zone": args.zone, "rule": args.rule, "client": session.client_ip,
                   "helo": session.helo, "trusted": session.trusted})
        def connect(args):
            write({"hook": "sender:connect", "zone": args.zone, "domain": args.domain,
                   "mx_host": args.mx_host, "mx_address": args.mx_address,
                   "source_address": args.source_address})
        def headers(args):
            write({"hook": "sender:headers", "zone": args.zone, "message_id": args.message_id,
                   "sender": args.sender, "recipients": list(args.recipients),
                   "domain": args.domain, "subject": b"Subject: hooks" in args.headers})
        app.add_hook(Hook.QUEUE_ROUTE, route)
        app.add_hook(Hook.SENDER_CONNECT, connect)
        app.add_hook(Hook.SENDER_HEADERS, headers)
"""


def recorded(path: Path, count: int, timeout: float = 30.0) -> list[dict[str, Any]]:
    """The first ``count`` lines the plugin wrote (waiting, bounded, for them)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        lines = path.read_text().splitlines() if path.exists() else []
        if len(lines) >= count:
            return [json.loads(line) for line in lines]
        time.sleep(0.05)
    pytest.fail(f"the plugin recorded {path.read_text() if path.exists() else 'nothing'}")


def test_route_connect_and_header_hooks_get_what_happened(tmp_path: Path) -> None:
    plugin = write_plugin(tmp_path, "recorder", RECORDER)
    calls = tmp_path / "calls.jsonl"
    with ok_test_bed(tmp_path) as (sink, config):
        config.write_text(
            config.read_text()
            + f'\n[[zones.default.pool]]\naddress = "{POOL}"\n'
            + '\n[[routing.rules]]\nrecipient_domain = ["ok.test"]\nzone = "default"\n'
            + f'\n[plugins.recorder]\nmodule = "{plugin}"\noptions.path = "{calls}"\n'
        )
        with running_serve(config, tmp_path / "serve.log"):
            port = smtp_port(config)
            with smtplib.SMTP(
                "127.0.0.1", port, CLIENT_HELO, timeout=30, source_address=(CLIENT, 0)
            ) as smtp:
                smtp.ehlo(CLIENT_HELO)
                smtp.mail("news@shop.test")
                for rcpt in RECIPIENTS:
                    assert smtp.rcpt(rcpt)[0] == 250
                code, text = smtp.data(b"Subject: hooks\r\n\r\nHello.\r\n")
            assert code == 250, text
            msg_id = parse_id(text.decode().rsplit(" ", 1)[1])
            # Two routes, then one sender:headers and one sender:connect for the one job.
            lines = recorded(calls, 4)
            (received,) = sink.messages(1)
    by_hook: dict[str, list[dict[str, Any]]] = {}
    for line in lines:
        by_hook.setdefault(line.pop("hook"), []).append(line)
    assert sorted(by_hook["queue:route"], key=lambda line: line["recipient"]) == [
        {
            "recipient": rcpt,
            "sender": "news@shop.test",
            "zone": "default",
            "rule": "recipient_domain",
            "client": CLIENT,
            "helo": CLIENT_HELO,
            "trusted": True,  # 127.0.0.0/8 is in the default allow_networks
        }
        for rcpt in RECIPIENTS
    ]
    (headers,) = by_hook["sender:headers"]
    assert parse_id(headers.pop("message_id")) == msg_id
    assert headers == {
        "zone": "default",
        "sender": "news@shop.test",
        "recipients": RECIPIENTS,
        "domain": "ok.test",
        "subject": True,
    }
    (connect,) = by_hook["sender:connect"]
    assert connect == {
        "zone": "default",
        "domain": "ok.test",
        "mx_host": "mx.ok.test",
        "mx_address": sink.host,  # where dnsmasq said the MX is, and the sink listens
        "source_address": POOL,
    }
    assert received.client_addr == connect["source_address"]  # what the sink saw
    assert received.rcpt_args == [f"<{rcpt}>" for rcpt in RECIPIENTS]
