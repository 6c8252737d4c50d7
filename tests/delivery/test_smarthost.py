"""A zone with a smarthost relays everything there: no MX lookup, STARTTLS and AUTH.

The smarthost is zoneq's own receiver (``zoneq/receiver``) with STARTTLS and AUTH users,
relaying only for 127.0.0.1 or authenticated clients; the zone sends from 127.0.0.2 (its
pool), so the relay takes the mail only once the worker has logged in.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest

from tests.delivery.inproc import config_for, dns_for, running
from tests.receiver.conftest import TlsFiles, tls_files
from tests.receiver.harness import T0, make_config, stored_body
from tests.storage.conftest import async_test
from tests.support.faultserver import Faults, FaultServer
from zoneq.config import Config
from zoneq.protocol.events import Event
from zoneq.receiver import SmtpReceiver
from zoneq.receiver.passwords import hash_password
from zoneq.runtime import StoreSink
from zoneq.storage.records import State
from zoneq.storage.store import QueueStore

pytestmark = pytest.mark.integration
__all__ = ["tls_files"]  # the fixture, imported for pytest

USER, PASSWORD = "relay-user", "a long relay password"
RECIPIENT = "someone@nowhere.invalid"  # no DNS at all: an MX lookup would fail


@asynccontextmanager
async def relay(
    directory: Path, files: TlsFiles, *, implicit: bool = False
) -> AsyncIterator[tuple[int, QueueStore]]:
    """zoneq's receiver as the smarthost: its port (its implicit-TLS port if ``implicit``)
    and the queue it stores into."""
    store = QueueStore.open(directory / "relay-queue")
    store.recover()
    config = make_config(
        tls_cert=str(files.cert),
        tls_key=str(files.key),
        auth_users={USER: hash_password(PASSWORD)},
        allow_networks=["127.0.0.1/32"],
        tls_listen="127.0.0.1:0" if implicit else None,
    )
    receiver = SmtpReceiver(StoreSink(store, config), config, clock=lambda: T0)
    await receiver.start()
    try:
        yield receiver.tls_port if implicit else receiver.port, store
    finally:
        await receiver.close()
        await store.close()


def smarthost_zone(port: int, tls: str, password: str = PASSWORD) -> dict[str, Any]:
    return {
        "pool": [{"address": "127.0.0.2", "ehlo_name": "relay-client.zoneq.test"}],
        "smarthost": {
            "host": "[127.0.0.1]",
            "port": port,
            "tls": tls,
            "auth": {"username": USER, "password": password},
        },
    }


@async_test
async def test_every_recipient_goes_to_the_smarthost_over_tls_with_auth(
    tmp_path: Path, tls_files: TlsFiles
) -> None:
    async with relay(tmp_path, tls_files) as (port, relayed):
        with dns_for(tmp_path, [], "127.0.0.1") as dns:
            config = config_for(tmp_path, dns, 1, smarthost_zone(port, "opportunistic"))
            async with running(config) as core:
                await core.queue([RECIPIENT, "other@elsewhere.invalid"])
                await core.until(lambda: core.store.message_count() == 0)
                events = core.events("delivered")
        assert {e.recipient for e in events} == {RECIPIENT, "other@elsewhere.invalid"}
        assert {e.mx for e in events} == {"127.0.0.1"} and {e.source_ip for e in events} == {
            "127.0.0.2"
        }
        # Two domains, two jobs; the relay queued each with its recipient.
        assert relayed.message_count() == 2
        leases = relayed.lease("default", 10, "test")
        body = b"".join(stored_body(relayed, lease.recipient.msg_id) for lease in leases)
    # The relay's Received field says the session was TLS and authenticated (RFC 3848).
    assert b"ESMTPSA" in body
    assert b"X-Sending-Zone" not in body


async def one_deferral(directory: Path, zone: dict[str, Any]) -> Event:
    """Queue one message in a zone with ``zone``'s settings; its first deferral (it is kept
    in the queue, nothing lost)."""
    with dns_for(directory, [], "127.0.0.1") as dns:
        return await first_deferral(config_for(directory, dns, 1, zone))


async def first_deferral(config: Config) -> Event:
    """Queue one message under ``config``; its first deferral, once the recipient is kept in
    the queue (deferred, not bounced: nothing lost)."""
    async with running(config) as core:
        await core.queue([RECIPIENT])
        await core.until(lambda: len(core.events("deferred")) == 1)
        assert core.store.count("default", State.DEFERRED) == 1
        assert core.events("bounced") == []
        (event,) = core.events("deferred")
        return event


@async_test
async def test_wrong_credentials_defer_and_nothing_is_lost(
    tmp_path: Path, tls_files: TlsFiles
) -> None:
    async with relay(tmp_path, tls_files) as (port, relayed):
        zone = smarthost_zone(port, "opportunistic", password="not the password")
        event = await one_deferral(tmp_path, zone)
        assert relayed.message_count() == 0
    assert event.code == 535  # the relay's refusal, kept for the operator


@async_test
async def test_credentials_never_go_in_plaintext(tmp_path: Path) -> None:
    """A relay that offers no STARTTLS gets no AUTH: the mail waits (4.7.4)."""
    async with FaultServer(Faults(starttls=False)) as server:
        event = await one_deferral(tmp_path, smarthost_zone(server.port, "opportunistic"))
    assert event.enhanced == "4.7.4"
    verbs = server.verbs()
    assert b"AUTH" not in verbs and b"MAIL" not in verbs


@async_test
async def test_required_tls_checks_the_relay_certificate(
    tmp_path: Path, tls_files: TlsFiles
) -> None:
    """The relay's certificate is self-signed: with ``tls = "required"`` it is refused."""
    async with relay(tmp_path, tls_files) as (port, relayed):
        event = await one_deferral(tmp_path, smarthost_zone(port, "required"))
        assert relayed.message_count() == 0
    assert event.enhanced == "4.7.5"


