"""The suppression list's journal: a change costs what it adds, whatever the list's size; a
reader (another process's copy) applies the new lines without parsing the snapshot; a line
torn by a crash is skipped and then cut off; an operator's edit by rename is read with the
journal's changes on top; a fold writes the whole list in the file's format and empties
the journal without the writer parsing anything."""

from __future__ import annotations

import errno
import json
import os
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from tests.support.plugins import BUNDLED
from zoneq.config.plugins import PluginConfig, import_plugin


@pytest.fixture(scope="module")
def plugin() -> ModuleType:
    return import_plugin("suppression", PluginConfig(module=str(BUNDLED / "suppression.py")))


def listed_file(plugin: ModuleType, directory: Path, count: int) -> Path:
    path = directory / "suppressed.json"
    plugin.save_file(path, {"*": [f"subscriber{i}@domain{i % 5000}.example" for i in range(count)]})
    return path


def journal_size(path: Path) -> int:
    journal = path.with_name(path.name + ".journal")
    return journal.stat().st_size if journal.exists() else 0


@pytest.mark.parametrize("count", [1_000, 100_000])
def test_a_change_costs_its_own_size_not_the_lists(
    plugin: ModuleType, tmp_path: Path, count: int
) -> None:
    """The same bytes written and the same lines read for one address, at 1,000 addresses
    and at 100,000: the snapshot is neither rewritten nor parsed again."""
    path = listed_file(plugin, tmp_path, count)
    writer: Any = plugin.SuppressionList(path)
    reader: Any = plugin.SuppressionList(path)  # another process's copy
    snapshot = plugin.stamp(path)

    assert writer.add("bulk", ["new@x.test"]) == (1, 1)
    assert writer.remove("*", "subscriber7@domain7.example")
    assert plugin.stamp(path) == snapshot
    line_add = len(json.dumps(["+", "bulk", ["new@x.test"]])) + 1
    line_remove = len(json.dumps(["-", "*", ["subscriber7@domain7.example"]])) + 1
    assert journal_size(path) == line_add + line_remove

    reader.reload_if_changed()
    assert (reader.parses, reader.journal_lines, writer.parses) == (1, 2, 1)
    assert reader.suppressed("bulk", "NEW@x.test")
    assert not reader.suppressed("bulk", "subscriber7@domain7.example")
    assert reader.suppressed("bulk", "subscriber8@domain8.example")


def test_a_torn_line_is_skipped_then_cut_off(plugin: ModuleType, tmp_path: Path) -> None:
    """A crash in the middle of an append leaves part of a line that was never acknowledged:
    readers skip it, and the next append does not glue its own line to it."""
    path = listed_file(plugin, tmp_path, 10)
    journal = path.with_name(path.name + ".journal")
    journal.write_bytes(b'["+", "bulk", ["kept@x.test"]]\n["+", "bulk", ["torn@x')
    reader: Any = plugin.SuppressionList(path)
    assert reader.suppressed("bulk", "kept@x.test")
    assert not reader.suppressed("bulk", "torn@x.test")

    writer: Any = plugin.SuppressionList(path)
    assert writer.add("bulk", ["after@x.test"]) == (1, 2)
    reader.reload_if_changed()
    assert reader.suppressed("bulk", "after@x.test") and reader.parses == 1
    assert plugin.SuppressionList(path).as_dict()["bulk"] == ["after@x.test", "kept@x.test"]


def test_an_operators_edit_by_rename_is_read_with_the_journal_on_top(
    plugin: ModuleType, tmp_path: Path
) -> None:
    """plugins/README.md: edit the file by writing a new one and renaming it over the old.
    Its addresses are the list, except those the API changed since the last fold."""
    path = tmp_path / "suppressed.json"
    path.write_text('{"bulk": ["old@x.test", "gone@x.test"]}')
    listed: Any = plugin.SuppressionList(path)
    listed.add("bulk", ["api@x.test"])
    listed.remove("bulk", "gone@x.test")

    edited = tmp_path / "edited.json"  # the operator's copy of the file, without the journal
    edited.write_text('{"bulk": ["old@x.test", "gone@x.test", "Hand@X.test"], "tx": ["t@x.test"]}')
    os.replace(edited, path)

    expected = {"bulk": ["api@x.test", "hand@x.test", "old@x.test"], "tx": ["t@x.test"]}
    listed.reload_if_changed()
    assert listed.parses == 2
    assert listed.as_dict() == expected
    assert plugin.SuppressionList(path).as_dict() == expected


def test_a_fold_writes_the_whole_list_and_empties_the_journal(
    plugin: ModuleType, tmp_path: Path
) -> None:
    path = listed_file(plugin, tmp_path, 3)
    writer: Any = plugin.SuppressionList(path)
    reader: Any = plugin.SuppressionList(path)
    big = [f"user{i}@s{i % 7}.example.test" for i in range(plugin.CHUNK + 40_000)]  # > 1 MiB
    writer.add("bulk", big)
    writer.remove("*", "subscriber1@domain1.example")
    assert writer.wants_fold()

    writer.fold()
    expected = writer.as_dict()
    assert journal_size(path) == 0 and not writer.wants_fold()
    # The file is exactly what json.dumps writes, chunks and all, sorted.
    assert path.read_text() == json.dumps(expected, indent=1) + "\n"
    assert expected["bulk"] == sorted(big) and expected["*"] == [
        "subscriber0@domain0.example",
        "subscriber2@domain2.example",
    ]
    writer.reload_if_changed()
    assert writer.parses == 1  # the writer's copy already held it all
    reader.reload_if_changed()
    assert reader.as_dict() == expected
    writer.add("bulk", ["later@x.test"])
    reader.reload_if_changed()
    assert reader.suppressed("bulk", "later@x.test")


