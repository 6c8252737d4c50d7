"""A JSON submission's bounds: at most ``receiver.max_recipients`` addresses, header field
values of at most ``HEADER_FIELD_MAX`` octets, refused (named) before anything is built; the
build off the event loop, and at most ``JSON_BUILDS`` of them at once."""

from __future__ import annotations

import asyncio
import re
import threading
import time
from collections.abc import Callable
from email import message_from_bytes, policy
from email.headerregistry import HeaderRegistry
from email.utils import getaddresses
from typing import Any
from urllib.parse import urlsplit

import pytest

from tests.api.conftest import CONFIG, TOKEN, Api, api_running, async_test
from tests.api.test_submit import nothing_stored
from zoneq.api import submit
from zoneq.api.mime import HEADER_FIELD_MAX, _entries, build, check_bounds
from zoneq.api.models import Submission
from zoneq.config import Config, loads_config
from zoneq.queue.intake import Unacceptable
from zoneq.storage.store import QueueStore

pytestmark = pytest.mark.integration

BASE: dict[str, Any] = {"from": "a@src.test", "subject": "hello", "text": "body\n"}
CAP = HEADER_FIELD_MAX


def config_with(max_recipients: int) -> Config:
    text = CONFIG.format(token=TOKEN, max_size="50MiB")
    return loads_config(
        text.replace("[receiver]\n", f"[receiver]\nmax_recipients = {max_recipients}\n")
    )


def addresses(n: int, key: str = "r") -> list[str]:
    return [f"{key}{i}@d{i % 10}.test" for i in range(n)]


