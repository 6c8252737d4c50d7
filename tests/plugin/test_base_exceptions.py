"""A handler raising what is not an ``Exception`` is still only a 451 (issue 5).

Through the real receiver: ``KeyboardInterrupt`` used to stop the whole core (exit 130),
and a bare ``BaseException``, a ``CancelledError`` nobody asked for or a ``GeneratorExit``
(taken for the close of the host's own coroutine) dropped the client's connection or left
the RCPT with no reply.  Both of the host's paths: an ``async def`` handler at
smtp:rcpt_to runs on the event loop, a plain one at queue:route on the plugin's threads
(its exception re-raised on the loop by the future).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.receiver.harness import MESSAGE, Raw, queued_id, run
from tests.support.plugins import ZONES, write_plugin
from zoneq.receiver import SmtpReceiver
from zoneq.storage.store import QueueStore

RAISING_PLUGIN = """
import asyncio

from zoneq.plugin import Hook

RAISE = {
    "kbd": KeyboardInterrupt,
    "base": BaseException,
    "cancel": asyncio.CancelledError,
    "genexit": GeneratorExit,
}


def raise_for(recipient, prefix=""):
    # Only the hook the prefix names raises: "kbd@" reaching the plain route handler too
    # would test the threads' path twice and the event loop's not at all.
    local = recipient.partition("@")[0]
    kind = RAISE.get(local[len(prefix):]) if local.startswith(prefix) else None
    if kind is not None:
        raise kind("raised by the plugin")


def init(app):
    async def rcpt_to(args):
        raise_for(args.recipient)

    def route(args):
        raise_for(args.recipient, prefix="route-")

    app.add_hook(Hook.SMTP_RCPT_TO, rcpt_to)
    app.add_hook(Hook.QUEUE_ROUTE, route)
"""

RECIPIENTS = [
    f"{prefix}{kind}@b.test"
    for prefix in ("", "route-")
    for kind in ("kbd", "base", "cancel", "genexit")
]


@pytest.mark.parametrize("recipient", RECIPIENTS)
def test_a_handler_raising_a_base_exception_is_451_and_the_session_goes_on(
    tmp_path: Path, recipient: str
) -> None:
    module = write_plugin(tmp_path, "raising", RAISING_PLUGIN)
    sections = {"zones": ZONES, "plugins": {"raising": {"module": str(module)}}}

    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        client = await Raw.connect(rx.port)
        assert (await client.reply()).startswith("220 ")
        assert (await client.cmd("EHLO client.test")).startswith("250")
        assert (await client.cmd("MAIL FROM:<c@d.test>")).startswith("250 ")
        reply = await client.cmd(f"RCPT TO:<{recipient}>")
        assert reply.startswith("451 4.3.0 "), reply
        # The same connection still works: the session was not ended by the exception.
        assert (await client.cmd("RCPT TO:<fine@b.test>")).startswith("250 ")
        assert (await client.cmd("DATA")).startswith("354 ")
        await client.send(MESSAGE + b".\r\n")
        msg_id = queued_id(await client.reply())
        assert [r.recipient.address for r in store.recipients(msg_id)] == ["fine@b.test"]
        await client.close()

    run(tmp_path, body, sections=sections, allow_networks=["127.0.0.1/32"])
