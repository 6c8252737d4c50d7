"""A plain handler that never returns costs only its own plugin's threads (issue 5).

The plugins are real modules (``tests/support/plugins.py``): ``hanging`` holds a thread at
RCPT for "hang@..." until the test creates its release file; ``fast`` answers at MAIL FROM.
After more hung calls than ``hanging`` has threads, its calls fail at once (451 through the
real receiver), while ``fast``, AUTH (scrypt) and the loop's default executor still work.
"""

from __future__ import annotations

import asyncio
import base64
import ssl
import time
from pathlib import Path

import pytest

from tests.receiver.conftest import HOSTNAME, TlsFiles, tls_files  # noqa: F401 (fixture)
from tests.receiver.harness import MESSAGE, Raw, queued_id, run
from tests.support.plugins import ZONES, hanging_plugins, host_with
from zoneq.plugin import Fault, Hook, MailFromArgs, PluginFailure, RcptToArgs, Session
from zoneq.plugin.threads import THREADS_PER_PLUGIN
from zoneq.protocol.replies import LOCAL_ERROR
from zoneq.receiver import SmtpReceiver
from zoneq.receiver.passwords import hash_password
from zoneq.storage.store import QueueStore

SESSION = Session("127.0.0.1", helo="client.test", trusted=True)
HANG = RcptToArgs(SESSION, "a@src.test", "hang@dst.test", "default")
FINE = RcptToArgs(SESSION, "a@src.test", "fine@dst.test", "default")
FAST_ENOUGH_S = 0.2  # a call that fails "at once" must not have waited for a time limit


async def released(call: object, release: Path) -> None:
    """Create the release file, then wait (bounded) until ``call()`` succeeds again."""
    release.touch()
    deadline = time.monotonic() + 10
    while True:
        try:
            await call()  # type: ignore[operator]
            return
        except PluginFailure:
            if time.monotonic() > deadline:
                raise
            await asyncio.sleep(0.05)


def test_hung_handlers_use_up_only_their_plugins_threads(tmp_path: Path) -> None:
    host = host_with(hanging_plugins(tmp_path))

    async def main() -> None:
        # More hung calls at once than the plugin has threads: the extra ones wait in its
        # queue for as long as the time limit, are cancelled and never run; they fail as
        # BUSY (no thread came free), not as hangs of their own.
        calls = [host.call(Hook.SMTP_RCPT_TO, HANG) for _ in range(THREADS_PER_PLUGIN + 2)]
        results = await asyncio.gather(*calls, return_exceptions=True)
        faults = [getattr(r, "fault", r) for r in results]
        assert faults == [Fault.TIMED_OUT] * THREADS_PER_PLUGIN + [Fault.BUSY] * 2
        assert all(r.reply == LOCAL_ERROR for r in results if isinstance(r, PluginFailure))
        assert len((tmp_path / "hung").read_text().splitlines()) == THREADS_PER_PLUGIN

        started = time.monotonic()
        with pytest.raises(PluginFailure) as info:  # not even a recipient it would pass
            await host.call(Hook.SMTP_RCPT_TO, FINE)
        assert time.monotonic() - started < FAST_ENOUGH_S
        assert info.value.fault is Fault.STUCK and info.value.plugin == "hanging"
        assert f"{THREADS_PER_PLUGIN} calls still running past their time limit" in str(info.value)

        # Another plugin's plain handler, and the process's shared executor, are untouched.
        refused = await host.call(Hook.SMTP_MAIL_FROM, MailFromArgs(SESSION, "refused@src.test"))
        assert str(refused.reply) == "550 5.7.1 Sender refused by plugin"
        loop = asyncio.get_running_loop()
        assert await asyncio.wait_for(loop.run_in_executor(None, sum, [1, 2]), 1) == 3

        # Once the handlers return, the plugin has its threads back.
        await released(lambda: host.call(Hook.SMTP_RCPT_TO, FINE), tmp_path / "release")
        assert (await host.call(Hook.SMTP_RCPT_TO, FINE)).reply is None
        await host.close()

    asyncio.run(main())


