"""A torn stored body (its chunks short of the message's size) is never sent, and the core
holds the message as quarantined, whether the body is first read by the DATA stream or by a
plugin at ``sender:headers`` (DKIM signs the body before anything is sent).

Real worker, core, smtp-sink and dnsmasq (``inproc.py``).
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import pytest

from tests.delivery.inproc import MESSAGE, ZONE, config_for, dns_for, running
from tests.delivery.test_send_hooks import plugin_table
from tests.plugin.test_bundled import rsa_key
from tests.support.plugins import BUNDLED
from tests.support.smtpsink import run_smtp_sink
from zoneq.plugin import PluginHost
from zoneq.storage.records import MessageMeta, NewRecipient, State

__all__ = ["rsa_key"]  # the fixture, used by name


async def queue_torn(core: Any) -> None:
    now = core.clock()
    msg_id = core.store.begin(now)
    # As a torn last chunk leaves it: the metadata says 10 octets more than the chunk holds.
    meta = MessageMeta(msg_id, "news@shop.example", len(MESSAGE) + 10, 1, now, headers={})
    await core.store.commit(meta, [NewRecipient("someone@ok.test", ZONE)], now, tail=MESSAGE)


def deliver_torn(tmp_path: Path, plugins: dict[str, Any]) -> tuple[int, int]:
    with run_smtp_sink() as sink, dns_for(tmp_path, ["ok.test"], sink.host) as dns:
        config = config_for(tmp_path, dns, sink.port, plugins=plugins)

        async def main() -> tuple[int, int]:
            async with running(config, worker_plugins=PluginHost.from_config(config)) as core:
                await queue_torn(core)
                store = core.store
                await core.until(
                    lambda: store.count(ZONE, State.DEFERRED) + store.count(ZONE, State.HELD) == 1
                )
                return store.count(ZONE, State.DEFERRED), store.count(ZONE, State.HELD)

        counts = asyncio.run(main())
        assert sink.messages(1, timeout=0.5) == []  # never sent cut short
        return counts


@pytest.mark.parametrize("dkim", [False, True], ids=["no-plugin", "dkim"])
def test_a_torn_body_is_held_as_quarantined(
    tmp_path: Path, rsa_key: tuple[bytes, bytes], dkim: bool
) -> None:
    plugins: dict[str, Any] = {}
    if dkim:
        key_file = tmp_path / "dkim.pem"
        key_file.write_bytes(rsa_key[0])
        domains = {"shop.example": {"selector": "s1", "key_file": str(key_file)}}
        plugins["dkim"] = plugin_table(BUNDLED / "dkim.py", domains=domains)
    # (deferred, held): with DKIM the damage was blamed on the plugin (451 4.3.0) and the
    # message retried until it expired, never held.
    assert deliver_torn(tmp_path, plugins) == (0, 1)
