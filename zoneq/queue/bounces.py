"""Turning failed recipients into the DSN the envelope sender gets (RFC 3464).

One notice per message and report, listing every recipient that failed (or, for delay
notices, was delayed) in it, queued in the bounce zone with the null reverse-path (RFC 5321
section 4.5.5), so it can never itself be bounced.  No notice goes to ``<>`` or for
NOTIFY=NEVER (``should_send_dsn``).  The original comes back whole only when the sender
asked for RET=FULL and it is small; otherwise its header section alone (RFC 3461 section
4.3 lets the MTA choose).  The notice is queued with the BODY=8BITMIME and SMTPUTF8 flags
its content needs (``transport_needs``).

Known limit: "per report" is per job, that is per message *and destination domain*.  A
message whose recipients at three domains all fail gets three notices, one per domain's
job, where Postfix sends one per queue file.  Merging them would mean holding failures
back until every other job of the message has reported; zoneq does not.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final

from zoneq.protocol.dsn import (
    Action,
    DsnRequest,
    ReportedRecipient,
    Ret,
    build_dsn,
    transport_needs,
)
from zoneq.protocol.dsn import should_send_dsn as _should_send
from zoneq.protocol.ids import format_id, id_time_ms
from zoneq.storage.records import MessageMeta, NewRecipient, Notice, Recipient

# Originals up to this size are returned whole for RET=FULL; larger ones as headers only.
FULL_RETURN_LIMIT: Final = 256 * 1024
# The header section is looked for within this many bytes of the body's start.
HEADER_LIMIT: Final = 256 * 1024


@dataclass(frozen=True, slots=True)
class Failure:
    """One recipient that failed (or expired), and what the remote end said."""

    recipient: Recipient
    status: str  # RFC 3463 enhanced status, e.g. "5.1.1"
    diagnostic: str | None  # the remote reply, one line, e.g. "550 5.1.1 no such user"
    remote_mta: str | None
    action: Action = Action.FAILED
    will_retry_until_ms: int | None = None  # for Action.DELAYED (RFC 3464 section 2.3.9)


def default_bounce_from(reporting_mta: str) -> str:
    """The notice's From when ``[server] bounce_from`` is unset, as Postfix and sendmail
    sign theirs."""
    return f"MAILER-DAEMON@{reporting_mta}"


def wants_notice(meta: MessageMeta, failure: Failure) -> bool:
    if meta.is_bounce:
        return False
    return _should_send(meta.sender, failure.recipient.notify or None, failure.action)


def any_wanted(meta: MessageMeta, failures: Sequence[Failure]) -> bool:
    """Whether any of ``failures`` owes the sender a notice: if not, the original need not
    be read at all."""
    return any(wants_notice(meta, f) for f in failures)


def header_section(start: bytes) -> bytes:
    """The header section at the start of a body (up to the empty line)."""
    for end in (b"\r\n\r\n", b"\n\n"):
        at = start.find(end)
        if at >= 0:
            return start[: at + len(end)]
    return start[:HEADER_LIMIT]


def compose(
    meta: MessageMeta,
    failures: Sequence[Failure],
    *,
    original_start: bytes,
    original_full: bytes | None,
    reporting_mta: str,
    bounce_zone: str,
    now_ms: int,
    bounce_from: str | None = None,
) -> Notice | None:
    """The notice for ``failures`` of ``meta``'s message, or None if nobody should get one.

    ``original_start`` is the beginning of the stored message (enough for its headers);
    ``original_full`` the whole stored message, header section included, when it is small
    enough to return, else None.  ``bounce_from`` is the notice's From address
    (``[server] bounce_from``); None gives ``MAILER-DAEMON@<reporting_mta>``.
    """
    wanted = [f for f in failures if wants_notice(meta, f)]
    if not wanted:
        return None
    now = datetime.fromtimestamp(now_ms / 1000, UTC)
    ret = Ret.FULL if (meta.ret or "").upper() == "FULL" else Ret.HDRS
    if ret is Ret.FULL and original_full is not None:
        # The stored message is header section and body in one; the DSN takes them apart
        # (it writes headers, the empty line, then the body).
        headers = header_section(original_full)
        body: bytes | None = original_full[len(headers) :]
    else:
        headers, body = header_section(original_start), None
    request = DsnRequest(
        reporting_mta=reporting_mta,
        envelope_sender=meta.sender,
        ret=ret,
        arrival_date=datetime.fromtimestamp(id_time_ms(meta.msg_id) / 1000, UTC),
        recipients=tuple(
            ReportedRecipient(
                final_recipient=f.recipient.address,
                action=f.action,
                status=f.status,
                original_recipient=f.recipient.orcpt,
                diagnostic=f.diagnostic,
                remote_mta=f.remote_mta,
                last_attempt=now,
                will_retry_until=(
                    datetime.fromtimestamp(f.will_retry_until_ms / 1000, UTC)
                    if f.will_retry_until_ms is not None
                    else None
                ),
            )
            for f in wanted
        ),
        original_headers=headers,
        original_body=body,
        postmaster_from=bounce_from or default_bounce_from(reporting_mta),
        message_id=f"<{format_id(meta.msg_id)}.{now_ms}.dsn@{reporting_mta}>",
        date=now,
        envelope_id=meta.envid,
    )
    notice = build_dsn(request)
    needs = transport_needs(request, notice)
    notice_meta = MessageMeta(
        msg_id=0,
        sender="",  # the null reverse-path: a DSN is never bounced (RFC 5321 4.5.5)
        size=len(notice),
        chunks=0,
        received_ms=now_ms,
        smtputf8=needs.smtputf8,
        body_8bit=needs.body_8bit,
        headers={"Subject": "delivery status notification"},
        source={"protocol": "dsn", "original": format_id(meta.msg_id)},
        is_bounce=True,
    )
    return Notice(notice_meta, (NewRecipient(meta.sender, bounce_zone),), notice)
