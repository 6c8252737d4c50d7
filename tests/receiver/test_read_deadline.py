"""The per-request read deadline's lazy timer, and the Received field's remembered pieces.

The session arms one timer for the deadline and lets it fire early and re-arm (instead of
a timer per read): a session that answers in time for longer than the idle timeout must
never be cut off, and an idle one must be, within the timeout.  Real receiver, real
queue, a raw client on 127.0.0.1.
"""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from email.utils import format_datetime
from pathlib import Path

from hypothesis import given
from hypothesis import strategies as st

from tests.receiver.harness import Raw, run
from zoneq.receiver import SmtpReceiver
from zoneq.receiver.message import received_header
from zoneq.storage.store import QueueStore


def test_a_busy_session_outlives_the_idle_timeout_then_idles_out(tmp_path: Path) -> None:
    """NOOPs 0.3 s apart for 2.5 s (past the 1 s timeout several times over: the timer
    fires early and re-arms), then nothing: 421 4.4.2 about 1 s later."""

    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        raw = await Raw.connect(rx.port)
        assert (await raw.reply()).startswith("220 ")
        loop = asyncio.get_running_loop()
        started = loop.time()
        answered = started
        while loop.time() - started < 2.5:
            assert (await raw.cmd("NOOP")).startswith("250 "), "cut off while active"
            answered = loop.time()  # the next request's deadline runs from here
            await asyncio.sleep(0.3)
        assert (await raw.reply()).startswith("421 4.4.2")
        waited = loop.time() - answered
        assert 0.7 < waited < 3.0, waited
        assert await raw.reply() == ""
        await raw.close()

    run(tmp_path, body, idle_timeout="1s")


def test_a_session_closed_by_the_client_leaves_no_timer_behind(tmp_path: Path) -> None:
    """The session's timer is cancelled when it ends: nothing of it is left scheduled for
    the (long) idle timeout, holding the session."""

    async def body(rx: SmtpReceiver, store: QueueStore) -> None:
        loop = asyncio.get_running_loop()
        for _ in range(20):
            raw = await Raw.connect(rx.port)
            assert (await raw.reply()).startswith("220 ")
            assert (await raw.cmd("QUIT")).startswith("221 ")
            await raw.close()
        for _ in range(100):
            if not rx._sessions:
                break
            await asyncio.sleep(0.01)
        far = loop.time() + 60
        scheduled = [h for h in loop._scheduled if h.when() > far and not h.cancelled()]  # type: ignore[attr-defined]
        assert scheduled == []

    run(tmp_path, body, idle_timeout="5m")


TRACE = {
    "helo": "c.test",
    "client_ip": "192.0.2.1",
    "hostname": "mx.zoneq.test",
    "protocol": "ESMTP",
    "msg_id": "0123456789abcdef",
}


@given(st.integers(min_value=0, max_value=4_102_444_800_000), st.integers(0, 2_000))
def test_received_date_is_the_time_given_across_calls(now_ms: int, step_ms: int) -> None:
    """The date-time words are remembered per second: two calls around a second's edge
    each get their own second (RFC 5322 section 3.3 date-time)."""
    for when in (now_ms, now_ms + step_ms):
        field = received_header(**TRACE, recipient=None, now_ms=when).decode()
        expected = format_datetime(datetime.fromtimestamp(when / 1000, tz=UTC))
        assert " ".join(field.split()).endswith("; " + expected)
