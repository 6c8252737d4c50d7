"""A plugin's reply goes to the client only as SMTP allows a reply (``hooks.for_client``).

RFC 5321 section 4.2: reply text is printable US-ASCII (RFC 6531 lets an SMTPUTF8 session
see UTF-8 only in a 251/551 reply's mailbox); section 4.5.3.1.5: a reply line is at most
512 octets, code and CRLF included.  A plugin's text is neither checked nor trusted to be
so: the reviewers' plugin sent raw UTF-8 and a 2,000-character line to a plain client.
The units below are the pure helper; the rest is a real plugin at every receive hook of
the real receiver, on a real queue.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from tests.receiver.conftest import TlsFiles
from tests.receiver.harness import MESSAGE, Raw, nothing_left, run
from tests.receiver.test_hooks import plain, tls_session
from tests.support.plugins import write_plugin
from zoneq.protocol.replies import EnhancedStatus, Reply
from zoneq.receiver import SmtpReceiver
from zoneq.receiver.hooks import for_client
from zoneq.storage.store import QueueStore

S571 = EnhancedStatus(5, 7, 1)
WORDS = " ".join(["word"] * 300)  # 1,499 characters


@pytest.mark.parametrize(
    ("given", "sent"),
    [
        (Reply(550, ("No such user",), S571), Reply(550, ("No such user",), S571)),
        (Reply(550, ("",)), Reply(550, ("",))),
        (Reply(550, ("a", "", "b")), Reply(550, ("a", "", "b"))),
        (Reply(550, ("x" * 500,), S571), Reply(550, ("x" * 500,), S571)),  # 512 octets
        (Reply(550, ("x" * 506,)), Reply(550, ("x" * 506,))),  # 512 octets, no 5.7.1
        # Non-ASCII and controls (HT and NUL too) become "?", one per character.
        (Reply(550, ("unbekannt: \u00fc \u2603",)), Reply(550, ("unbekannt: ? ?",))),
        (Reply(550, ("a\tb\x00c\x1b[31m\x7f",)), Reply(550, ("a?b?c?[31m?",))),
        # Over 512 octets: split into lines that fit, at spaces where there are some.
        (Reply(550, ("x" * 501,), S571), Reply(550, ("x" * 500, "x"), S571)),
        (Reply(550, ("x" * 2000,), S571), Reply(550, ("x" * 500,) * 4, S571)),
        (Reply(550, ("x" * 2000,)), Reply(550, ("x" * 506,) * 3 + ("x" * 482,))),
        (
            Reply(550, (WORDS,), S571),
            Reply(550, (" ".join(["word"] * 100),) * 2 + (" ".join(["word"] * 100),), S571),
        ),
        # At most 8 lines.
        (
            Reply(550, tuple(f"line {n}" for n in range(20))),
            Reply(550, tuple(f"line {n}" for n in range(8))),
        ),
        (Reply(550, ("x" * 6000,)), Reply(550, ("x" * 506,) * 8)),
    ],
)
def test_for_client(given: Reply, sent: Reply) -> None:
    assert for_client(given) == sent
    assert all(len(line) <= 512 for line in for_client(given).to_wire().split(b"\n"))


def test_a_reply_already_fit_for_the_client_is_the_same_object() -> None:
    reply = Reply(451, ("Try again later",), EnhancedStatus(4, 3, 0))
    assert for_client(reply) is reply


PLUGIN = """
from zoneq.plugin import EnhancedStatus, Hook, Reply

TEXTS = {
    "uni": ("Benutzer unbekannt: \\u00fc \\u2603 \\x1b[31m\\x00",),
    "long": ("x" * 2000,),
    "words": (" ".join(["word"] * 300),),
    "many": tuple(f"line {n}" for n in range(20)),
}


