"""Request and response bodies of the API, as pydantic models.

They validate what comes in (unknown fields refused, so a misspelt ``bcc`` is an error, not
a silently public recipient) and give the OpenAPI document its schemas.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from zoneq.protocol.domains import bare_domain
from zoneq.storage.records import State


class _Body(BaseModel):
    model_config = ConfigDict(extra="forbid", populate_by_name=True)


class Attachment(_Body):
    filename: str = Field(min_length=1, max_length=255)
    content_type: str = "application/octet-stream"
    content: str = Field(description="the attachment's bytes, base64 (RFC 4648 section 4)")


class Submission(_Body):
    """A message built by zoneq from fields (RFC 5322 with MIME), queued for to+cc+bcc."""

    from_: str = Field(alias="from", description='"Name <addr@example.org>" or an address')
    to: list[str] = Field(default_factory=list)
    cc: list[str] = Field(default_factory=list)
    bcc: list[str] = Field(default_factory=list, description="envelope only, never a header")
    reply_to: list[str] = Field(default_factory=list)
    subject: str = ""
    text: str | None = None
    html: str | None = None
    headers: dict[str, str] = Field(default_factory=dict, description="extra header fields")
    attachments: list[Attachment] = Field(default_factory=list)
    envelope_from: str | None = Field(
        default=None, description='MAIL FROM if not the From address ("" for <>)'
    )


class RefusedRecipient(_Body):
    recipient: str
    code: int = Field(description="the SMTP reply code a queue:route plugin refused it with")
    reply: str = Field(description='the whole reply, e.g. "550 5.1.1 Recipient is on the ..."')


class Queued(_Body):
    id: str
    size: int
    recipients: list[str] = Field(description="those queued (none: every one was dropped)")
    zones: list[str]
    refused: list[RefusedRecipient] = Field(
        default_factory=list, description="recipients a plugin refused; the rest were queued"
    )


def not_empty(value: str | None) -> str | None:
    """A filter that is given must say something: an empty one matching nothing would be
    a surprise, and matching anything (as a missing one does) a destructive one."""
    if value is not None and not value.strip():
        raise ValueError("must not be empty: leave the field out to match any")
    return value


def domain_filter(value: str | None) -> str | None:
    """A domain to match, in the queue's normal form (lower-case A-labels, so a U-label
    and its A-label select the same recipients), no trailing dot (RFC 1035's root), not
    empty.  A name IDNA refuses is kept lower-cased, as the queue keeps such a name."""
    if value is None:
        return None
    domain = bare_domain(value.strip())
    if not domain:
        raise ValueError("must not be empty: leave the field out to match any")
    return domain


class Selection(_Body):
    """Which recipients a purge removes: every field given must match."""

    zone: str | None = None
    state: Literal[State.READY, State.DEFERRED, State.HELD] | None = None
    sender_domain: str | None = None
    recipient_domain: str | None = None
    older_than: str | None = Field(
        default=None,
        description='queued longer ago than this: "90" (s), "15m", "2h", "3d"; under an hour,'
        ' it is no filter on its own (it selects nearly everything): "all" is then required',
    )
    all: bool = Field(
        default=False,
        description="required to purge with no filter at all (or with only an age under an hour)",
    )

    _zone = field_validator("zone", "older_than")(not_empty)
    _domains = field_validator("sender_domain", "recipient_domain")(domain_filter)


class HoldRequest(_Body):
    reason: str = Field(
        default="held by administrator",
        max_length=200,
        description="one line of text: no control characters",
    )

    @field_validator("reason")
    @classmethod
    def _one_line(cls, value: str) -> str:
        # Shown in `zoneq queue browse`'s table and in the JSON of every recipient: a CR or
        # LF would break the table's rows (and an ESC could drive the operator's terminal).
        bad = next((c for c in value if ord(c) < 32 or ord(c) == 127), None)
        if bad is not None:
            raise ValueError(f"control character {bad!r} not allowed")
        return value


class Count(_Body):
    count: int


class HoldCount(_Body):
    """A message's hold: held now, and on the wire to be held when their attempt ends."""

    count: int = Field(description="recipients held now")
    on_return: int = Field(
        description="recipients on the wire now: held when their attempt ends undelivered"
        " (deferred, or given back untried); delivered or bounced, they are done"
    )


class MoveRequest(_Body):
    to: str = Field(description="the configured zone to move them to")
    state: Literal[State.READY, State.DEFERRED, State.HELD] | None = Field(
        default=None, description="only the recipients in this state; absent: every one"
    )

    _to = field_validator("to")(not_empty)


class MoveCount(_Body):
    """A zone's move: moved now, and on the wire (leased), left in the zone."""

    count: int = Field(description="recipients moved, each in the state it was in")
    in_flight: int = Field(description="recipients on the wire (leased): left where they are")


class ZoneCounts(_Body):
    ready: int
    leased: int
    deferred: int
    held: int
    paused: bool


class ZoneState(_Body):
    zone: str
    paused: bool


class QueueCounts(_Body):
    messages: int
    zones: dict[str, ZoneCounts]


class RecipientView(_Body):
    message_id: str
    zone: str
    address: str
    domain: str
    state: str
    attempts: int
    first_attempt_ms: int
    last_attempt_ms: int
    next_attempt_ms: int
    last_reply: str
    hold_reason: str
    notify: list[str]
    orcpt: str | None


class RecipientPage(_Body):
    recipients: list[RecipientView]
    cursor: str | None = Field(description="pass as ?cursor= for the next page; null: the end")


class MessageView(_Body):
    id: str
    sender: str
    size: int
    received_ms: int
    zones: list[str]
    recipient_count: int
    headers: dict[str, str]
    source: dict[str, str]
    envid: str | None
    ret: str | None
    is_bounce: bool
    recipients: list[RecipientView]


class Health(_Body):
    status: Literal["ok", "unavailable"]
    reason: str | None = Field(default=None, description="why the queue refuses writes")
    # Not an outage: a quarantined record is one recipient or message an operator must look
    # at, while the rest of the queue is delivered; so it never turns the status to 503.
    quarantined: int = Field(
        ge=0, description="corrupt queue records set aside since start (kept on disk)"
    )


class ErrorBody(_Body):
    status: int
    message: str


class Error(_Body):
    error: ErrorBody


class SuppressionAdd(_Body):
    addresses: list[str] = Field(
        min_length=1, max_length=100_000, description="each checked like RCPT TO's address"
    )


class SuppressionAdded(_Body):
    zone: str
    added: int = Field(description="how many were not listed yet")
    total: int = Field(description="addresses on the zone's list now")


class SuppressionPage(_Body):
    zone: str
    addresses: list[str] = Field(description="lower-cased, in sorted order")
    total: int
    cursor: str | None = Field(description="pass as ?cursor= for the next page; null: the end")


class SuppressionCheck(_Body):
    zone: str
    address: str = Field(description="as stored and compared: lower-cased")
    suppressed: bool
    lists: list[str] = Field(description='the lists that hold it: the zone\'s and/or "*"')


class SuppressionRemoved(_Body):
    zone: str
    address: str
    removed: bool
