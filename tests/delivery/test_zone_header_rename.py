"""The routing header is never delivered (issue 5), even when ``routing.zone_header`` is
renamed while mail it routed is queued: the field that chose a message's zone is recorded
in its metadata at intake (``MessageMeta.zone_header``), and the worker removes that one
(``Job.zone_header``).  Mail whose metadata names none (queued before the name was
recorded) has the configured name removed.

Real parts: the message is queued on a LevelDB store by the SMTP receiver or the API's
intake under the old name, the store closed, then delivered under the new name by the real
core and worker (``inproc.py``) to smtp-sink, through dnsmasq.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiosmtplib
import pytest

from tests.delivery.inproc import MESSAGE, config_for, dns_for, running
from tests.support.smtpsink import run_smtp_sink
from zoneq.config import Config
from zoneq.plugin import PluginHost
from zoneq.queue.intake import Envelope, Intake
from zoneq.queue.service import wall_clock_ms
from zoneq.receiver import SmtpReceiver
from zoneq.runtime import StoreSink
from zoneq.storage.store import QueueStore

SENDER = "news@shop.example"
RECIPIENT = "someone@ok.test"
assert b"\r\nX-Sending-Zone: default\r\n" in MESSAGE  # the default name, naming a zone

Queue = Callable[[Config, QueueStore], Awaitable[None]]


async def by_smtp(config: Config, store: QueueStore) -> None:
    """Queue ``MESSAGE`` through the SMTP receiver, from 127.0.0.1 (allowlisted: trusted)."""
    plugins = PluginHost.from_config(config)
    receiver = SmtpReceiver(StoreSink(store, config), config, clock=wall_clock_ms, plugins=plugins)
    await receiver.start()
    try:
        errors, reply = await aiosmtplib.send(
            MESSAGE,
            sender=SENDER,
            recipients=[RECIPIENT],
            hostname="127.0.0.1",
            port=receiver.port,
            start_tls=False,
        )
    finally:
        await receiver.close()
        await plugins.close()
    assert errors == {} and "queued as" in reply


async def by_api(config: Config, store: QueueStore) -> None:
    """Queue ``MESSAGE`` through the API's intake (its clients are trusted)."""

    async def text() -> AsyncIterator[bytes]:
        yield MESSAGE

    intake = Intake(store, config, clock=wall_clock_ms)
    envelope = Envelope(SENDER, (RECIPIENT,))
    await intake.receive(text(), envelope, source={"client": "127.0.0.1", "protocol": "http"})


@pytest.mark.parametrize("intake", [by_smtp, by_api], ids=["smtp", "api"])
def test_the_field_that_chose_the_zone_is_removed_after_a_rename(
    tmp_path: Path, intake: Queue
) -> None:
    with run_smtp_sink() as sink, dns_for(tmp_path, ["ok.test"], sink.host) as dns:
        before = config_for(tmp_path, dns, sink.port, receiver={"listen": "127.0.0.1:0"})
        after = config_for(tmp_path, dns, sink.port, routing={"zone_header": "X-Zone"})

        async def main() -> None:
            store = QueueStore.open(Path(before.server.data_dir))
            store.recover()
            try:
                await intake(before, store)
            finally:
                await store.close()
            async with running(after) as core:  # a restart on the renamed header
                await core.until(lambda: len(core.events("delivered")) == 1)

        asyncio.run(main())
        (delivered,) = sink.messages(1)
    assert b"X-Sending-Zone" not in delivered.content
    assert b"Subject: pools and plugins" in delivered.content


def test_mail_queued_before_the_name_was_recorded_loses_the_configured_one(
    tmp_path: Path,
) -> None:
    renamed = MESSAGE.replace(b"X-Sending-Zone:", b"X-Zone:")
    with run_smtp_sink() as sink, dns_for(tmp_path, ["ok.test"], sink.host) as dns:
        config = config_for(tmp_path, dns, sink.port, routing={"zone_header": "X-Zone"})

        async def main() -> None:
            async with running(config) as core:
                await core.queue([RECIPIENT], body=renamed)  # metadata without the name
                await core.until(lambda: len(core.events("delivered")) == 1)

        asyncio.run(main())
        (delivered,) = sink.messages(1)
    assert b"X-Zone" not in delivered.content
    assert b"Subject: pools and plugins" in delivered.content