# The refusal named by the local part's last word ("route-long@..." is "long").
def refusal(address, code=554):
    texts = TEXTS.get(address.split("@")[0].rpartition("-")[2])
    return None if texts is None else Reply(code, texts, EnhancedStatus(code // 100, 7, 1))


def init(app):
    async def auth(args):
        return refusal(args.username)

    async def mail_from(args):
        return refusal(args.sender)

    async def rcpt_to(args):
        return None if "-" in args.recipient.split("@")[0] else refusal(args.recipient)

    def route(args):
        # "hdr-" and "hdr4-" recipients are refused (5yz, 4yz) only in the zone a routing
        # header moves them to, at the final dot ("Re-checking the header's zone").
        local = args.recipient.split("@")[0]
        if local.startswith("route-"):
            return refusal(local)
        if args.rule == "header" and local.startswith("hdr"):
            return refusal(local, 451 if local.startswith("hdr4-") else 554)
        return None

    async def headers(args):
        for name, value in args.headers:
            if name.lower() == "x-refuse":
                return refusal(value.strip())
        return None

    app.add_hook(Hook.SMTP_AUTH, auth)
    app.add_hook(Hook.SMTP_MAIL_FROM, mail_from)
    app.add_hook(Hook.SMTP_RCPT_TO, rcpt_to)
    app.add_hook(Hook.QUEUE_ROUTE, route)
    app.add_hook(Hook.MESSAGE_HEADERS, headers)
"""

# What the client is sent for each text (the reply code and 5.7.1 on every line).
SENT = {
    "uni": ["554 5.7.1 Benutzer unbekannt: ? ? ?[31m?"],
    "long": ["554-5.7.1 " + "x" * 500] * 3 + ["554 5.7.1 " + "x" * 500],
    "words": ["554-5.7.1 " + " ".join(["word"] * 100)] * 2
    + ["554 5.7.1 " + " ".join(["word"] * 100)],
    "many": [f"554-5.7.1 line {n}" for n in range(7)] + ["554 5.7.1 line 7"],
}


def plugin_sections(tmp_path: Path) -> dict[str, Any]:
    module = write_plugin(tmp_path, "wordy", PLUGIN)
    zones = {"default": {}, "bounces": {}, "bulk": {}}
    return {"zones": zones, "plugins": {"wordy": {"module": str(module)}}}


def in_class(lines: list[str], code: str) -> list[str]:
    """``lines`` (of a 554 5.7.1 reply) as the same reply with ``code``."""
    status = f"{code[0]}.7.1"
    return [code + line[3:].replace("5.7.1", status, 1) for line in lines]


def fits(reply: str) -> list[str]:
    """The reply's lines, checked to be printable ASCII within 512 octets with CRLF."""
    lines = reply.split("\n")
    assert reply.isascii() and reply.replace("\n", "").isprintable(), reply
    assert all(len(line) + 2 <= 512 for line in lines), [len(line) for line in lines]
    return lines


@pytest.mark.parametrize("key", sorted(SENT))
def test_plugin_replies_at_mail_rcpt_route_and_the_dot_fit_the_wire(
    tmp_path: Path, key: str
) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        client = await Raw.greeted(rx.port)
        assert fits(await client.cmd(f"MAIL FROM:<{key}@d.test>")) == SENT[key]
        assert (await client.cmd("MAIL FROM:<c@d.test>")).startswith("250 ")
        assert fits(await client.cmd(f"RCPT TO:<{key}@b.test>")) == SENT[key]
        assert fits(await client.cmd(f"RCPT TO:<route-{key}@b.test>")) == SENT[key]
        assert (await client.cmd("RCPT TO:<a@b.test>")).startswith("250 ")
        assert (await client.cmd("DATA")).startswith("354 ")
        await client.send(b"X-Refuse: " + key.encode() + b"\r\n" + MESSAGE + b".\r\n")
        assert fits(await client.reply()) == SENT[key]
        # A trusted client's routing header moves the recipient; the re-check refuses it.
        for prefix, code in (("hdr", "554"), ("hdr4", "451")):
            assert (await client.cmd("MAIL FROM:<c@d.test>")).startswith("250 ")
            assert (await client.cmd(f"RCPT TO:<{prefix}-{key}@b.test>")).startswith("250 ")
            assert (await client.cmd("DATA")).startswith("354 ")
            await client.send(b"X-Sending-Zone: bulk\r\n" + MESSAGE + b".\r\n")
            assert fits(await client.reply()) == in_class(SENT[key], code)
        await client.quit()
        await nothing_left(store)

    run(tmp_path, body, sections=plugin_sections(tmp_path))


def test_plugin_reply_to_auth_fits_the_wire(tmp_path: Path, tls_files: TlsFiles) -> None:
    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        client = await tls_session(rx.port, tls_files)
        for key, sent in SENT.items():
            assert fits(await client.cmd(plain(key, "secret"))) == sent
        await client.quit()

    run(
        tmp_path,
        body,
        sections=plugin_sections(tmp_path),
        tls_cert=str(tls_files.cert),
        tls_key=str(tls_files.key),
    )
