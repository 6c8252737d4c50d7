"""The Java check that runs before Spark starts (no Spark here: fast)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from zoneq.analytics.errors import AnalyticsError
from zoneq.analytics.java import check_java, parse_major, required_major


@pytest.mark.parametrize(
    ("output", "major"),
    [
        ('openjdk version "17.0.15" 2025-04-15\nOpenJDK Runtime Environment', 17),
        ('openjdk version "21" 2023-09-19', 21),
        ('java version "1.8.0_392"\nJava(TM) SE Runtime Environment', 8),
        ('openjdk version "11.0.2" 2019-01-15', 11),
        ('openjdk version "25-ea" 2025-09-16', 25),
        ("bash: java: command not found", None),
        ("", None),
    ],
)
def test_java_versions_are_read_from_java_version_output(output: str, major: int | None) -> None:
    assert parse_major(output) == major


@pytest.mark.parametrize(("spark", "java"), [("4.3.0", 17), ("4.0.1", 17), ("3.5.6", 8)])
def test_the_java_needed_follows_the_spark_version(spark: str, java: int) -> None:
    assert required_major(spark) == java


def fake_java_home(tmp_path: Path, version_line: str) -> Path:
    """A JAVA_HOME whose bin/java prints ``version_line`` to stderr, as java -version does."""
    java = tmp_path / "jdk" / "bin" / "java"
    java.parent.mkdir(parents=True)
    java.write_text(f"#!/bin/sh\necho '{version_line}' >&2\n")
    java.chmod(java.stat().st_mode | stat.S_IXUSR)
    return tmp_path / "jdk"


def test_an_old_java_is_named_with_what_is_needed(tmp_path: Path) -> None:
    home = fake_java_home(tmp_path, 'openjdk version "11.0.22" 2024-01-16')
    with pytest.raises(AnalyticsError, match=r"is Java 11; PySpark 4.3.0 needs Java 17 or newer"):
        check_java("4.3.0", {"JAVA_HOME": str(home), "PATH": os.defpath})


def test_a_recent_java_passes(tmp_path: Path) -> None:
    home = fake_java_home(tmp_path, 'openjdk version "21.0.4" 2024-07-16')
    assert check_java("4.3.0", {"JAVA_HOME": str(home)}) == 21


@pytest.mark.parametrize(
    ("env", "where"),
    [({"PATH": "/nonexistent"}, "(PATH)"), ({"JAVA_HOME": "/nonexistent/jdk"}, "JAVA_HOME=")],
)
def test_no_java_says_so_and_what_to_install(env: dict[str, str], where: str) -> None:
    with pytest.raises(AnalyticsError, match="no Java found") as caught:
        check_java("4.3.0", env)
    assert where in str(caught.value) and "openjdk-17-jre-headless" in str(caught.value)