@pytest.mark.parametrize(
    ("fields", "needle"),
    [
        ({"to": addresses(3)}, None),
        ({"to": addresses(1), "cc": addresses(1, "c"), "bcc": addresses(1, "b")}, None),
        ({"to": addresses(4)}, "4 addresses in all, more than receiver.max_recipients (3)"),
        (
            {"to": addresses(2), "cc": addresses(1, "c"), "bcc": addresses(1, "b")},
            "to, cc and bcc: 4 addresses",
        ),
        ({"to": addresses(1), "subject": "x" * CAP}, None),
        ({"to": addresses(1), "subject": "x" * (CAP + 1)}, "subject: longer than 102400"),
        # Octets, not characters (UTF-8: two each).
        ({"to": addresses(1), "subject": "é" * (CAP // 2)}, None),
        ({"to": addresses(1), "subject": "é" * (CAP // 2) + "x"}, "subject: longer"),
        ({"to": addresses(1), "headers": {"X-Long": "y" * (CAP + 1)}}, "headers.X-Long: longer"),
        ({"to": [*addresses(1), f'"{"n" * CAP}" <a@b.test>']}, "to[1]: longer"),
        ({"to": addresses(1), "bcc": [f"{'n' * CAP} <a@b.test>"]}, "bcc[0]: longer"),
        ({"to": addresses(1), "reply_to": [f"{'n' * CAP} <a@b.test>"]}, "reply_to[0]: longer"),
        ({"to": addresses(1), "from": f"{'n' * CAP} <a@b.test>"}, "from: longer"),
    ],
)
def test_bounds_are_checked_and_named(fields: dict[str, Any], needle: str | None) -> None:
    submission = Submission.model_validate({**BASE, **fields})
    if needle is None:
        check_bounds(submission, max_recipients=3)
        return
    with pytest.raises(Unacceptable, match=re.escape(needle)):
        check_bounds(submission, max_recipients=3)


async def post(api: Api, fields: dict[str, Any]) -> tuple[int, Any]:
    return await api.call("POST", "/api/v1/messages", json={**BASE, **fields})


@async_test
async def test_the_api_takes_max_recipients_and_refuses_one_more(store: QueueStore) -> None:
    async with api_running(store, config_with(3)) as api:
        status, body = await post(api, {"to": addresses(4)})
        assert status == 400, body
        assert "receiver.max_recipients (3)" in body["error"]["message"]
        status, body = await post(api, {"to": [f"{'w ' * CAP}<a@b.test>"]})
        assert status == 400, body
        assert body["error"]["message"].startswith("to[0]: longer than 102400 octets")
        await store.drain()
        assert nothing_stored(store)
        status, body = await post(api, {"to": addresses(2), "bcc": addresses(1, "b")})
        assert status == 201, body
        assert len(body["recipients"]) == 3


class Builds:
    """A hook around ``submit.build``: how many run at once, at most."""

    def __init__(self, build: Callable[..., Any], hold_s: float) -> None:
        self._build = build
        self._hold_s = hold_s
        self._lock = threading.Lock()
        self.now = 0
        self.most = 0

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        with self._lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            time.sleep(self._hold_s)  # long enough for every request to have arrived
            return self._build(*args, **kwargs)
        finally:
            with self._lock:
                self.now -= 1


@async_test
async def test_at_most_json_builds_build_at_once(
    store: QueueStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    builds = Builds(submit.build, hold_s=0.3)
    monkeypatch.setattr(submit, "build", builds)
    async with api_running(store) as api:
        many = submit.JSON_BUILDS + 1
        answers = await asyncio.gather(*(post(api, {"to": addresses(1)}) for _ in range(many)))
    assert [status for status, _ in answers] == [201] * many, answers
    assert builds.most == submit.JSON_BUILDS


@async_test
async def test_a_submission_that_waits_too_long_is_503_with_retry_after(
    store: QueueStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(submit, "build", Builds(submit.build, hold_s=1.0))
    monkeypatch.setattr(submit, "JSON_WAIT_S", 0.2)
    async with api_running(store) as api:
        many = submit.JSON_BUILDS + 1
        answers = await asyncio.gather(*(post(api, {"to": addresses(1)}) for _ in range(many)))
        statuses = sorted(status for status, _ in answers)
        assert statuses == [201] * submit.JSON_BUILDS + [503], answers
        refused = next(body for status, body in answers if status == 503)
        assert "busy building other JSON submissions" in refused["error"]["message"]
        assert store.message_count() == submit.JSON_BUILDS


@async_test
async def test_the_loop_runs_while_a_slow_build_does(
    store: QueueStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """3,000 addresses take the build a good part of a second: the loop ticks meanwhile
    (the build in a thread), where before it did not tick at all."""
    ticks = 0
    during: list[int] = []
    real = submit.build

    def counted(*args: Any, **kwargs: Any) -> Any:
        before = ticks
        try:
            return real(*args, **kwargs)
        finally:
            during.append(ticks - before)

    async def ticker(done: asyncio.Event) -> None:
        nonlocal ticks
        for _ in range(1_000_000):  # bounded; ends with the request
            if done.is_set():
                return
            ticks += 1
            await asyncio.sleep(0.001)

    monkeypatch.setattr(submit, "build", counted)
    async with api_running(store, config_with(3000)) as api:
        done = asyncio.Event()
        ticking = asyncio.create_task(ticker(done))
        status, body = await post(api, {"to": addresses(3000)})
        done.set()
        await ticking
    assert status == 201, body
    assert len(during) == 1
    assert during[0] > 10


@pytest.mark.parametrize(
    ("text", "entries"),
    [
        ("a@x, b@y", ["a@x", " b@y"]),
        ('"Doe, John" <j@x>, b@y', ['"Doe, John" <j@x>', " b@y"]),
        ('"a \\" , b" <j@x>', ['"a \\" , b" <j@x>']),
        ("a@x (c, (d, e) f), b@y", ["a@x (c, (d, e) f)", " b@y"]),
        ("<@r1,@r2:j@x>, b@y", ["<@r1,@r2:j@x>", " b@y"]),
        ("j@[1,2], b@y", ["j@[1,2]", " b@y"]),
        ("G: a@x, b@y;, c@z", ["G: a@x, b@y;", " c@z"]),
        # Written badly: what is left open runs to the end (fewer entries: misread).
        ("Doe, John <j@x>", ["Doe", " John <j@x>"]),
        ('"Doe, John <j@x>, b@y', ['"Doe, John <j@x>, b@y']),
        ("(Doe, John <j@x>, b@y", ["(Doe, John <j@x>, b@y"]),
        ("Doe: John <j@x>, b@y", ["Doe: John <j@x>, b@y"]),
    ],
)
def test_an_address_list_splits_at_the_commas_between_addresses(
    text: str, entries: list[str]
) -> None:
    assert _entries(text) == entries


def test_an_address_field_is_read_back_one_address_at_a_time(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The check that a folded field reads back as given parses each address alone: the
    package's parser takes time that grows with the square of what it is given."""
    parsed: list[int] = []
    real = HeaderRegistry.__call__

    def recorded(self: HeaderRegistry, name: str, value: Any) -> Any:
        if isinstance(value, str):
            parsed.append(len(value))
        return real(self, name, value)

    monkeypatch.setattr(HeaderRegistry, "__call__", recorded)
    named = f'"Doe, John {"x" * 80}" <john@example.com>'
    to = [*addresses(100), named, *addresses(100, "s")]
    data, _ = build(Submission.model_validate({**BASE, "to": to}), hostname="h", now_ms=0)
    assert parsed and max(parsed) <= len(named)
    read = message_from_bytes(data, policy=policy.default)["To"].addresses
    assert [(a.display_name, a.addr_spec) for a in read] == getaddresses(to)


# From a read-through: "=?" in one display name and "?=" in a later one are one encoded-word
# to the email package's reader, so the second address vanished from the To field.
SPANNING = [
    ['"=?utf-8?q?YbX www" <u1@d1.example>', '"Z ?= Doe" <u2@d2.example>'],
    ['"=?utf-8?q?" <u0@d0.example>', '"?=." <u1@d1.example>'],  # was an IndexError: 500
]


@pytest.mark.parametrize("to", SPANNING)
def test_an_opening_of_an_encoded_word_in_an_address_is_refused(to: list[str]) -> None:
    with pytest.raises(Unacceptable, match=r"to\[0\]: no encoded-word .* nor its opening"):
        build(Submission.model_validate({**BASE, "to": to}), hostname="mx.test", now_ms=0)


@async_test
async def test_a_body_sent_too_slowly_gives_its_permit_back(
    store: QueueStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Clients holding every permit with a body that never comes are cut off after
    JSON_READ_S (408); an ordinary submission then goes through."""
    monkeypatch.setattr(submit, "JSON_READ_S", 0.5, raising=False)
    monkeypatch.setattr(submit, "JSON_WAIT_S", 5.0)
    async with api_running(store) as api:
        where = urlsplit(api.base)
        slow = []
        for _ in range(submit.JSON_BUILDS):
            reader, writer = await asyncio.open_connection(where.hostname, where.port)
            writer.write(
                f"POST /api/v1/messages HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
                "Content-Type: application/json\r\nContent-Length: 1000\r\n\r\n{".encode()
            )
            await writer.drain()
            slow.append((reader, writer))
        await asyncio.sleep(0.1)  # both hold a permit, reading
        status, body = await post(api, {"to": addresses(1)})
        assert status == 201, body
        for reader, writer in slow:
            answer = await asyncio.wait_for(reader.read(200), 5)
            assert answer.startswith(b"HTTP/1.1 408"), answer
            writer.close()