@async_test
async def test_implicit_tls_relays_every_recipient_with_auth(
    tmp_path: Path, tls_files: TlsFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``tls = "implicit"`` (RFC 8314 section 3.3) to the relay's implicit-TLS listener: TLS
    from the first byte, the certificate verified (the relay's self-signed one is made a
    trusted root through OpenSSL's ``SSL_CERT_FILE``), then AUTH and every recipient."""
    monkeypatch.setenv("SSL_CERT_FILE", str(tls_files.cert))
    recipients = [RECIPIENT, "other@elsewhere.invalid"]
    async with relay(tmp_path, tls_files, implicit=True) as (port, relayed):
        with dns_for(tmp_path, [], "127.0.0.1") as dns:
            config = config_for(tmp_path, dns, 1, smarthost_zone(port, "implicit"))
            async with running(config) as core:
                await core.queue(recipients)
                await core.until(lambda: core.store.message_count() == 0)
                events = core.events("delivered")
        assert sorted(e.recipient for e in events) == sorted(recipients)
        assert {e.mx for e in events} == {"127.0.0.1"}
        leases = relayed.lease("default", 10, "test")
        assert sorted(lease.recipient.address for lease in leases) == sorted(recipients)
        sources = [relayed.message(lease.recipient.msg_id).source for lease in leases]
        body = b"".join(stored_body(relayed, lease.recipient.msg_id) for lease in leases)
    assert {s["auth"] for s in sources} == {USER}  # the credentials were accepted
    assert {s["tls"] for s in sources} <= {"TLSv1.2", "TLSv1.3"}
    assert {s["client"] for s in sources} == {"127.0.0.2"}  # outside the relay's networks
    assert body.count(b"ESMTPSA") == 2  # RFC 3848, in each relayed copy's Received field


@async_test
async def test_implicit_tls_checks_the_relay_certificate(
    tmp_path: Path, tls_files: TlsFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Implicit TLS is required TLS: the relay's self-signed certificate, not trusted here,
    is refused and the mail waits in the queue; nothing is sent in plaintext."""
    monkeypatch.delenv("SSL_CERT_FILE", raising=False)
    async with relay(tmp_path, tls_files, implicit=True) as (port, relayed):
        event = await one_deferral(tmp_path, smarthost_zone(port, "implicit"))
        assert relayed.message_count() == 0
    # No reply came (the handshake failed before the greeting), so no code; the status is
    # a transient cryptographic failure, as after STARTTLS (RFC 3463 section 3.8), and the
    # reason names the certificate for the operator.
    assert event.code is None and event.enhanced == "4.7.5"
    assert "CERTIFICATE_VERIFY_FAILED" in (event.text or ""), event
