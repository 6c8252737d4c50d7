"""The accept path's shortcuts in the SMTP server machine give what the long way gives.

Each shortcut (``smtp_commands``: the path without a quoted-string, the verb without a
regex, the control check; ``smtp_server``: replies rendered once) is compared with a
reference written from the RFC 5321 grammar, over the awkward inputs and Hypothesis'.
"""

from __future__ import annotations

import re

import pytest
from hypothesis import given
from hypothesis import strategies as st

from zoneq.protocol import smtp_server
from zoneq.protocol.local_parts import canonical_address
from zoneq.protocol.replies import EnhancedStatus, Reply
from zoneq.protocol.smtp_commands import (
    CommandError,
    parse_mail,
    parse_rcpt,
    split_command,
)
from zoneq.protocol.smtp_server import ServerConnection

MAX_PATH = 256


# RFC 5321 section 4.1.2: the path ends at the first ">" outside a quoted-string, in
# which a backslash quotes the next character; outside one a backslash is just a character.
_REFERENCE_PATH = re.compile(r'<((?:[^">]|"(?:\\.|[^"\\])*")*)>')


def reference_split_path(argument: str, prefix: str) -> tuple[str, str] | str:
    """The path and parameter text by the grammar above; the reply text on a fault."""
    if argument[: len(prefix)].upper() != prefix:
        return f"Syntax: {prefix}<address>"
    rest = argument[len(prefix) :].lstrip(" ")
    match = _REFERENCE_PATH.match(rest)
    if match is None:
        return "Address must be enclosed in <>"
    params = rest[match.end() :]
    if params and not params.startswith(" "):
        return "Space required after the address"
    if match.end() > MAX_PATH:
        return "Path too long"
    return match.group(1), params.strip(" ")


PATHS = [
    "TO:<a@b.test>",
    "TO: <a@b.test>",
    "TO:<a@b.test>NOTIFY=NEVER",
    "TO:<a@b.test",
    "TO:a@b.test",
    "TO:<>",
    "TO:<" + "a" * 60 + "@" + "b" * 200 + ".test>",
    "TO:<" + "a" * 60 + "@" + "b" * 190 + ".test>",
    'TO:<"a>b"@c.test>',
    'TO:<"a\\"b"@c.test>',
    "TO:<a@b.test> ",
    "TO:<a@b>c.test>",
    "FROM:<a@b.test>",
]


SPLIT_FAULTS = {
    "Syntax: TO:<address>",
    "Syntax: FROM:<address>",
    "Address must be enclosed in <>",
    "Space required after the address",
    "Path too long",
}


def check(argument: str, expected: tuple[str, str] | str) -> None:
    """``parse_mail``/``parse_rcpt`` refuse exactly what the grammar refuses, with its
    reply; what it accepts they take (or refuse later, for the mailbox or a parameter)."""
    try:
        if argument.upper().startswith("FROM:"):
            got = parse_mail(argument, esmtp=True, max_size=10**9).sender
        else:
            got = parse_rcpt(argument, esmtp=True, smtputf8=True).recipient
    except CommandError as error:
        text = error.reply.lines[0]
        if isinstance(expected, str):
            assert text == expected
        else:
            assert text not in SPLIT_FAULTS, (text, expected)
        return
    assert isinstance(expected, tuple), (got, expected)
    assert got == canonical_address(expected[0])  # the mailbox stored least quoted


@pytest.mark.parametrize("argument", PATHS)
def test_paths_split_as_the_grammar_says(argument: str) -> None:
    prefix = "FROM:" if argument.startswith("FROM:") else "TO:"
    check(argument, reference_split_path(argument, prefix))


_path_text = st.text(alphabet='ab@.<>" \\=', max_size=40)


@given(st.sampled_from(["FROM:", "TO:", "from:", "TO: "]), _path_text)
def test_any_path_text_splits_as_the_grammar_says(prefix: str, text: str) -> None:
    argument = prefix + text
    check(argument, reference_split_path(argument, prefix.strip().upper()))


@pytest.mark.parametrize(
    ("line", "verb"),
    [
        ("EHLO x", "EHLO"),
        ("ehlo x", "EHLO"),
        ("MAIL FROM:<>", "MAIL"),
        ("QUIT", "QUIT"),
        ("", None),
        (" EHLO x", None),
        ("EH1O x", None),
        ("ÉHLO x", None),
        ("EHLO\tx", None),
    ],
)
def test_verbs_are_ascii_letters(line: str, verb: str | None) -> None:
    if verb is None:
        with pytest.raises(CommandError):
            split_command(line)
    else:
        assert split_command(line)[0] == verb


@given(st.text(max_size=12))
def test_verb_check_equals_the_rfc_grammar(word: str) -> None:
    """RFC 5321 4.1.1: a verb is ASCII letters; the shortcut agrees with the regex."""
    line = word + " arg"
    grammatical = re.fullmatch(r"[A-Za-z]+", line.partition(" ")[0]) is not None
    try:
        verb, _ = split_command(line)
    except CommandError:
        assert not grammatical
    else:
        assert grammatical and verb == line.partition(" ")[0].upper()


@given(st.text(alphabet=st.characters(max_codepoint=0x90), min_size=1, max_size=8))
def test_controls_anywhere_in_an_address_are_refused(local: str) -> None:
    argument = f"TO:<{local}@b.test>"
    has_control = any(ord(c) < 0x20 or ord(c) == 0x7F for c in local)
    try:
        parse_rcpt(argument, esmtp=True, smtputf8=True)
    except CommandError:
        return
    assert not has_control


REPLIES = [
    smtp_server.OK,
    smtp_server.SENDER_OK,
    smtp_server.QUEUED,
    smtp_server.START_INPUT,
    Reply(250, ("first", "second"), EnhancedStatus(2, 0, 0)),
    Reply(451, ("",), EnhancedStatus(4, 3, 0)),
]


@pytest.mark.parametrize("reply", REPLIES)
def test_remembered_replies_are_rendered_as_to_wire(reply: Reply) -> None:
    assert smtp_server._wire(reply) == reply.to_wire()
    assert smtp_server._wire(reply) == reply.to_wire()  # the second time from the cache


def test_a_reply_that_cannot_be_a_key_is_still_rendered() -> None:
    reply = Reply(550, ["no", "key"], EnhancedStatus(5, 0, 0))  # type: ignore[arg-type]
    assert smtp_server._wire(reply) == b"550-5.0.0 no\r\n550 5.0.0 key\r\n"


@pytest.mark.parametrize(
    ("options", "last"),
    [
        ({}, "DSN"),
        ({"tls_offered": True}, "STARTTLS"),
        ({"tls_offered": True, "tls_active": True, "auth_offered": True}, "AUTH PLAIN LOGIN"),
    ],
)
def test_ehlo_replies_differ_by_what_the_session_offers(
    options: dict[str, bool], last: str
) -> None:
    """The remembered EHLO reply is per offer: a session never sees another's keywords."""
    for hostname in ("mx.a.test", "mx.b.test"):
        conn = ServerConnection(hostname, max_message_size=1000, **options)
        conn.receive(b"EHLO c.test\r\n")
        lines = conn.data_to_send().decode().split("\r\n")
        assert lines[0] == f"250-{hostname}"
        assert lines[-2] == f"250 {last}"
        assert "250-SIZE 1000" in lines