def test_a_fold_leaves_an_operators_newer_file_alone(
    plugin: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An edit by rename that lands while a fold writes its snapshot is not overwritten; the
    journal keeps the API's changes, to be applied on top of the operator's file."""
    path = listed_file(plugin, tmp_path, 3)
    listed: Any = plugin.SuppressionList(path)
    listed.add("bulk", ["api@x.test"])
    write = plugin._snapshot_text

    def edited_meanwhile(zones: Any) -> Any:
        edited = tmp_path / "edited.json"
        edited.write_text('{"tx": ["hand@x.test"]}')
        os.replace(edited, path)
        return write(zones)

    monkeypatch.setattr(plugin, "_snapshot_text", edited_meanwhile)
    with pytest.raises(FileExistsError):
        listed.fold()
    assert json.loads(path.read_text()) == {"tx": ["hand@x.test"]}
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []
    listed.reload_if_changed()
    assert listed.as_dict() == {"bulk": ["api@x.test"], "tx": ["hand@x.test"]}


def test_a_deleted_journal_leaves_the_snapshot_as_the_whole_list(
    plugin: ModuleType, tmp_path: Path
) -> None:
    """plugins/README.md: an operator who wants the file alone to be the list (a restored
    backup) deletes the journal too; readers that had applied it start over from the file."""
    path = listed_file(plugin, tmp_path, 3)
    listed: Any = plugin.SuppressionList(path)
    listed.add("bulk", ["api@x.test"])
    path.with_name(path.name + ".journal").unlink()
    listed.reload_if_changed()
    assert "bulk" not in listed.as_dict() and listed.parses == 2
    listed.add("bulk", ["next@x.test"])  # a new journal, applied from its start
    assert plugin.SuppressionList(path).as_dict()["bulk"] == ["next@x.test"]


def _replace_by_rename(journal: Path) -> None:
    fresh = journal.with_name("fresh.journal")
    fresh.write_bytes(b"")
    os.replace(fresh, journal)  # a new inode under the journal's name


def _truncate_in_place(journal: Path) -> None:
    os.truncate(journal, 0)  # the same inode, shorter than the reader's offset


@pytest.mark.parametrize("emptied", [_replace_by_rename, _truncate_in_place])
def test_a_journal_started_over_under_a_reader_is_read_from_its_start(
    plugin: ModuleType, tmp_path: Path, emptied: Any
) -> None:
    """The journal started over by something this reader did not see (the snapshot's stamp
    unchanged, so no fold it would have parsed): its offset into the old journal means
    nothing in the new one, so it starts over from the snapshot and reads the new journal
    whole.  Kept at its old offset it would skip a new line shorter than the old ones."""
    path = listed_file(plugin, tmp_path, 3)
    snapshot = plugin.stamp(path)
    reader: Any = plugin.SuppressionList(path)  # another process's copy
    plugin.SuppressionList(path).add("bulk", [f"long-address-{i}@x.test" for i in range(20)])
    reader.reload_if_changed()
    assert reader.suppressed("bulk", "long-address-7@x.test")

    emptied(path.with_name(path.name + ".journal"))
    assert plugin.SuppressionList(path).add("bulk", ["s@x.test"]) == (1, 1)  # a short line
    assert plugin.stamp(path) == snapshot
    reader.reload_if_changed()
    assert reader.suppressed("bulk", "s@x.test")
    assert not reader.suppressed("bulk", "long-address-7@x.test")
    assert reader.parses == 2


def fsync_failing(monkeypatch: pytest.MonkeyPatch, times: int) -> None:
    """``os.fsync`` fails with EIO (a disk error) for its next ``times`` calls."""
    real, left = os.fsync, [times]

    def fsync(fd: int) -> None:
        if left[0] > 0:
            left[0] -= 1
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.parametrize("existing", [True, False], ids=["appended", "new-journal"])
def test_a_change_whose_fsync_failed_is_cut_off_and_read_by_no_one(
    plugin: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, existing: bool
) -> None:
    """The API answers that nothing was changed, so the line written before the fsync
    failed must not be applied: not by another process's reader, nor by the writer itself
    when it next catches up with the file."""
    path = listed_file(plugin, tmp_path, 3)
    writer: Any = plugin.SuppressionList(path)
    if existing:
        writer.add("bulk", ["before@x.test"])
    size = journal_size(path)
    fsync_failing(monkeypatch, 1)
    with pytest.raises(OSError) as info:
        writer.add("bulk", ["failed@x.test"])
    assert not isinstance(info.value, plugin.JournalUncertain)
    assert journal_size(path) == size

    reader: Any = plugin.SuppressionList(path)  # another process's copy
    assert not reader.suppressed("bulk", "failed@x.test")
    assert writer.add("bulk", ["after@x.test"]) == (1, 2 if existing else 1)
    assert not writer.suppressed("bulk", "failed@x.test")
    reader.reload_if_changed()
    assert reader.suppressed("bulk", "after@x.test")
    assert not reader.suppressed("bulk", "failed@x.test")


def test_a_change_that_cannot_be_cut_off_either_is_said_to_be_uncertain(
    plugin: ModuleType, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = listed_file(plugin, tmp_path, 3)
    writer: Any = plugin.SuppressionList(path)
    fsync_failing(monkeypatch, 2)  # the line's fsync, then the cut's
    with pytest.raises(plugin.JournalUncertain, match="and so did cutting the line off"):
        writer.remove("*", "subscriber1@domain1.example")
