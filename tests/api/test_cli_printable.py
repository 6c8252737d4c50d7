"""Stored text reaches the operator's terminal escaped: ``printable`` over a table of
control characters, and ``zoneq queue show`` / ``browse`` as a person runs them against a
real ``zoneq serve`` (smtp-sink as the MX, dnsmasq as DNS), with ``--json`` unchanged."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.api.test_serve_cli import ok, zoneq
from tests.support.bed import ok_test_bed
from tests.support.serve import running_serve
from zoneq.api.command import printable, table

# Every character no terminal should receive from stored text: C0 (ESC, BEL, CR, LF, TAB,
# NUL), DEL, C1 (CSI, NEL, OSC), the Unicode line and paragraph separators, a bidi override.
UNPRINTABLE = "\x00\x07\t\n\r\x1b\x7f\x85\x9b\x9d\u2028\u2029\u202e"


@pytest.mark.parametrize(
    ("text", "shown"),
    [
        ("plain text, Grüße, 日本", "plain text, Grüße, 日本"),
        ("hi\x1b]0;pwned\x07\x1b[2J", "hi\\x1b]0;pwned\\x07\\x1b[2J"),
        ("a\r\nfake row", "a\\r\\nfake row"),
        ("tab\there", "tab\\there"),
        ("\x7f\x85\x9b", "\\x7f\\x85\\x9b"),
        ("x\u2028y\u2029z", "x\\u2028y\\u2029z"),
        ("\u202etxt.exe", "\\u202etxt.exe"),
        (42, "42"),
    ],
)
def test_printable_escapes_what_a_terminal_would_act_on(text: object, shown: str) -> None:
    assert printable(text) == shown


@pytest.mark.parametrize("char", list(UNPRINTABLE))
def test_no_table_cell_or_header_passes_a_control_character(char: str) -> None:
    lines = table([[f"a{char}b", 1]], [f"h{char}", "n"]).split("\n")
    assert len(lines) == 2  # the header and the one row: no forged row
    assert not any(char in line for line in lines)


SUBJECT = "hi\x1b]0;pwned\x07\x1b[2J\r\nfake row"
MESSAGE = (
    b"From: a@src.test\r\nTo: b@ok.test\r\n"
    b"Subject: =?utf-8?q?hi=1B]0;pwned=07=1B[2J=0D=0Afake_row?=\r\n\r\nx\r\n"
)


@pytest.mark.integration
def test_queue_show_and_browse_escape_stored_text_on_a_real_serve(tmp_path: Path) -> None:
    message = tmp_path / "msg.eml"
    message.write_bytes(MESSAGE)
    with ok_test_bed(tmp_path) as (_, config), running_serve(config, tmp_path / "serve.log"):
        ok(config, "queue", "pause", "default")  # nothing leaves while the test looks
        queued = ok(config, "send", str(message))
        held = ok(config, "queue", "hold", queued["id"], "--reason", "look\u2028here")
        assert held["count"] == 1
        # --json: the API's JSON as it is (JSON escapes the controls itself).
        assert ok(config, "queue", "show", queued["id"])["headers"]["Subject"] == SUBJECT
        for args in (("show", queued["id"]), ("browse", "default", "--state", "held")):
            done = zoneq(config, "queue", *args)
            assert done.returncode == 0, done.stderr
            assert not set(UNPRINTABLE) & set(done.stdout.replace("\n", "")), done.stdout
        shown = zoneq(config, "queue", "show", queued["id"]).stdout
        assert "hi\\x1b]0;pwned\\x07\\x1b[2J\\r\\nfake row" in shown
        assert not any(line.startswith("fake row") for line in shown.splitlines())
        browsed = zoneq(config, "queue", "browse", "default", "--state", "held").stdout
        assert "look\\u2028here" in browsed
