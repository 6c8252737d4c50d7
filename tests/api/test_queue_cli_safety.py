"""``zoneq queue`` and ``zoneq send`` never do more, or destroy more, than the operator
asked: ``source -o FILE`` leaves FILE alone unless the whole message came (or, when FILE
must be written in place to stay the same file, says that it holds only part), and never
writes what ``> FILE`` could not; an empty filter is refused, not read as "no filter";
``send`` reads standard input and pipes, and says when it is closed.

The command is run as a process, against listeners of the test's own on 127.0.0.1 (a
closed port, a canned HTTP answer) or the real API over a real store (``api_running``).
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.api.conftest import TOKEN, Api, api_running, async_test, make_config
from tests.api.test_cli_input import closed_port, not_http
from tests.storage.conftest import T0, queue_message
from tests.support.command import zoneq
from tests.support.serve import ROOT
from zoneq.protocol.ids import format_id
from zoneq.storage.base import Outcome
from zoneq.storage.store import QueueStore

MSG = "0018bcfe56800000"
SOURCE = b"From: a@src.test\r\nTo: b@ok.test\r\nSubject: kept\r\n\r\nHello.\r\n"
SAVED = b"my saved copy\n"


def _answer(status: str, body: bytes, kind: str = "application/json") -> bytes:
    head = f"HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {len(body)}\r\n\r\n"
    return head.encode() + body


NOT_FOUND = _answer("404 Not Found", b'{"error": {"status": 404, "message": "no message"}}')
SOURCE_OK = _answer("200 OK", SOURCE, "message/rfc822")


def source_to(target: Path | str, port: int) -> tuple[int, str]:
    done = zoneq(
        "queue", "source", MSG, "-o", str(target), "--api", f"127.0.0.1:{port}", "--token", "t"
    )
    assert "Traceback" not in done.stderr, done.stderr
    return done.returncode, done.stderr


# --- source -o FILE ----------------------------------------------------------------------


@pytest.mark.parametrize("refused", ["not found", "no answer"])
def test_a_failed_source_leaves_the_file_and_a_fifo_as_they_were(
    tmp_path: Path, refused: str
) -> None:
    saved = tmp_path / "keep.eml"
    saved.write_bytes(SAVED)
    fifo = tmp_path / "fifo"  # stands for /dev/null: a node the command did not create
    os.mkfifo(fifo)
    for target in (saved, fifo):
        if refused == "not found":
            with not_http(NOT_FOUND) as port:
                code, said = source_to(target, port)
        else:
            code, said = source_to(target, closed_port())
        assert code == 1, said
        assert target.exists()
    assert saved.read_bytes() == SAVED
    assert sorted(p.name for p in tmp_path.iterdir()) == ["fifo", "keep.eml"]  # no .part


def test_a_whole_source_replaces_the_file_keeping_its_mode(tmp_path: Path) -> None:
    saved = tmp_path / "keep.eml"
    saved.write_bytes(SAVED)
    saved.chmod(0o640)
    with not_http(SOURCE_OK) as port:
        assert source_to(saved, port) == (0, "")
    assert saved.read_bytes() == SOURCE
    assert saved.stat().st_mode & 0o777 == 0o640
    assert [p.name for p in tmp_path.iterdir()] == ["keep.eml"]


@pytest.mark.parametrize(
    ("where", "said"),
    [("dir", "is a directory"), ("missing/x.eml", "No such file or directory")],
)
def test_a_path_that_cannot_be_written_is_a_usage_error_naming_it(
    tmp_path: Path, where: str, said: str
) -> None:
    (tmp_path / "dir").mkdir()
    target = tmp_path / where
    with not_http(SOURCE_OK) as port:
        code, stderr = source_to(target, port)
    assert code == 2
    assert stderr == f"zoneq: cannot write {target}: {said}\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dir"]
    assert list((tmp_path / "dir").iterdir()) == []


NOBODY = 65534  # another user's uid and gid (``nobody``, ``nogroup``)
# Root as a user is, with no power over others' files and folders: permission bits apply.
AS_A_USER = (
    "setpriv", "--inh-caps=-all", "--bounding-set=-dac_override,-dac_read_search,-fowner"
)  # fmt: skip
as_root = pytest.mark.skipif(
    os.geteuid() != 0 or shutil.which("setpriv") is None,
    reason="changes owners, and drops root's powers with setpriv",
)


@as_root
@pytest.mark.parametrize("case", ["another user's", "hard-linked"])
def test_a_file_a_rename_would_change_is_written_in_place(tmp_path: Path, case: str) -> None:
    """Renamed over, the file would become root's or lose its other name: written in
    place it stays the same file, as ``> FILE`` leaves it."""
    saved = tmp_path / "keep.eml"
    saved.write_bytes(SAVED)
    if case == "another user's":
        os.chown(saved, NOBODY, NOBODY)
    else:
        os.link(saved, tmp_path / "other-name.eml")
    before = saved.stat()
    with not_http(SOURCE_OK) as port:
        assert source_to(saved, port) == (0, "")
    after = saved.stat()
    assert saved.read_bytes() == SOURCE
    kept = ("st_ino", "st_uid", "st_gid", "st_nlink", "st_mode")
    assert [getattr(after, k) for k in kept] == [getattr(before, k) for k in kept]
    if case == "hard-linked":
        assert (tmp_path / "other-name.eml").read_bytes() == SOURCE


def source_as_a_user(target: Path, port: int) -> subprocess.CompletedProcess[str]:
    command = [*AS_A_USER, sys.executable, "-m", "zoneq", "queue", "source", MSG]
    options = ["-o", str(target), "--api", f"127.0.0.1:{port}", "--token", "t"]
    return subprocess.run(
        command + options, cwd=ROOT, capture_output=True, text=True, timeout=120, check=False
    )


@as_root
def test_a_writable_file_in_a_read_only_folder_is_written(tmp_path: Path) -> None:
    folder = tmp_path / "ro"
    folder.mkdir()
    saved = folder / "keep.eml"
    saved.write_bytes(SAVED)
    saved.chmod(0o666)
    os.chown(folder, NOBODY, NOBODY)
    folder.chmod(0o555)
    with not_http(SOURCE_OK) as port:
        done = source_as_a_user(saved, port)
    assert (done.returncode, done.stderr) == (0, "")
    assert saved.read_bytes() == SOURCE
    assert [p.name for p in folder.iterdir()] == ["keep.eml"]


@as_root
@pytest.mark.parametrize("owner", [NOBODY, 0])
def test_a_file_the_user_may_not_write_is_refused_and_kept(tmp_path: Path, owner: int) -> None:
    """0444, another's or our own: refused as ``> FILE`` is, not renamed over."""
    saved = tmp_path / "keep.eml"
    saved.write_bytes(SAVED)
    os.chown(saved, owner, owner)
    saved.chmod(0o444)
    with not_http(SOURCE_OK) as port:
        done = source_as_a_user(saved, port)
    assert (done.returncode, done.stderr) == (
        2,
        f"zoneq: cannot write {saved}: Permission denied\n",
    )
    assert saved.read_bytes() == SAVED
    assert saved.stat().st_uid == owner and saved.stat().st_mode & 0o777 == 0o444


