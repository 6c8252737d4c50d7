"""A suppression list per zone: recipients that must not get mail from that zone.

The list is a JSON file (``options.file``) mapping a zone name to addresses, with ``"*"``
for every zone:

    {"*": ["complained@example.org"], "bulk": ["unsubscribed@example.net"]}

A suppressed recipient is refused at RCPT with 550 5.1.1 (``action = "refuse"``, the
sender learns at once) or accepted and dropped with an event (``action = "drop"``, the
sender's list is not told who is suppressed).  Addresses compare case-insensitively.  The
file is read again when it changes, so the API or an operator can edit it in place
(write a new file and rename it over the old one, so no reader sees half of it).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from zoneq.plugin import Drop, EnhancedStatus, Hook, PluginApp, Reply, RouteArgs

ALL_ZONES = "*"

# RFC 3463 section 3.2: X.1.1 "bad destination mailbox address" is what senders' list
# software understands as "remove this address".
SUPPRESSED = Reply(550, ("Recipient is on the suppression list",), EnhancedStatus(5, 1, 1))


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    file: Path
    action: Literal["refuse", "drop"] = "refuse"


class SuppressionList:
    """The file's contents, reloaded when its modification time or size changes."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._stamp: tuple[int, int] | None = None
        self._zones: dict[str, frozenset[str]] = {}
        self.reload_if_changed()  # a missing or broken file fails start-up, not a delivery

    def reload_if_changed(self) -> None:
        stat = os.stat(self.path)
        stamp = (stat.st_mtime_ns, stat.st_size)
        if stamp == self._stamp:
            return
        data = json.loads(self.path.read_text(encoding="utf-8"))
        if not isinstance(data, dict) or not all(
            isinstance(v, list) and all(isinstance(a, str) for a in v) for v in data.values()
        ):
            raise ValueError(f"{self.path}: expected an object of zone name -> [addresses]")
        self._zones = {zone: frozenset(a.lower() for a in v) for zone, v in data.items()}
        self._stamp = stamp

    def suppressed(self, zone: str, recipient: str) -> bool:
        address = recipient.lower()
        return address in self._zones.get(zone, frozenset()) or address in self._zones.get(
            ALL_ZONES, frozenset()
        )


def init(app: PluginApp) -> None:
    options = app.options
    assert isinstance(options, Options)
    listed = SuppressionList(options.file)

    # At queue:route the zone is known (the list is per zone) and this runs at RCPT time,
    # so a refusal reaches the client as the RCPT reply.  A plain function: the stat and
    # a reload are file I/O, which the host keeps off the event loop.
    def check(args: RouteArgs) -> Reply | Drop | None:
        listed.reload_if_changed()
        if not listed.suppressed(args.zone, args.recipient):
            return None
        if options.action == "refuse":
            return SUPPRESSED
        return Drop(f"suppressed in zone {args.zone}")

    app.add_hook(Hook.QUEUE_ROUTE, check)
