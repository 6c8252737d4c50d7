"""Routing and the receive-time plugin hooks on the real receiver and a real queue.

The plugin is a real module written to ``tmp_path`` and loaded by the real ``PluginHost``
(``tests/support/plugins.py``); what it decides depends on the address's local part, and
it appends each call's arguments to a JSON-lines file the test reads back.  Clients send
from 127.0.0.x; the zones each recipient landed in are read from the LevelDB queue.
"""

from __future__ import annotations

import base64
import json
import ssl
from pathlib import Path
from typing import Any

import pytest

from tests.receiver.conftest import HOSTNAME, TlsFiles
from tests.receiver.harness import MESSAGE, Raw, nothing_left, queued_id, run
from tests.support.plugins import write_plugin
from zoneq.receiver import SmtpReceiver
from zoneq.storage.store import QueueStore

ZONES: dict[str, Any] = {"default": {}, "bounces": {}, "bulk": {}, "tx": {}}
RULES: list[dict[str, Any]] = [
    {"zone": "bulk", "sender_domain": ["news.test"]},
    {"zone": "tx", "recipient_domain": [".tx.test"]},
    {"zone": "bulk", "client_network": ["127.0.0.3/32"]},
]

PLUGIN = """
import asyncio
import json
from pathlib import Path

from zoneq.plugin import Drop, EnhancedStatus, Hook, Reply


def init(app):
    log = Path(app.options["log"])

    def record(hook, args, **fields):
        session = args.session
        seen = {"hook": hook, "client": session.client_ip, "helo": session.helo,
                "user": session.user, "trusted": session.trusted, **fields}
        with log.open("a") as out:
            out.write(json.dumps(seen) + "\\n")

    async def misbehave(local):
        if local == "raise":
            raise RuntimeError("plugin bug")
        if local == "hang":
            await asyncio.sleep(60)
        if local == "garbage":
            return 42
        return None

    async def auth(args):
        record("smtp:auth", args, username=args.username, mechanism=args.mechanism)
        if args.username == "plugin-user":
            return args.password == "plugin-pass"
        if args.username == "locked":
            return Reply(454, ("Account locked, call us",), EnhancedStatus(4, 7, 0))
        return await misbehave(args.username)

    async def mail_from(args):
        record("smtp:mail_from", args, sender=args.sender)
        if args.sender.startswith("unwanted@"):
            return Reply(550, ("Sender not welcome",), EnhancedStatus(5, 7, 1))
        return None

    async def rcpt_to(args):
        record("smtp:rcpt_to", args, recipient=args.recipient, zone=args.zone)
        local = args.recipient.split("@")[0]
        if local == "refused":
            return Reply(550, ("No such user here",), EnhancedStatus(5, 1, 1))
        if local == "later":
            return Reply(450, ("Mailbox busy, try later",), EnhancedStatus(4, 2, 1))
        return await misbehave(local)

    async def route(args):
        local = args.recipient.split("@")[0]
        if local == "vip":
            return "tx"
        if local == "dropped":
            return Drop("test drop")
        return await misbehave(local.removeprefix("route-"))

    async def headers(args):
        record("message:headers", args, recipients=list(args.recipients),
               headers=[list(pair) for pair in args.headers])
        names = {name.lower() for name, _ in args.headers}
        if "x-refuse" in names:
            return Reply(554, ("Content refused by policy",), EnhancedStatus(5, 7, 1))
        if "x-raise" in names:
            raise ValueError("cannot read these headers")
        if "x-hang" in names:
            return await misbehave("hang")
        if "x-garbage" in names:
            return await misbehave("garbage")
        return None

    app.add_hook(Hook.SMTP_AUTH, auth)
    app.add_hook(Hook.SMTP_MAIL_FROM, mail_from)
    app.add_hook(Hook.SMTP_RCPT_TO, rcpt_to)
    app.add_hook(Hook.QUEUE_ROUTE, route)
    app.add_hook(Hook.MESSAGE_HEADERS, headers)
"""


