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

This module owns the file format: ``save_file``, ``normalize`` and ``shared_list`` are what
zoneq's API (``zoneq suppression ...``) uses, so the two cannot disagree.

Theory of operation.  The list is the JSON file (the snapshot) plus the changes made since
it was written, in a journal beside it (``<file>.journal``): one JSON line per add or
remove, ``["+" or "-", zone, [addresses...]]``, appended and fsynced before the API answers,
so a change costs what it adds, not the list's size.  A reader applies the journal's new
lines as they come (each RCPT costs a ``stat`` of both files); a line cut short by a crash
was never acknowledged and is skipped, and the writer cuts it off before its next append.
When the journal has grown past the snapshot's size, the core folds it in: a new snapshot
(written to a temporary file, renamed over the old one) and an empty journal.  Replaying a
journal on a snapshot that already holds its changes gives the same list (each address ends
as its last change left it), so a crash between the two renames loses nothing.  A snapshot
that changes under a reader (a fold, or an operator's edit by rename) is parsed again and
the journal applied on top: an address the API added or removed since the last fold keeps
that change; every other address is as the operator's file says.  A journal that is deleted
(an operator restoring a backup as the whole list) or replaced under a reader sends it back
to the snapshot alone.  The journal is zoneq's: an operator edits only the snapshot.

In the core, the plugin's hook and the API share one ``SuppressionList`` per file
(``shared_list``): one parsed copy, and the API's own changes need no reading back.  Bulk
work (building sets, sorting, writing a snapshot) runs as Python loops in chunks on a
thread, which lets the event loop's thread take the GIL between chunks.
"""

from __future__ import annotations

import bisect
import heapq
import json
import os
import tempfile
import threading
import time
from collections.abc import Collection, Iterable, Iterator, Mapping, Sequence
from itertools import islice
from pathlib import Path
from typing import Final, Literal

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

CHUNK: Final = 20_000
"""Addresses per C-level step (a sort, a set update): about 10 ms holding the GIL."""
FOLD_MIN_BYTES: Final = 1 << 20
"""A journal smaller than this is never folded, whatever the snapshot's size."""
SMALL_CHANGE: Final = 1000
"""Up to this many addresses a change is inserted into a sorted listing one by one."""

Stamp = tuple[int, int, int, int]


class JournalUncertain(OSError):
    """A change written to the journal that could be neither made durable nor cut off
    again: readers may apply it or not.  Trying the change again is safe (an add or a
    remove of the same addresses leaves the same list)."""


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


def _parse_sets(text: str, where: Path) -> dict[str, set[str]]:
    """The file's text as zone -> normalized addresses; ``ValueError`` naming the file."""
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{where}: not JSON: {exc}") from None
    if not isinstance(data, dict) or not all(
        isinstance(v, list) and all(isinstance(a, str) for a in v) for v in data.values()
    ):
        raise ValueError(f"{where}: expected an object of zone name -> [addresses]")
    # A generator, not a C-level set(list): the loop's thread gets the GIL meanwhile.
    return {zone: set(normalize(a) for a in v) for zone, v in data.items()}


def load_file(path: Path) -> dict[str, frozenset[str]]:
    """The snapshot alone (without the journal: ``SuppressionList`` reads both), as zone ->
    normalized addresses; ``ValueError`` naming the file."""
    parsed = _parse_sets(path.read_text(encoding="utf-8"), path)
    return {zone: frozenset(v) for zone, v in parsed.items()}


def journal_path(path: Path) -> Path:
    return path.with_name(path.name + ".journal")


def sorted_gently(items: Iterable[str]) -> list[str]:
    """``sorted(items)`` in steps of ``CHUNK``: one ``sorted`` of a million strings holds
    the GIL for most of a second, which would stall the event loop's thread."""
    source = iter(items)
    runs = []
    while run := sorted(islice(source, CHUNK)):
        runs.append(run)
    return runs[0] if len(runs) == 1 else list(heapq.merge(*runs))


def _snapshot_text(zones: Mapping[str, Sequence[str]]) -> Iterator[str]:
    """``json.dumps(zones, indent=1)`` and a newline, a chunk at a time (the addresses
    sorted already), so no single call holds the GIL for the whole list."""
    listed = [(zone, addresses) for zone, addresses in sorted(zones.items()) if addresses]
    if not listed:
        yield "{}\n"
        return
    yield "{\n"
    for number, (zone, addresses) in enumerate(listed):
        yield f" {json.dumps(zone, ensure_ascii=False)}: [\n"
        for start in range(0, len(addresses), CHUNK):
            lines = ",\n".join(
                f"  {json.dumps(a, ensure_ascii=False)}" for a in addresses[start : start + CHUNK]
            )
            yield lines + (",\n" if start + CHUNK < len(addresses) else "\n")
        yield " ]" + ("," if number < len(listed) - 1 else "") + "\n"
    yield "}\n"


def _fsync_directory(path: Path) -> None:
    directory = os.open(path.parent, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(directory)
    finally:
        os.close(directory)


def _replace(
    path: Path, chunks: Iterable[str], *, unless_changed_from: Stamp | None = None
) -> None:
    """Replace ``path`` with the text of ``chunks`` atomically: a temporary file in the same
    directory, fsync, rename over the old one, fsync the directory (so the rename survives
    a crash).  With ``unless_changed_from``, a file whose stamp has moved since (an
    operator's edit) is left as it is and ``FileExistsError`` raised.

    The new file's mtime is made later than the old one's even when the clock has not
    ticked (file times are only as fine as the kernel's timer tick), so a reader comparing
    stat results can never miss a change."""
    try:
        old = os.stat(path)
    except FileNotFoundError:
        old = None
    fd, temporary = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as out:
            for chunk in chunks:
                out.write(chunk)
            out.flush()
            if old is not None:
                os.fchmod(out.fileno(), old.st_mode & 0o7777)  # mkstemp makes it 0600
                now = time.time_ns()
                os.utime(out.fileno(), ns=(now, max(now, old.st_mtime_ns + 1)))
            os.fsync(out.fileno())
        if unless_changed_from is not None and stamp(path) != unless_changed_from:
            raise FileExistsError(f"{path} changed meanwhile")
        os.replace(temporary, path)
    except BaseException:
        Path(temporary).unlink(missing_ok=True)
        raise
    _fsync_directory(path)


def save_file(path: Path, zones: Mapping[str, Collection[str]]) -> None:
    """Replace the file with ``zones`` atomically (see ``_replace``).  Empty zones are left
    out; addresses are sorted, one per line, so the file diffs well."""
    ordered = {zone: sorted_gently(addresses) for zone, addresses in zones.items()}
    _replace(path, _snapshot_text(ordered))


def stamp(path: Path) -> Stamp:
    """What changes when the file is replaced or edited: inode, mtime, ctime, size."""
    st = os.stat(path)
    return (st.st_ino, st.st_mtime_ns, st.st_ctime_ns, st.st_size)


def _journal_line(line: bytes, where: Path) -> tuple[str, str, list[str]]:
    try:
        op, zone, addresses = json.loads(line)
    except ValueError:
        raise ValueError(f"{where}: a line is not a change: {line[:80]!r}") from None
    if op not in ("+", "-") or not isinstance(zone, str) or not isinstance(addresses, list):
        raise ValueError(f"{where}: a line is not a change: {line[:80]!r}")
    return op, zone, addresses


# --- the list ----------------------------------------------------------------------------


class SuppressionList:
    """The snapshot and its journal, read again only when their stats change: a changed
    snapshot is parsed whole, a grown journal is read from where this reader stopped.

    Every RCPT costs two ``stat`` calls; a change costs one parse (or one read of the
    journal's new lines) however many RCPTs arrive while it is read (handlers run in worker
    threads: the others wait for that reader rather than start their own, and see the new
    list once it is done).  The writers (``add``, ``remove``, ``fold``: zoneq's API, in the
    core only) hold the same lock.
    """

    def __init__(self, path: Path) -> None:
        self.path = path
        self.journal = journal_path(path)
        self.parses = 0
        self.journal_lines = 0
        """Journal lines read from the file (not those this instance wrote)."""
        self._stamp: Stamp | None = None
        self._journal_ino: int | None = None
        self._offset = 0  # the journal's bytes applied: whole lines only
        self._zones: dict[str, set[str]] = {}
        self._sorted: dict[str, list[str]] = {}  # listings built so far, kept up to date
        self._lock = threading.Lock()
        self.reload_if_changed()  # a missing or broken file fails start-up, not a delivery

    def _journal_now(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self.journal)
        except FileNotFoundError:
            return None
        return st.st_ino, st.st_size

    def _up_to_date(self) -> bool:
        seen = None if self._journal_ino is None else (self._journal_ino, self._offset)
        return stamp(self.path) == self._stamp and self._journal_now() == seen

    def reload_if_changed(self) -> None:
        if self._up_to_date():
            return
        with self._lock:
            self._refresh()

    def _refresh(self) -> None:
        """Catch up with the files; the caller holds the lock."""
        if self._up_to_date():  # another thread caught up while this one waited
            return
        if stamp(self.path) != self._stamp:
            self._reload()
        else:
            self._read_journal()

    def _reload(self) -> None:
        current = stamp(self.path)  # before reading: a change meanwhile is seen next time
        self._zones = _parse_sets(self.path.read_text(encoding="utf-8"), self.path)
        self._sorted = {}
        self._stamp, self._journal_ino, self._offset = current, None, 0
        self.parses += 1
        self._read_journal()

    def _read_journal(self) -> None:
        """Apply the journal's whole lines past ``_offset``; the caller holds the lock."""
        try:
            with open(self.journal, "rb") as source:
                st = os.fstat(source.fileno())
                # Replaced or cut short by something other than a fold this reader saw
                # (whose snapshot it would have parsed): start over from the snapshot.
                restart = self._journal_ino not in (None, st.st_ino) or st.st_size < self._offset
                source.seek(self._offset)
                data = b"" if restart else source.read()
        except FileNotFoundError:
            restart = self._journal_ino is not None  # deleted: the snapshot alone is the list
            data = b""
            st = None
        if restart:
            self._reload()
            return
        whole = data.rfind(b"\n") + 1  # a torn last line (a crash mid-append) is skipped
        for line in data[:whole].splitlines():
            self._apply(*_journal_line(line, self.journal))
            self.journal_lines += 1
        if st is not None:
            self._journal_ino, self._offset = st.st_ino, self._offset + whole

    def _apply(self, op: str, zone: str, addresses: list[str]) -> None:
        listed = self._zones.setdefault(zone, set())
        if op == "+":
            listed.update(addresses)
        else:
            listed.difference_update(addresses)
        self._sorted.pop(zone, None)  # rebuilt when next listed

    # --- reading ---------------------------------------------------------------------------

    def suppressed(self, zone: str, recipient: str) -> bool:
        address = normalize(recipient)
        zones = self._zones
        return address in zones.get(zone, ()) or address in zones.get(ALL_ZONES, ())

    def holds(self, zone: str, address: str) -> bool:
        """Whether ``zone``'s own list holds ``address`` (normalized already)."""
        return address in self._zones.get(zone, ())

    def window(self, zone: str, after: str | None, limit: int) -> tuple[list[str], int]:
        """Up to ``limit`` of ``zone``'s addresses in order, those after ``after``; and how
        many the zone lists."""
        with self._lock:
            ordered = self._listing(zone)
            start = 0 if after is None else bisect.bisect_right(ordered, after)
            return ordered[start : start + limit], len(ordered)

    def as_dict(self) -> dict[str, list[str]]:
        """Every non-empty zone's addresses, sorted."""
        with self._lock:
            return {zone: list(self._listing(zone)) for zone in self._zones if self._zones[zone]}

    def _listing(self, zone: str) -> list[str]:
        ordered = self._sorted.get(zone)
        if ordered is None:
            ordered = self._sorted[zone] = sorted_gently(self._zones.get(zone, ()))
        return ordered

    # --- writing (zoneq's API, in the core) ------------------------------------------------

    def add(self, zone: str, addresses: Iterable[str]) -> tuple[int, int]:
        """Suppress ``addresses`` (normalized already) in ``zone``: how many were not listed
        yet, and how many the zone lists now.  Durable (fsynced) when it returns."""
        with self._lock:
            self._refresh()
            listed = self._zones.get(zone, set())
            new = sorted_gently(set(addresses) - listed)
            if new:
                self._append("+", zone, new)
                self._zones.setdefault(zone, set()).update(new)
                self._sorted_insert(zone, new)
            return len(new), len(self._zones.get(zone, ()))

    def remove(self, zone: str, address: str) -> bool:
        """Take ``address`` (normalized already) off ``zone``'s list; False if not there."""
        with self._lock:
            self._refresh()
            if address not in self._zones.get(zone, ()):
                return False
            self._append("-", zone, [address])
            self._zones[zone].discard(address)
            ordered = self._sorted.get(zone)
            if ordered is not None:
                del ordered[bisect.bisect_left(ordered, address)]
            return True

    def wants_fold(self) -> bool:
        """Whether the journal has outgrown the snapshot: folding then costs, per change
        journaled since the last fold, a constant share of one rewrite."""
        size = 0 if self._stamp is None else self._stamp[3]
        return self._offset > max(FOLD_MIN_BYTES, size)

    def fold(self) -> None:
        """Write the whole list as the snapshot and start an empty journal.  A snapshot an
        operator replaced meanwhile is left alone (``FileExistsError``): it is read, with
        the journal on top, and the next fold writes both."""
        with self._lock:
            self._refresh()
            ordered = {zone: self._listing(zone) for zone in self._zones}
            _replace(self.path, _snapshot_text(ordered), unless_changed_from=self._stamp)
            # This reader's copy already holds the journal: adopt the new files as read.
            self._stamp = stamp(self.path)
            _replace(self.journal, ())
            self._journal_ino, self._offset = os.stat(self.journal).st_ino, 0

    def _append(self, op: str, zone: str, addresses: list[str]) -> None:
        """One journal line, fsynced; the caller holds the lock and is up to date."""
        line = (json.dumps([op, zone, addresses], ensure_ascii=False) + "\n").encode()
        mode = os.stat(self.path).st_mode & 0o666  # as readable as the snapshot, no more
        fd = os.open(self.journal, os.O_WRONLY | os.O_CREAT | os.O_APPEND, mode)
        try:
            st = os.fstat(fd)
            if st.st_size != self._offset:
                # A line cut short by a crash: never acknowledged, so cut off, or the next
                # line would be glued to it and lost.
                os.ftruncate(fd, self._offset)
            view = memoryview(line)
            while view:
                view = view[os.write(fd, view) :]
            try:
                os.fsync(fd)
            except OSError as exc:
                self._cut_back(fd, exc)
                raise
        finally:
            os.close(fd)
        if self._journal_ino is None:  # a new file: its name must survive a crash too
            _fsync_directory(self.journal)
        self._journal_ino, self._offset = st.st_ino, self._offset + len(line)

    def _cut_back(self, fd: int, failure: OSError) -> None:
        """Cut off the line just written, whose fsync failed: the caller answers that
        nothing was changed, so no reader may apply it (and this writer's next ``_refresh``
        would read it back as a change of the list).  ``JournalUncertain`` if that cannot
        be made durable either."""
        try:
            os.ftruncate(fd, self._offset)
            os.fsync(fd)
            if self._journal_ino is None:  # this append made the file: keep its name
                _fsync_directory(self.journal)
        except OSError as exc:
            raise JournalUncertain(
                f"{self.journal}: fsync failed ({failure.strerror or failure}), and so did"
                f" cutting the line off ({exc.strerror or exc})"
            ) from failure

    def _sorted_insert(self, zone: str, new: list[str]) -> None:
        ordered = self._sorted.get(zone)
        if ordered is None:
            return
        if len(new) <= SMALL_CHANGE:
            for address in new:
                bisect.insort(ordered, address)
        else:
            self._sorted[zone] = list(heapq.merge(ordered, new))


_SHARED: dict[Path, SuppressionList] = {}
_SHARED_LOCK = threading.Lock()


def shared_list(path: Path) -> SuppressionList:
    """The one ``SuppressionList`` of ``path`` in this process: the plugin's hook and
    zoneq's API both use it, so the core holds one parsed copy and the API's changes reach
    the hook without a read of the file.  ``OSError``/``ValueError`` if it cannot be read."""
    key = Path(os.path.abspath(path))
    with _SHARED_LOCK:
        listed = _SHARED.get(key)
        if listed is None:
            listed = _SHARED[key] = SuppressionList(key)
    return listed


# --- the plugin --------------------------------------------------------------------------


def init(app: PluginApp) -> None:
    options = app.options
    assert isinstance(options, Options)
    try:
        listed = shared_list(options.file)
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
