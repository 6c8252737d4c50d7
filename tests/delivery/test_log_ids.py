"""Message ids in log lines are written as people pass them back to ``zoneq queue``:
``format_id``'s 16 hex digits, and only the messages a line is about."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from zoneq.delivery.worker import _refused_messages
from zoneq.ipc.messages import Job, JobRecipient
from zoneq.protocol.ids import format_id, parse_id

PACKAGE = Path(__file__).resolve().parents[2] / "zoneq"
A, B, C = 0x18BCFE56800001, 0x18BCFE56800002, 0x18BCFE56800003  # 14 digits in "%x"


def _job(msg_id: int, *tokens: int) -> Job:
    recipients = tuple(JobRecipient(token=t, address=f"r{t}@ok.test") for t in tokens)
    return Job(msg_id=msg_id, sender="", size=1, chunks=1, domain="ok.test", recipients=recipients)


JOBS = (_job(A, 1, 2), _job(B, 3), _job(C, 4, 5))


@pytest.mark.parametrize(
    ("refused", "named"),
    [
        ((3,), [B]),  # one stale report: its message only, not the batch's three
        ((2,), [A]),
        ((5, 1), [A, C]),  # in id order, whatever order the core gave
        ((1, 2), [A]),  # a message once, however many of its reports
        ((1, 3, 4), [A, B, C]),
    ],
)
def test_the_refused_line_names_the_refused_reports_messages(
    refused: tuple[int, ...], named: list[int]
) -> None:
    text = _refused_messages(JOBS, refused)
    assert text == ", ".join(map(format_id, named))
    assert [parse_id(part) for part in text.split(", ")] == named  # `queue show` takes them


def test_no_log_line_writes_an_id_in_bare_hex() -> None:
    """``%x`` drops the leading zeros (14 digits for today's ids), which ``parse_id`` and so
    ``zoneq queue show`` refuse; format_id is the one spelling."""
    bare = re.compile(r"%x|:x\}")
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{number}: {line.strip()}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if bare.search(line)
    ]
    assert found == []