def sections(tmp_path: Path, *, plugin: bool = True) -> dict[str, Any]:
    """Zones, routing rules and (by default) the test plugin with a short time limit."""
    data: dict[str, Any] = {"zones": ZONES, "routing": {"rules": RULES}}
    if plugin:
        module = write_plugin(tmp_path, "receive_hooks", PLUGIN)
        options = {"log": str(tmp_path / "calls.jsonl")}
        data["plugins"] = {
            "receive_hooks": {"module": str(module), "timeout": "1s", "options": options}
        }
    return data


def calls(tmp_path: Path, hook: str) -> list[dict[str, Any]]:
    path = tmp_path / "calls.jsonl"
    lines = path.read_text().splitlines() if path.exists() else []
    return [c for c in map(json.loads, lines) if c["hook"] == hook]


async def session(port: int, source: str = "127.0.0.1") -> Raw:
    client = await Raw.connect(port, source=source)
    assert (await client.reply()).startswith("220 ")
    assert (await client.cmd("EHLO client.test")).startswith("250")
    return client


async def send(
    port: int, sender: str, rcpts: list[str], *, source: str = "127.0.0.1", text: bytes = MESSAGE
) -> str:
    """One message; every RCPT must be accepted.  The reply to the final dot."""
    client = await session(port, source)
    try:
        assert (await client.cmd(f"MAIL FROM:<{sender}>")).startswith("250 ")
        for rcpt in rcpts:
            reply = await client.cmd(f"RCPT TO:<{rcpt}>")
            assert reply.startswith("250 "), (rcpt, reply)
        return await data(client, text)
    finally:
        await client.close()


async def data(client: Raw, text: bytes) -> str:
    assert (await client.cmd("DATA")).startswith("354 ")
    await client.send(text + b".\r\n")
    return await client.reply()


def zones_of(store: QueueStore, reply: str) -> dict[str, str]:
    msg_id = queued_id(reply)
    return {r.recipient.address: r.recipient.zone for r in store.recipients(msg_id)}


def with_header(*fields: bytes) -> bytes:
    return b"".join(field + b"\r\n" for field in fields) + MESSAGE


# --- routing rules --------------------------------------------------------------------------


