"""A suppression list per zone: recipients that must not get mail from that zone.

The list is a JSON file (``options.file``) mapping a zone name to addresses, with ``"*"``
for every zone:

    {"*": ["complained@example.org"], "bulk": ["unsubscribed@example.net"]}

A suppressed recipient is refused at RCPT with 550 5.1.1 (``action = "refuse"``, the
sender learns at once) or accepted and dropped with an event (``action = "drop"``, the
sender's list is not told who is suppressed): a DROPPED event, written with the message's
commit, whose text is the reason.  The list is checked in the recipient's final zone: when
a trusted client's routing header moves a recipient to another zone at the end of DATA,
the check runs again there, and a refusal then drops that recipient with an event (the
reply names it) since SMTP cannot refuse one recipient after DATA; see
``plugins/README.md``.  API submissions are checked too; a refused recipient is listed in
the API's answer.

Addresses compare case-insensitively, the local part included.  RFC 5321 section 2.4 lets
a server treat local parts as case-sensitive but says exploiting that "impedes
interoperability and is discouraged"; no large mailbox provider does.  For a suppression
list the costly mistake is mailing someone who complained or unsubscribed, not skipping a
mailbox that differs only in case, so the whole address is lower-cased (as most sending
platforms' lists do), and its domain is put in A-labels (a U-label and its A-label are
one domain).  Other spellings of one mailbox compare as one too: quotes a local part does
not need (``"eve"@x`` is ``eve@x``) and the root's dot (``eve@x.`` is ``eve@x``).

This module owns the file format: ``load_file``, ``save_file`` and ``normalize`` are what
zoneq's API (``zoneq suppression ...``) uses to edit the list, so the two cannot disagree.
A change is written to a new file and renamed over the old one, so no reader sees half of
it; the plugin notices the change by the file's stat and parses it once.
"""

from __future__ import annotations

import json
import os
import tempfile
import threading
import time
from collections.abc import Collection, Mapping
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict

from zoneq.plugin import (
    Drop,
    EnhancedStatus,
    Hook,
    OptionError,
    PluginApp,
    Reply,
    RouteArgs,
    bare_domain,
)
from zoneq.protocol.local_parts import canonical_local

ALL_ZONES = "*"

# RFC 3463 section 3.2: X.1.1 "bad destination mailbox address" is what senders' list
# software understands as "remove this address".
SUPPRESSED = Reply(550, ("Recipient is on the suppression list",), EnhancedStatus(5, 1, 1))


class Options(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    file: Path
    action: Literal["refuse", "drop"] = "refuse"


# --- the file format ---------------------------------------------------------------------


def normalize(address: str) -> str:
    """The form an address is stored and compared in (see the module's docstring): lower
    case, and the domain as the queue keys it (A-labels), so suppressing
    ``bob@bücher.example`` suppresses ``bob@xn--bcher-kva.example`` too, and back.

    Spellings of one mailbox compare as one, or a client could slip past the list by
    respelling it: a quoted local part in its least quoted form (``canonical_local``, the
    spelling zoneq queues), and the domain without the root's dot (``example.org.`` is
    ``example.org``)."""
    local, at, domain = address.rpartition("@")
    return f"{canonical_local(local).lower()}@{bare_domain(domain)}" if at else address.lower()


def parse(text: str, where: Path) -> dict[str, frozenset[str]]:
    """The file's text as zone -> normalized addresses; ``ValueError`` naming the file."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{where}: not JSON: {exc}") from None
    if not isinstance(data, dict) or not all(
        isinstance(v, list) and all(isinstance(a, str) for a in v) for v in data.values()
    ):
        raise ValueError(f"{where}: expected an object of zone name -> [addresses]")
    return {zone: frozenset(normalize(a) for a in v) for zone, v in data.items()}


def load_file(path: Path) -> dict[str, frozenset[str]]:
    return parse(path.read_text(encoding="utf-8"), path)


def save_file(path: Path, zones: Mapping[str, Collection[str]]) -> None:
    """Replace the file with ``zones`` atomically: a temporary file in the same directory,
    fsync, rename over the old one, fsync the directory (so the rename survives a crash).

    The new file's mtime is made later than the old one's even when the clock has not
    ticked (file times are only as fine as the kernel's timer tick), so a reader comparing
    stat results can never miss a change.  Empty zones are left out; addresses are sorted,
    one per line, so the file diffs well.
    """
    data = {zone: sorted(addresses) for zone, addresses in sorted(zones.items()) if addresses}
    text = json.dumps(data, indent=1, ensure_ascii=False) + "\n"
    try:
        old = os.stat(path)
    except FileNotFoundError:
        old = None
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            out.write(text)
            out.flush()
            if old is not None:
                os.fchmod(out.fileno(), old.st_mode & 0o7777)  # mkstemp makes it 0600
                now = time.time_ns()
                os.utime(out.fileno(), ns=(now, max(now, old.st_mtime_ns + 1)))
            os.fsync(out.fileno())
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def stamp(path: Path) -> tuple[int, int, int, int]:
    """What changes when the file is replaced or edited: inode, mtime, ctime, size."""
    st = os.stat(path)
    return (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)


# --- the plugin --------------------------------------------------------------------------


class SuppressionList:
    """The file's contents, parsed again only when its stat changes.

    Every RCPT costs one ``stat``; a change costs one parse however many RCPTs arrive
    while it is parsed (handlers run in worker threads: the others wait for that parse
    rather than start their own, and see the new list once it is done).
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.parses = 0
        self._stamp: tuple[int, int, int, int] | None = None
        self._zones: dict[str, frozenset[str]] = {}
        self._lock = threading.Lock()
        self.reload_if_changed()  # a missing or broken file fails start-up, not a delivery

    def reload_if_changed(self) -> None:
        if stamp(self.path) == self._stamp:
            return
        with self._lock:
            current = stamp(self.path)
            if current == self._stamp:  # another thread parsed it while this one waited
                return
            self._zones = load_file(self.path)
            self._stamp = current
            self.parses += 1

    def suppressed(self, zone: str, recipient: str) -> bool:
        address = normalize(recipient)
        zones = self._zones
        return address in zones.get(zone, frozenset()) or address in zones.get(
            ALL_ZONES, frozenset()
        )


def init(app: PluginApp) -> None:
    options = app.options
    assert isinstance(options, Options)
    try:
        listed = SuppressionList(options.file)
    except (OSError, ValueError) as exc:
        raise OptionError(("file",), f"cannot load the list: {exc}") from None

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
