"""``zoneq suppression ...`` as a subprocess against the API served in the test's own event
loop (a real aiohttp server on 127.0.0.1): what people and scripts see, and the exit
statuses (0 done, 1 the API refused, 2 bad usage)."""

from __future__ import annotations

import asyncio
import json
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.api.conftest import TOKEN, Api, api_running, async_test, make_config
from tests.api.test_suppression import empty_list, suppression_config
from tests.support.serve import ROOT
from zoneq.storage.store import QueueStore

pytestmark = pytest.mark.integration


@pytest.fixture
def listed(tmp_path: Path) -> Path:
    return empty_list(tmp_path)


@dataclass
class Done:
    code: int
    out: str
    err: str


async def cli(api: Api, *args: str, stdin: str = "") -> Done:
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "zoneq", "suppression", *args,
        "--api", api.base.removeprefix("http://"), "--token", TOKEN,
        cwd=ROOT, stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await asyncio.wait_for(process.communicate(stdin.encode()), timeout=60)
    assert process.returncode is not None
    return Done(process.returncode, out.decode(), err.decode())


@async_test
async def test_add_from_a_file_and_stdin_then_list_by_pages(
    store: QueueStore, listed: Path, tmp_path: Path
) -> None:
    addresses = tmp_path / "addresses.txt"
    addresses.write_text("# unsubscribed in May\nA@x.test\n\n  b@x.test  \nc@x.test\n")
    async with api_running(store, suppression_config(listed)) as api:
        done = await cli(api, "add", "bulk", "d@x.test", "--file", str(addresses))
        assert (done.code, done.out) == (0, "added 4 address(es) to bulk (4 listed)\n")
        done = await cli(api, "add", "bulk", "--file", "-", "--json", stdin="e@x.test\na@x.test\n")
        assert json.loads(done.out) == {"zone": "bulk", "added": 1, "total": 5}

        page = await cli(api, "list", "bulk", "--limit", "2")
        assert page.out.splitlines() == [
            "a@x.test",
            "b@x.test",
            "2 of 5 address(es) in bulk",
            "more: --cursor b@x.test (or --all)",
        ]
        rest = await cli(api, "list", "bulk", "--limit", "2", "--cursor", "b@x.test", "--all")
        assert rest.out.splitlines()[:3] == ["c@x.test", "d@x.test", "e@x.test"]
        whole = json.loads((await cli(api, "list", "bulk", "--limit", "2", "--all", "--json")).out)
        assert whole["addresses"] == [f"{c}@x.test" for c in "abcde"]
        assert whole["cursor"] is None


@async_test
async def test_refusals_and_usage_errors_exit_non_zero(store: QueueStore, listed: Path) -> None:
    async with api_running(store, suppression_config(listed)) as api:
        bad = await cli(api, "add", "bulk", "good@x.test", "not-an-address")
        assert bad.code == 1 and "expected local-part@domain (400)" in bad.err
        nothing = await cli(api, "check", "bulk")
        assert nothing.code == 2 and "give at least one address" in nothing.err
        unreadable = await cli(api, "add", "bulk", "--file", str(listed.parent / "nope"))
        assert unreadable.code == 2 and "cannot read" in unreadable.err
    assert json.loads(listed.read_text()) == {}
    async with api_running(store, make_config()) as api:
        disabled = await cli(api, "list", "*")
        assert disabled.code == 1 and "suppression plugin is not enabled" in disabled.err