def test_a_download_cut_short_in_place_says_the_file_is_partial(tmp_path: Path) -> None:
    saved = tmp_path / "keep.eml"
    saved.write_bytes(SAVED)
    os.link(saved, tmp_path / "other-name.eml")  # written in place, not renamed over
    with not_http(SOURCE_OK[:-10]) as port:  # Content-Length promises 10 octets more
        code, said = source_to(saved, port)
    assert code == 1
    assert said.startswith("zoneq: the download broke off")
    assert said.endswith(f"; {saved} holds only part of the message (0)\n"), said
    assert saved.read_bytes() == SOURCE[:-10]  # left as it is, not removed
    assert sorted(p.name for p in tmp_path.iterdir()) == ["keep.eml", "other-name.eml"]


# --- empty filters -----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("delete", MSG, "--recipient", ""), "--recipient: must not be empty"),
        (("delete", MSG, "--recipient", " "), "--recipient: must not be empty"),
        (("browse", "default", "--cursor", ""), "--cursor: must not be empty"),
        (("purge", "--zone", ""), "--zone: must not be empty"),
        (("purge", "--sender-domain", ""), "--sender-domain: must not be empty"),
        (("purge", "--recipient-domain", "", "--all"), "--recipient-domain: must not be"),
        (("purge", "--older-than", ""), "--older-than: must not be empty"),
        (("retry", "--domain", "ok.test", "--zone", ""), "--zone: must not be empty"),
        (("hold", "", "--zone", "default"), "give a message id or --zone, one of them"),
        (("release", "--zone", ""), "--zone: must not be empty"),
        (("hold", MSG, "--reason", ""), "--reason: must not be empty"),
        (("hold", "--zone", "default", "--reason", "  "), "--reason: must not be empty"),
    ],
)
def test_an_empty_filter_is_refused_before_anything_is_sent(
    args: tuple[str, ...], said: str
) -> None:
    """Sent, "" would read as "left out" and widen the operation: a recipient's delete to
    the whole message, a zone's hold to... the zone an empty id stood beside."""
    port = closed_port()  # anything sent would say so: exit 1, "cannot reach"
    done = zoneq("queue", *args, "--api", f"127.0.0.1:{port}", "--token", "t", "--json")
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert said in done.stderr and done.stdout == ""


# --- against the real API ----------------------------------------------------------------


@dataclass
class Done:
    code: int
    out: str
    err: str