def test_a_plugin_with_fewer_stuck_calls_than_threads_still_answers(tmp_path: Path) -> None:
    host = host_with(hanging_plugins(tmp_path))

    async def main() -> None:
        for _ in range(THREADS_PER_PLUGIN - 1):
            with pytest.raises(PluginFailure) as info:
                await host.call(Hook.SMTP_RCPT_TO, HANG)
            assert info.value.fault is Fault.TIMED_OUT
        assert (await host.call(Hook.SMTP_RCPT_TO, FINE)).reply is None  # one thread left
        (tmp_path / "release").touch()
        await host.close()

    asyncio.run(main())


USER, PASSWORD = "alice", "correct horse battery staple"
CLIENT = "127.0.0.2"  # outside allow_networks: may relay only once authenticated


def test_through_the_receiver_hung_plugin_is_451_at_once_auth_and_other_plugins_work(
    tmp_path: Path,
    tls_files: TlsFiles,  # noqa: F811 (the fixture imported above)
) -> None:
    sections = {"zones": ZONES, "plugins": hanging_plugins(tmp_path)}

    async def command(client: Raw, line: str) -> tuple[str, float]:
        started = time.monotonic()
        reply = await client.cmd(line)
        return reply, time.monotonic() - started

    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        client = await Raw.connect(rx.port)
        assert (await client.reply()).startswith("220 ")
        assert (await client.cmd("EHLO client.test")).startswith("250")
        assert (await client.cmd("MAIL FROM:<c@d.test>")).startswith("250 ")
        for _ in range(THREADS_PER_PLUGIN):  # each holds a thread, answered at the limit
            reply, _ = await command(client, "RCPT TO:<hang@b.test>")
            assert reply.startswith("451 4.3.0 "), reply
        for rcpt in ("hang@b.test", "fine@b.test"):  # no thread left: 451 at once
            reply, took = await command(client, f"RCPT TO:<{rcpt}>")
            assert reply.startswith("451 4.3.0 ") and took < FAST_ENOUGH_S, (reply, took)
        assert (await client.cmd("RSET")).startswith("250 ")
        # The other plugin still answers ...
        assert (await client.cmd("MAIL FROM:<refused@d.test>")).startswith("550 5.7.1 ")
        # ... and AUTH's password check (scrypt, on its own threads) still runs.
        other = await Raw.connect(rx.port, source=CLIENT)
        try:
            assert (await other.reply()).startswith("220 ")
            assert (await other.cmd("EHLO client.test")).startswith("250")
            assert (await other.cmd("STARTTLS")).startswith("220 ")
            await other.start_tls(ssl.create_default_context(cafile=str(tls_files.cert)), HOSTNAME)
            assert (await other.cmd("EHLO client.test")).startswith("250")
            plain = base64.b64encode(f"\0{USER}\0{PASSWORD}".encode()).decode()
            assert (await other.cmd(f"AUTH PLAIN {plain}")).startswith("235 ")
        finally:
            await other.close()
        # Released, the plugin answers again, and mail flows: nothing was lost or wedged.
        (tmp_path / "release").touch()
        deadline = time.monotonic() + 10
        assert (await client.cmd("MAIL FROM:<c@d.test>")).startswith("250 ")
        while not (reply := await client.cmd("RCPT TO:<fine@b.test>")).startswith("250 "):
            assert reply.startswith("451 ") and time.monotonic() < deadline, reply
            await asyncio.sleep(0.05)
        assert (await client.cmd("DATA")).startswith("354 ")
        await client.send(MESSAGE + b".\r\n")
        msg_id = queued_id(await client.reply())
        assert [r.recipient.address for r in store.recipients(msg_id)] == ["fine@b.test"]
        await client.close()

    run(
        tmp_path,
        body,
        sections=sections,
        tls_cert=str(tls_files.cert),
        tls_key=str(tls_files.key),
        auth_users={USER: hash_password(PASSWORD)},
        allow_networks=["127.0.0.1/32"],
    )
