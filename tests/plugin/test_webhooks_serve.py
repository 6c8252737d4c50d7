"""The bundled webhooks plugin driven by real deliveries of a real ``zoneq serve``.

The customer's endpoint is an aiohttp server on a 127.x address (``test_webhooks.py``'s
``Receiver``); the MX hosts are three Postfix smtp-sinks on one port (zoneq's ``mx_port``)
at different 127.0.0.x addresses: one accepts, one refuses every RCPT for good (``-f``, a
5xx) and one for now (``-r``, a 4xx).  dnsmasq routes ok.test, bad.test and soft.test to
them.  Each outcome must arrive as one JSON event with the queued message id, the
recipient and the remote server's code.
"""

from __future__ import annotations

import asyncio
import smtplib
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import pytest

from tests.plugin.test_webhooks import Receiver, loopback, serving, until
from tests.support.dnsmasq import running_dnsmasq
from tests.support.plugins import BUNDLED
from tests.support.serve import running_serve, smtp_port, write_serve_config
from tests.support.smtpsink import run_smtp_sink
from zoneq.protocol.ids import parse_id

pytestmark = pytest.mark.integration

# domain -> (smtp-sink's options, the webhook event expected, its code's class)
DOMAINS: dict[str, tuple[tuple[str, ...], str, int]] = {
    "ok.test": ((), "delivered", 2),
    "bad.test": (("-f", "RCPT"), "bounced", 5),
    "soft.test": (("-r", "RCPT"), "deferred", 4),
}


def send(port: int, recipient: str) -> int:
    """One message to ``recipient`` through zoneq's receiver; its queued id."""
    with smtplib.SMTP("127.0.0.1", port, timeout=30) as smtp:
        smtp.ehlo("shop.src.test")
        smtp.mail("shop@src.test")
        assert smtp.rcpt(recipient)[0] == 250
        code, text = smtp.data(b"Subject: webhooks\r\n\r\nHello.\r\n")
    assert code == 250, text
    return parse_id(text.decode().rsplit(" ", 1)[1])


def test_real_deliveries_reach_the_endpoint_as_delivered_bounced_and_deferred(
    tmp_path: Path,
) -> None:
    endpoint = Receiver()
    hook_host, hook_port = loopback()
    with ExitStack() as stack:
        sinks = {}
        port: int | None = None
        for domain, (options, _, _) in DOMAINS.items():
            sink = stack.enter_context(run_smtp_sink(*options, port=port))
            port = sink.port  # one port for all: MX records carry none
            sinks[domain] = sink
        records = []
        for domain, sink in sinks.items():
            records += [f"mx-host={domain},mx.{domain},10", f"host-record=mx.{domain},{sink.host}"]
        dns = stack.enter_context(running_dnsmasq(records, tmp_path / "dns"))
        assert port is not None
        config = write_serve_config(tmp_path / "zoneq", mx_port=port, dns_port=dns.port)
        url = f"http://{hook_host}:{hook_port}/hook"
        config.write_text(
            config.read_text()
            + f'\n[plugins.webhooks]\nmodule = "{BUNDLED / "webhooks.py"}"\n'
            + f'options = {{ url = "{url}", timeout = 2.0, backoff = 0.1, max_backoff = 0.5 }}\n'
        )
        stack.enter_context(running_serve(config, tmp_path / "serve.log"))
        receiver_port = smtp_port(config)

        async def main() -> dict[str, int]:
            async with serving(endpoint, hook_host, hook_port):
                ids = {}
                for domain in DOMAINS:
                    ids[domain] = await asyncio.to_thread(send, receiver_port, f"user@{domain}")
                wanted = {f"user@{domain}" for domain in DOMAINS}
                await until(
                    lambda: wanted <= {e["recipient"] for e in endpoint.accepted}, timeout=30
                )
                return ids

        ids = asyncio.run(main())
    events: dict[str, list[dict[str, Any]]] = {}
    for event in endpoint.accepted:
        events.setdefault(event["recipient"], []).append(event)
    for domain, (_, kind, code_class) in DOMAINS.items():
        (event,) = events[f"user@{domain}"]  # one event per outcome, no duplicates
        assert event["event"] == kind, event
        assert parse_id(event["message_id"]) == ids[domain]
        assert event["zone"] == "default" and event["sender"] == "shop@src.test"
        assert event["code"] // 100 == code_class, event
        assert event["enhanced"] is None or event["enhanced"].startswith(f"{code_class}.")
        assert event["attempts"] == 1