async def cli(api: Api, *args: str, stdin: bytes = b"") -> Done:
    """``zoneq ARGS`` against ``api``, as a process (the API serves meanwhile)."""
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "zoneq", *args,
        "--api", api.base.removeprefix("http://"), "--token", TOKEN,
        cwd=ROOT, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(stdin), timeout=60)
    assert process.returncode is not None
    return Done(process.returncode, out.decode(), err.decode())


@async_test
async def test_send_reads_stdin_and_pipes_within_the_size_limit(
    store: QueueStore, tmp_path: Path
) -> None:
    async with api_running(store, make_config(max_size="4KiB")) as api:
        for name in ("-", "/dev/stdin"):
            done = await cli(api, "send", name, "--to", "b@ok.test", "--json", stdin=SOURCE)
            assert done.code == 0, done.err
            msg_id = json.loads(done.out)["id"]
            shown = await cli(api, "queue", "source", msg_id)
            assert shown.out.encode().endswith(b"Subject: kept\r\n\r\nHello.\r\n")
        # A pipe has no length to refuse on: the API counts as it reads, and refuses.
        big = SOURCE + (b"x" * 76 + b"\r\n") * 100  # 7.8 kB
        done = await cli(api, "send", "-", "--to", "b@ok.test", stdin=big)
        assert done.code == 1 and "over" in done.err, done.err
        done = await cli(api, "send", str(tmp_path), "--to", "b@ok.test")
        assert (done.code, done.err) == (
            2,
            f"zoneq: {tmp_path}: is a directory, not a message file\n",
        )
        done = await cli(api, "send", str(tmp_path / "nope.eml"))
        assert (done.code, done.err) == (2, f"zoneq: no such file: {tmp_path / 'nope.eml'}\n")


def test_send_with_standard_input_closed_is_a_usage_error() -> None:
    """Started with descriptor 0 closed (``zoneq send - <&-``), Python has no sys.stdin."""
    api = ("--api", f"127.0.0.1:{closed_port()}", "--token", "t")
    done = subprocess.run(
        [sys.executable, "-m", "zoneq", "send", "-", "--to", "b@ok.test", *api],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        preexec_fn=lambda: os.close(0),
    )
    assert (done.returncode, done.stderr) == (2, "zoneq: -: standard input is closed\n")


@async_test
async def test_release_of_a_message_on_the_wire_is_no_conflict(store: QueueStore) -> None:
    """Held while on the wire, a message has nothing held yet: its release cancels the
    hold its attempt would take, and says so, as its hold said it would be taken."""
    msg_id = await queue_message(store, [("a@ok.test", "default")])
    (lease,) = store.lease("default", 1, "worker")
    mid = format_id(msg_id)
    async with api_running(store) as api:
        held = await cli(api, "queue", "hold", mid)
        assert (held.code, held.out) == (
            0,
            "held 0 recipient(s); 1 on the wire, held when their attempt ends undelivered\n",
        )
        released = await cli(api, "queue", "release", mid, "--json")
        assert released.code == 0, released.err
        assert json.loads(released.out) == {"count": 0, "on_return": 1}
        again = await cli(api, "queue", "release", mid)
        assert again.code == 1 and "has no held recipients (409)" in again.err
        status, body = await api.call("POST", f"/api/v1/messages/{mid}/hold", json={"reason": " "})
        assert status == 400 and "reason: must not be empty" in body["error"]["message"]
    # The release took: the attempt defers, and the recipient is not held.
    await store.defer(lease, T0, T0 + 60_000, Outcome(reply="451 4.3.0 try later"))
    assert {q.state.value for q in store.recipients(msg_id)} == {"deferred"}


@async_test
async def test_a_held_row_shows_why_it_is_held(store: QueueStore) -> None:
    msg_id = await queue_message(store, [("a@ok.test", "default")])
    (lease,) = store.lease("default", 1, "worker")
    await store.defer(lease, T0, T0 + 60_000, Outcome(reply="451 4.3.0 greylisted"))
    async with api_running(store) as api:
        held = await cli(api, "queue", "hold", format_id(msg_id), "--reason", "complaint #7")
        assert held.code == 0, held.err
        table = await cli(api, "queue", "browse", "default", "--state", "held")
        assert table.code == 0, table.err
        row = table.out.splitlines()[1]
        assert row.endswith("complaint #7") and "greylisted" not in row


# --- the API's address -------------------------------------------------------------------


def test_a_url_for_the_api_says_to_give_host_port() -> None:
    env = {**os.environ, "ZONEQ_API": "http://127.0.0.1:44080"}
    done = zoneq("queue", "counts", "--token", "t", env=env)
    assert done.returncode == 2
    assert "give host:port, not a URL" in done.stderr and "IPv6" not in done.stderr


def test_an_ipv6_api_address_is_named_in_brackets() -> None:
    done = zoneq("queue", "counts", "--api", f"[::1]:{closed_port()}", "--token", "t")
    assert done.returncode == 1
    assert "cannot reach the API at [::1]:" in done.stderr, done.stderr
