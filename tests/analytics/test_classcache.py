"""The JVM class-data archive's bookkeeping (no JVM here: fast).

A real JVM recording and mapping an archive is ``test_job.py``'s
``test_the_class_cache_is_recorded_then_used``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from zoneq.analytics import classcache
from zoneq.analytics.classcache import DYNAMIC_MAGIC, ClassCache


@pytest.fixture
def spark_home(tmp_path: Path) -> tuple[Path, Path]:
    """A java binary and a jars directory (contents do not matter: names, sizes, times do)."""
    java = tmp_path / "jdk" / "bin" / "java"
    java.parent.mkdir(parents=True)
    java.write_bytes(b"#!/bin/sh\n")
    jars = tmp_path / "jars"
    jars.mkdir()
    for name in ("spark-core.jar", "spark-sql.jar"):
        (jars / name).write_bytes(b"PK" + name.encode())
    return java, jars


def test_the_archive_name_follows_java_and_the_jars(spark_home: tuple[Path, Path]) -> None:
    java, jars = spark_home
    first = classcache.archive_name(str(java), jars)
    assert first == classcache.archive_name(str(java), jars)
    assert first.startswith("spark-classes-") and first.endswith(".jsa")
    (jars / "hadoop-aws.jar").write_bytes(b"PK")  # another Spark installation
    second = classcache.archive_name(str(java), jars)
    assert second != first
    java.write_bytes(b"#!/bin/sh\n# another Java\n")
    assert classcache.archive_name(str(java), jars) not in (first, second)


@pytest.mark.parametrize(
    ("content", "usable"),
    [
        (None, False),  # no file
        (b"", False),
        (b"\0" * 4096, False),  # the JDK writes the header last: an interrupted dump
        (DYNAMIC_MAGIC[:3], False),
        (DYNAMIC_MAGIC + b"\0" * 100, True),
    ],
)
def test_only_a_complete_archive_is_usable(
    tmp_path: Path, content: bytes | None, usable: bool
) -> None:
    path = tmp_path / "a.jsa"
    if content is not None:
        path.write_bytes(content)
    assert classcache.usable(path) is usable


def test_a_missing_or_broken_archive_is_recorded_again(
    tmp_path: Path, spark_home: tuple[Path, Path]
) -> None:
    java, jars = spark_home
    directory = tmp_path / "cache"
    cache = ClassCache.at(directory, str(java), jars)
    assert cache.recording and directory.is_dir()
    assert cache.java_options()[0] == f"-XX:ArchiveClassesAtExit={cache.path}"
    cache.path.write_bytes(b"\0" * 64)  # left by a killed run
    again = ClassCache.at(directory, str(java), jars)
    assert again.recording and not again.path.exists()
    again.path.write_bytes(DYNAMIC_MAGIC + b"rest")
    mapped = ClassCache.at(directory, str(java), jars)
    assert not mapped.recording
    assert mapped.java_options()[0] == f"-XX:SharedArchiveFile={mapped.path}"
    assert all(option.startswith("-Xlog:cds") for option in mapped.java_options()[1:])


def stand_in_jvm(archive: Path, content: bytes) -> subprocess.Popen[bytes]:
    """A child that, like PySpark's gateway JVM, runs until its stdin closes and then
    writes the archive as it exits."""
    code = (
        "import sys, pathlib; sys.stdin.buffer.read(); "
        f"pathlib.Path({str(archive)!r}).write_bytes({content!r})"
    )
    return subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE)


@pytest.mark.parametrize(
    ("content", "kept"), [(DYNAMIC_MAGIC + b"classes", True), (b"\0\0\0\0partial", False)]
)
def test_finishing_waits_for_the_jvm_and_keeps_only_a_complete_archive(
    tmp_path: Path, content: bytes, kept: bool
) -> None:
    cache = ClassCache(tmp_path / "a.jsa", recording=True)
    jvm = stand_in_jvm(cache.path, content)
    try:
        cache.finish(jvm)
        assert jvm.returncode == 0  # it exited: nothing outlives the command
        assert cache.path.exists() is kept
    finally:
        if jvm.poll() is None:
            jvm.kill()
            jvm.wait()


def test_a_mapping_run_leaves_the_jvm_alone(tmp_path: Path) -> None:
    cache = ClassCache(tmp_path / "a.jsa", recording=False)
    jvm = stand_in_jvm(tmp_path / "other.jsa", DYNAMIC_MAGIC)
    try:
        cache.finish(jvm)
        assert jvm.poll() is None  # still running: PySpark ends it as usual
    finally:
        jvm.kill()
        jvm.wait()


def test_the_default_directory_follows_xdg() -> None:
    assert classcache.default_dir({"XDG_CACHE_HOME": "/c"}) == Path("/c/zoneq")
    assert classcache.default_dir({}).parts[-2:] == (".cache", "zoneq")
