"""``zoneq send``, ``zoneq queue browse|purge|retry|hold|release`` and ``zoneq check-config``
as a person runs them: real subprocesses of the command line against a real ``zoneq serve``
(smtp-sink as the MX, dnsmasq as DNS), their ``--json`` output parsed."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import wcwidth

from tests.api.test_serve_cli import CLI_TIMEOUT_S, ok, zoneq
from tests.support.bed import ok_test_bed
from tests.support.serve import ROOT, running_serve, write_serve_config

pytestmark = pytest.mark.integration

MESSAGE = (
    b"From: Alice <alice@src.test>\r\nTo: bob@ok.test\r\nCc: carol@ok.test\r\n"
    b"Bcc: dave@ok.test\r\nSubject: admin\r\n\r\nHello.\r\n"
)


def addresses(page: dict[str, list[dict[str, str]]]) -> set[tuple[str, str]]:
    return {(r["message_id"], r["address"]) for r in page["recipients"]}


def test_send_and_the_admin_commands_on_a_real_serve(tmp_path: Path) -> None:
    message = tmp_path / "msg.eml"
    message.write_bytes(MESSAGE)
    with ok_test_bed(tmp_path) as (sink, config), running_serve(config, tmp_path / "serve.log"):
        ok(config, "queue", "pause", "default")  # nothing leaves while the test looks

        # --from without --to: the recipients come from the headers (Bcc too, then removed),
        # only the envelope sender is the given one; --from "" is the null reverse-path.
        bounced = ok(config, "send", str(message), "--from", "bounces@src.test")
        everyone = ["bob@ok.test", "carol@ok.test", "dave@ok.test"]
        assert bounced["recipients"] == everyone
        assert ok(config, "queue", "show", bounced["id"])["sender"] == "bounces@src.test"
        null = ok(config, "send", str(message), "--from", "")
        assert null["recipients"] == everyone
        assert ok(config, "queue", "show", null["id"])["sender"] == ""
        source = zoneq(config, "queue", "source", null["id"])
        assert "dave" not in source.stdout and source.stdout.endswith("Hello.\n")

        page = ok(config, "queue", "browse", "default", "--limit", "4")
        assert len(page["recipients"]) == 4 and page["cursor"]
        rest = ok(config, "queue", "browse", "default", "--cursor", page["cursor"])
        assert rest["cursor"] is None
        assert addresses(page) | addresses(rest) == {
            (m, a) for m in (bounced["id"], null["id"]) for a in everyone
        }

        held_now = ok(config, "queue", "hold", null["id"], "--reason", "checking")
        assert held_now == {"count": 3, "on_return": 0}
        held = ok(config, "queue", "browse", "default", "--state", "held")
        assert {r["hold_reason"] for r in held["recipients"]} == {"checking"}
        refused = zoneq(config, "queue", "hold", bounced["id"], "--reason", "x\r\ny")
        assert refused.returncode == 1 and "control character" in refused.stderr
        assert ok(config, "queue", "release", null["id"]) == {"count": 3, "on_return": 0}
        assert ok(config, "queue", "hold", "--zone", "default") == {"count": 6}
        assert ok(config, "queue", "release", "--zone", "default") == {"count": 6}

        # Nothing is deferred (the zone is paused): retry counts 0 for a zone or a domain,
        # and a message with nothing deferred is the API's 409.
        assert ok(config, "queue", "retry", "--zone", "default", "--domain", "ok.test") == {
            "count": 0
        }
        assert ok(config, "queue", "retry", "--domain", "ok.test") == {"count": 0}
        nothing = zoneq(config, "queue", "retry", null["id"])
        assert nothing.returncode == 1 and "no deferred recipients (409)" in nothing.stderr
        mixed = zoneq(config, "queue", "retry", null["id"], "--domain", "ok.test")
        assert mixed.returncode == 2 and "--domain" in mixed.stderr

        # A filter that would not narrow is refused, naming it, before anything is purged;
        # where --all is the way out, the refusal names the option, not only the API's "all".
        # An empty one is the command's own usage error (exit 2), as retry's --domain "".
        for args, named, all_helps, code in (
            ((), "no filter given: ", True, 1),
            (("--older-than", "0"), "older_than: ", True, 1),
            (("--zone", "default", "--sender-domain", ""), "--sender-domain: ", False, 2),
        ):
            refused = zoneq(config, "queue", "purge", *args)
            assert refused.returncode == code and named in refused.stderr, refused.stderr
            assert ('"all": true (--all)' in refused.stderr) is all_helps, refused.stderr
        empty = zoneq(config, "queue", "retry", "--zone", "default", "--domain", "")
        assert empty.returncode == 2 and "domain: must not be empty" in empty.stderr

        purged = ok(config, "queue", "purge", "--zone", "default", "--recipient-domain", "ok.test")
        assert purged == {"count": 6}
        assert ok(config, "queue", "counts")["messages"] == 0
        assert sink.messages(0, timeout=0.2) == []


def test_with_the_api_disabled_the_commands_say_so(tmp_path: Path) -> None:
    """Not "no API token ... start zoneq serve once": serve runs, and with the API off it
    generates no token and nothing listens."""
    config = write_serve_config(tmp_path / "bed", mx_port=1, dns_port=1)
    config.write_text(config.read_text().replace("[api]\n", "[api]\nenabled = false\n"))
    with running_serve(config, tmp_path / "serve.log"):
        for args in (("queue", "counts"), ("suppression", "list", "default")):
            done = zoneq(config, *args)
            assert done.returncode == 2, done.stderr
            assert "the HTTP API is disabled ([api] enabled = false)" in done.stderr
            assert "token" not in done.stderr and done.stdout == ""


def check_config(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "zoneq", "check-config", *args],
        cwd=ROOT, capture_output=True, text=True, timeout=CLI_TIMEOUT_S, check=False,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('[zones.default]\nconnections = "many"\n', "zones.default.connections"),
        ('[api]\nlisten = "nowhere"\n', "api.listen"),
        ("[receiver]\nno_such_setting = 1\n", "receiver.no_such_setting"),
    ],
)
def test_check_config_names_the_key_and_exits_1(tmp_path: Path, text: str, key: str) -> None:
    path = tmp_path / "zones.toml"
    path.write_text(text)
    done = check_config(str(path))
    assert done.returncode == 1, (done.stdout, done.stderr)
    assert f"  {key}" in done.stderr and "problem(s)" in done.stderr
    assert "Traceback" not in done.stderr and done.stdout == ""


def test_check_config_of_good_files_is_ok_and_exits_0(tmp_path: Path) -> None:
    for args in ((), (str(ROOT / "config" / "zones.toml"),)):
        done = check_config(*args)
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip().endswith(": ok"), done.stdout


def test_names_in_any_spelling_and_json_errors_on_a_real_serve(tmp_path: Path) -> None:
    """Zones, ids and domains as typed (a U-label, an accent, a space, a slash) reach the
    API as one path segment each; with --json a refusal is the API's JSON on stdout; a
    table stays aligned around wide and combining characters."""
    message = tmp_path / "msg.eml"
    message.write_bytes(b"From: a@src.test\r\nSubject: wide\r\n\r\nx\r\n")
    wide = "\u674e@\u4f8b\u5b50.\u6d4b\u8bd5"  # 12 columns in 7 code points
    with ok_test_bed(tmp_path) as (_, config), running_serve(config, tmp_path / "serve.log"):
        ok(config, "queue", "pause", "default")
        rcpts = (wide, "e\u0301@ok.test", "bob@b\u00fccher.example")
        queued = ok(config, "send", str(message), *(a for r in rcpts for a in ("--to", r)))
        assert ok(config, "queue", "retry", "--domain", "b\u00fccher.example") == {"count": 0}

        for zone in ("d\u00e9fault", "no such zone"):
            done = zoneq(config, "queue", "browse", zone, "--json")
            assert done.returncode == 1 and "Traceback" not in done.stderr, done.stderr
            # The server decoded the name as typed: it says so in its own JSON body.
            assert json.loads(done.stdout) == {
                "error": {"status": 404, "message": f"no zone {zone!r}"}
            }
            assert done.stderr == f"zoneq: no zone {zone!r} (404)\n"
        # A slash in an id stays in the id: it cannot reach the zone's endpoint.
        sneaky = zoneq(config, "queue", "hold", "../zones/default", "--json")
        assert sneaky.returncode == 1 and json.loads(sneaky.stdout)["error"]["status"] in (400, 404)
        assert ok(config, "queue", "counts")["zones"]["default"]["held"] == 0

        # Every row's "ready" column starts at the same terminal column.
        browsed = zoneq(config, "queue", "browse", "default")
        assert browsed.returncode == 0, browsed.stderr
        lines = browsed.stdout.splitlines()
        starts = {wcwidth.width(line[: line.index("  ready")]) for line in lines[1:]}
        assert len(lines) == 4 and len(starts) == 1, browsed.stdout
        assert wcwidth.width(lines[0][: lines[0].index("state")]) == starts.pop() + 2
        assert ok(config, "queue", "delete", queued["id"]) == {"count": 3}
