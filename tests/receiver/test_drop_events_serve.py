"""A drop through a receiver process (``receiver.processes = 1``): the DROPPED event crosses
the intake socket with the commit and lands in the core's queue; and ``zoneq send`` prints
the recipients a plugin refused.

A real ``zoneq serve`` with two instances of the bundled suppression plugin (one dropping,
one refusing); every process is started and stopped by PID (``tests/support/serve.py``),
everything listens on 127.0.0.1.  Nothing is delivered, so no MX or DNS is needed.
"""

from __future__ import annotations

import asyncio
import json
import smtplib
from pathlib import Path

import pytest

from tests.api.test_serve_cli import zoneq
from tests.receiver.processes import start_receiver_serve
from tests.support.plugins import BUNDLED
from tests.support.serve import smtp_port, write_serve_config
from zoneq.protocol.events import EventKind
from zoneq.storage.store import QueueStore

pytestmark = pytest.mark.integration

WORKERS = 2  # default and bounces, one process each


def serve_config(tmp_path: Path) -> Path:
    config = write_serve_config(tmp_path / "zoneq", mx_port=9, dns_port=9)
    text = config.read_text().replace("[receiver]\n", "[receiver]\nprocesses = 1\n", 1)
    for name, action, address in (("dropper", "drop", "gone"), ("refuser", "refuse", "no")):
        listed = tmp_path / f"{name}.json"
        listed.write_text(json.dumps({"default": [f"{address}@ok.test"]}))
        text += (
            f'\n[plugins.{name}]\nmodule = "{BUNDLED / "suppression.py"}"\n'
            f'options.file = "{listed}"\noptions.action = "{action}"\n'
        )
    config.write_text(text)
    return config


def dropped_events(data_dir: Path) -> list[tuple[str, str, str | None]]:
    async def read() -> list[tuple[str, str, str | None]]:
        store = QueueStore.open(data_dir)
        try:
            return [
                (e.recipient, e.zone, e.text)
                for _, e in store.events()
                if e.kind is EventKind.DROPPED
            ]
        finally:
            await store.close()

    return asyncio.run(read())


def test_a_drop_in_a_receiver_process_is_an_event_in_the_core(tmp_path: Path) -> None:
    config = serve_config(tmp_path)
    serve = start_receiver_serve(config, tmp_path / "serve.log")
    try:
        serve.wait_ready(WORKERS + 1)
        assert len(serve.receivers()) == 1
        with smtplib.SMTP("127.0.0.1", smtp_port(config), timeout=30) as smtp:
            refused = smtp.sendmail(
                "c@src.test", ["gone@ok.test", "a@ok.test"], b"Subject: x\r\n\r\nhi\r\n"
            )
            assert refused == {}  # the drop is told 250 like the rest
            assert smtp.sendmail("c@src.test", ["gone@ok.test"], b"Subject: y\r\n\r\nhi\r\n") == {}
        message = tmp_path / "message.eml"
        message.write_bytes(b"From: c@src.test\r\nSubject: z\r\n\r\nhi\r\n")
        sent = zoneq(config, "send", str(message), "--to", "no@ok.test", "--to", "b@ok.test")
        assert sent.returncode == 0, sent.stderr
        assert "refused no@ok.test: 550 5.1.1 Recipient is on the suppression list" in sent.stdout
        assert serve.terminate() < 20
    finally:
        serve.cleanup()
    events = dropped_events(tmp_path / "zoneq" / "queue")
    assert events == [
        ("gone@ok.test", "default", "suppressed in zone default"),
        ("gone@ok.test", "default", "suppressed in zone default"),
    ]