def test_rules_route_by_sender_then_recipient_domain_then_client_network(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        # The sender's domain ranks above the recipient's.
        by_sender = await send(rx.port, "c@news.test", ["a@x.tx.test", "b@b.test"])
        assert zones_of(store, by_sender) == {"a@x.tx.test": "bulk", "b@b.test": "bulk"}
        by_recipient = await send(rx.port, "c@d.test", ["a@x.tx.test", "b@b.test"])
        assert zones_of(store, by_recipient) == {"a@x.tx.test": "tx", "b@b.test": "default"}
        # 127.0.0.3's network rule ranks below the recipient domain's.
        by_client = await send(rx.port, "c@d.test", ["a@x.tx.test", "b@b.test"], source="127.0.0.3")
        assert zones_of(store, by_client) == {"a@x.tx.test": "tx", "b@b.test": "bulk"}
        # ".tx.test" is every domain below tx.test, not tx.test itself (Postfix's rule).
        apex = await send(rx.port, "c@d.test", ["a@tx.test"])
        assert zones_of(store, apex) == {"a@tx.test": "default"}

    run(tmp_path, body, sections=sections(tmp_path, plugin=False))


def test_trusted_zone_header_moves_rule_placed_recipients_not_plugin_overrides(
    tmp_path: Path,
) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        text = with_header(b"x-sending-zone:  bulk ")
        reply = await send(
            rx.port, "c@news.test", ["a@b.test", "c@x.tx.test", "vip@b.test"], text=text
        )
        # The plugin's choice (vip -> tx) ranks above the header; the rules' do not.
        assert zones_of(store, reply) == {
            "a@b.test": "bulk",
            "c@x.tx.test": "bulk",
            "vip@b.test": "tx",
        }
        # Stored as sent: the delivery side removes the header from the outgoing copy.
        assert b"x-sending-zone:  bulk \r\n" in b"".join(store.body(queued_id(reply)))
        unknown = await send(
            rx.port, "c@d.test", ["a@b.test"], text=with_header(b"X-Sending-Zone: nosuch")
        )
        assert zones_of(store, unknown) == {"a@b.test": "default"}

    run(tmp_path, body, sections=sections(tmp_path))


# --- plugins at MAIL, RCPT and the final dot ------------------------------------------------


def test_plugins_refuse_and_defer_with_their_own_replies(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        client = await session(rx.port)
        try:
            assert await client.cmd("MAIL FROM:<unwanted@d.test>") == "550 5.7.1 Sender not welcome"
            assert (await client.cmd("MAIL FROM:<c@d.test>")).startswith("250 ")
            assert await client.cmd("RCPT TO:<refused@b.test>") == "550 5.1.1 No such user here"
            assert await client.cmd("RCPT TO:<later@b.test>") == "450 4.2.1 Mailbox busy, try later"
            assert (await client.cmd("RCPT TO:<a@x.tx.test>")).startswith("250 ")
            reply = await data(client, MESSAGE)
        finally:
            await client.close()
        assert zones_of(store, reply) == {"a@x.tx.test": "tx"}
        [_, mail] = calls(tmp_path, "smtp:mail_from")
        assert mail == {
            "hook": "smtp:mail_from",
            "client": "127.0.0.1",
            "helo": "client.test",
            "user": None,
            "trusted": True,
            "sender": "c@d.test",
        }
        rcpts = [(c["recipient"], c["zone"]) for c in calls(tmp_path, "smtp:rcpt_to")]
        assert rcpts == [
            ("refused@b.test", "default"),
            ("later@b.test", "default"),
            ("a@x.tx.test", "tx"),
        ]
        [headers] = calls(tmp_path, "message:headers")
        assert headers["recipients"] == ["a@x.tx.test"]
        assert headers["headers"] == [
            ["From", "Sender <c@d.test>"],
            ["To", "a@b.test"],
            ["Subject", "Hello there"],
            ["Message-ID", "<m1@d.test>"],
        ]

    run(tmp_path, body, sections=sections(tmp_path))


@pytest.mark.parametrize(
    "local", ["raise", "hang", "garbage", "route-raise", "route-hang", "route-garbage"]
)
def test_failing_plugin_at_rcpt_is_451_and_nothing_is_stored(tmp_path: Path, local: str) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        client = await session(rx.port)
        try:
            assert (await client.cmd("MAIL FROM:<c@d.test>")).startswith("250 ")
            reply = await client.cmd(f"RCPT TO:<{local}@b.test>")
            assert reply.startswith("451 4.3.0 "), reply
            assert (await client.cmd("DATA")).startswith("503 ")  # no recipient accepted
            assert (await client.cmd("QUIT")).startswith("221 ")
        finally:
            await client.close()
        await nothing_left(store)

    run(tmp_path, body, sections=sections(tmp_path))


@pytest.mark.parametrize(
    ("field", "expected"),
    [
        (b"X-Refuse: yes", "554 5.7.1 Content refused by policy"),
        (b"X-Raise: yes", "451 4.3.0 "),
        (b"X-Hang: yes", "451 4.3.0 "),  # past the plugin's 1 s time limit
        (b"X-Garbage: yes", "451 4.3.0 "),
    ],
)
def test_message_headers_refusal_answers_at_the_dot_and_stores_nothing(
    tmp_path: Path, field: bytes, expected: str
) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        reply = await send(rx.port, "c@d.test", ["a@b.test"], text=with_header(field))
        assert reply.startswith(expected), reply
        await nothing_left(store)

    run(tmp_path, body, sections=sections(tmp_path))


def test_dropped_recipient_gets_250_and_is_not_queued(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        reply = await send(rx.port, "c@d.test", ["dropped@b.test", "a@b.test"])
        assert zones_of(store, reply) == {"a@b.test": "default"}
        only = await send(rx.port, "c@d.test", ["dropped@b.test"])
        assert only == "250 2.0.0 Ok: accepted, nothing to deliver"
        await store.drain()
        page, _ = store.browse("default")
        assert [r.msg_id for r in page] == [queued_id(reply)]

    run(tmp_path, body, sections=sections(tmp_path))


# --- AUTH: a plugin decides, and an authenticated client's header is trusted ----------------

OUTSIDE = "127.0.0.2"  # not in allow_networks below: trusted only once authenticated


def tls_sections(tmp_path: Path, files: TlsFiles) -> dict[str, Any]:
    return {
        "sections": sections(tmp_path),
        "tls_cert": str(files.cert),
        "tls_key": str(files.key),
        "allow_networks": ["127.0.0.1/32"],
    }


async def tls_session(port: int, files: TlsFiles) -> Raw:
    client = await session(port, OUTSIDE)
    assert (await client.cmd("STARTTLS")).startswith("220 ")
    await client.start_tls(ssl.create_default_context(cafile=str(files.cert)), HOSTNAME)
    ehlo = await client.cmd("EHLO client.test")
    assert "AUTH PLAIN LOGIN" in ehlo  # offered for the plugin: no auth_users configured
    return client


def plain(user: str, password: str) -> str:
    return "AUTH PLAIN " + base64.b64encode(f"\0{user}\0{password}".encode()).decode()


def test_auth_plugin_decides_and_the_header_is_trusted_only_once_authenticated(
    tmp_path: Path, tls_files: TlsFiles
) -> None:
    text = with_header(b"X-Sending-Zone: bulk")

    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        client = await tls_session(rx.port, tls_files)
        try:
            assert (await client.cmd("MAIL FROM:<c@d.test>")).startswith("250 ")
            # Untrusted: no relay, so its routing header can never choose a zone.
            assert (await client.cmd("RCPT TO:<a@b.test>")).startswith("554 5.7.1 ")
            assert (await client.cmd("RSET")).startswith("250 ")
            assert await client.cmd(plain("locked", "x")) == "454 4.7.0 Account locked, call us"
            assert (await client.cmd(plain("plugin-user", "wrong"))).startswith("535 5.7.8 ")
            assert (await client.cmd(plain("plugin-user", "plugin-pass"))).startswith("235 ")
            assert (await client.cmd("MAIL FROM:<c@d.test>")).startswith("250 ")
            assert (await client.cmd("RCPT TO:<a@b.test>")).startswith("250 ")
            reply = await data(client, text)
        finally:
            await client.close()
        assert zones_of(store, reply) == {"a@b.test": "bulk"}
        assert store.message(queued_id(reply)).source["auth"] == "plugin-user"
        users = [(c["username"], c["mechanism"]) for c in calls(tmp_path, "smtp:auth")]
        assert users == [("locked", "PLAIN"), ("plugin-user", "PLAIN"), ("plugin-user", "PLAIN")]
        [headers] = calls(tmp_path, "message:headers")
        assert (headers["client"], headers["user"], headers["trusted"]) == (
            OUTSIDE,
            "plugin-user",
            True,
        )

    run(tmp_path, body, **tls_sections(tmp_path, tls_files))


def test_auth_plugin_failure_is_451_and_does_not_authenticate(
    tmp_path: Path, tls_files: TlsFiles
) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        client = await tls_session(rx.port, tls_files)
        try:
            for user in ("raise", "hang", "garbage"):
                assert (await client.cmd(plain(user, "x"))).startswith("451 4.3.0 "), user
            # No opinion from the plugin: the configured users (none here) decide.
            assert (await client.cmd(plain("nobody", "x"))).startswith("535 5.7.8 ")
            assert (await client.cmd("MAIL FROM:<c@d.test>")).startswith("250 ")
            assert (await client.cmd("RCPT TO:<a@b.test>")).startswith("554 5.7.1 ")
        finally:
            await client.close()
        await nothing_left(store)

    run(tmp_path, body, **tls_sections(tmp_path, tls_files))


def test_no_plugin_no_rules_everything_goes_to_the_default_zone(tmp_path: Path) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        reply = await send(
            rx.port, "c@news.test", ["a@x.tx.test"], text=with_header(b"X-Sending-Zone: tx")
        )
        # Trusted header, no rules: the header decides; without it, the default zone.
        assert zones_of(store, reply) == {"a@x.tx.test": "tx"}
        plain_reply = await send(rx.port, "c@news.test", ["a@x.tx.test"])
        assert zones_of(store, plain_reply) == {"a@x.tx.test": "default"}

    run(tmp_path, body, sections={"zones": ZONES})
