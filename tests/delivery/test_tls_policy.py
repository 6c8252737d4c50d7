"""The per-destination TLS policy (``[delivery] tls_policy``) with a real worker and real MXs.

Without STARTTLS the remote MX is Postfix's smtp-sink (it offers no STARTTLS unless told to);
with it, zoneq's own receiver (``test_smarthost.relay``: STARTTLS with a self-signed
certificate, made a trusted root for the worker through OpenSSL's ``SSL_CERT_FILE``, since
required TLS verifies the certificate).  dnsmasq answers the MX lookups.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from tests.delivery.inproc import config_for, dns_for, running
from tests.delivery.test_smarthost import relay
from tests.receiver.conftest import HOSTNAME, TlsFiles, tls_files
from tests.receiver.harness import stored_body
from tests.storage.conftest import async_test
from tests.support.dnsmasq import running_dnsmasq
from tests.support.smtpsink import run_smtp_sink
from zoneq.storage.records import State

pytestmark = pytest.mark.integration
__all__ = ["tls_files"]  # the fixture, imported for pytest

POLICY = {"tls_policy": {"secure.test": "required"}}


@pytest.mark.parametrize(
    ("policy", "secure"),
    [
        (POLICY, "secure.test"),
        # A ".parent" key covers every name below it (as domain_limits' keys do).
        ({"tls_policy": {".secure.test": "required"}}, "sub.secure.test"),
    ],
)
def test_required_tls_defers_a_domain_whose_mx_offers_none_and_sends_it_nothing(
    tmp_path: Path, policy: dict[str, dict[str, str]], secure: str
) -> None:
    with (
        run_smtp_sink() as sink,
        dns_for(tmp_path, ["ok.test", secure], sink.host) as dns,
    ):
        # The zone's own policy is "none" (config_for): only the secure domain requires TLS.
        config = config_for(tmp_path, dns, sink.port, delivery=policy)

        async def main() -> None:
            async with running(config) as core:
                await core.queue([f"a@{secure}", "b@ok.test"])
                await core.until(lambda: bool(core.events("deferred") and core.events("delivered")))
                (deferred,) = core.events("deferred")
                assert deferred.recipient == f"a@{secure}"
                # RFC 3463 section 3.8: X.7.4 security features not supported, temporary.
                assert deferred.enhanced == "4.7.4"
                assert deferred.text is not None and "STARTTLS" in deferred.text
                assert core.store.count("default", State.DEFERRED) == 1  # kept, not lost
                (delivered,) = core.events("delivered")
                assert delivered.recipient == "b@ok.test"

        asyncio.run(main())
        received = sink.messages(1)
    # Only ok.test's transaction reached the sink: not even the secure domain's envelope.
    assert [m.rcpt_args for m in received] == [["<b@ok.test>"]]


@async_test
async def test_required_tls_delivers_under_verified_tls_when_the_mx_offers_it(
    tmp_path: Path, tls_files: TlsFiles, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SSL_CERT_FILE", str(tls_files.cert))
    async with relay(tmp_path, tls_files) as (port, relayed):
        # The MX host is named as the receiver's certificate says; our own name differs, or
        # the MX would be taken for ourselves (a loop, RFC 5321 section 5.1).
        records = ["mx-host=secure.test,mx.zoneq.test,10", "host-record=mx.zoneq.test,127.0.0.1"]
        with running_dnsmasq(records, tmp_path / "dns") as dns:
            server = {"hostname": "client.zoneq.test"}
            config = config_for(tmp_path, dns, port, delivery=POLICY, server=server)
            async with running(config) as core:
                await core.queue(["a@secure.test"])
                await core.until(lambda: core.store.message_count() == 0)
                (delivered,) = core.events("delivered")
                assert (delivered.recipient, delivered.mx) == ("a@secure.test", HOSTNAME)
        (lease,) = relayed.lease("default", 10, "test")
        source = relayed.message(lease.recipient.msg_id).source
        body = stored_body(relayed, lease.recipient.msg_id)
    assert source["tls"] in ("TLSv1.2", "TLSv1.3")
    assert b"\tESMTPS id " in body  # RFC 3848: the relay's Received field says TLS
