"""A class-data archive (JDK AppCDS) for the local Spark driver: seconds off every start.

A Spark session loads and verifies some 15,000 classes from 280 jars before its first
query; on 2 cores that is most of the JVM's start-up.  The JDK can record the classes a
run loaded into an archive (``-XX:ArchiveClassesAtExit``, JDK 13+) and map it, already
parsed and verified, into later runs (``-XX:SharedArchiveFile``).  Measured on 1 M Parquet
events (tools/bench/analytics_bench.py): the session starts in about 2 s instead of 5 and
the first query runs faster too.  Every run is still a cold JVM; only class loading is
cached, like Python's ``.pyc`` files.

The first run records and writes the archive when its JVM exits (about 10 s and 150 MB);
the command waits for that after the report is written.  The archive's name holds a hash
of the Java binary and the Spark jars, so another Java or PySpark gets its own; the JVM
itself refuses an archive that does not match it and then runs without one
(``-Xshare:auto``, the default).  The JDK writes an archive's header last, so a file left
by an interrupted run has no valid magic number: ``usable`` sees that and it is recorded
again.  Local runs only: on a cluster the driver's JVM is started by ``spark-submit``.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Final

# CDS_DYNAMIC_ARCHIVE_MAGIC (0xf00baba8), little-endian, at the start of a complete archive
DYNAMIC_MAGIC: Final = bytes.fromhex("a8ab0bf0")
# The JDK's CDS log lines (classes it skips, an archive it cannot use) are not the
# operator's business: with or without the archive the job runs the same.
QUIET: Final = ("-Xlog:cds=off", "-Xlog:cds+dynamic=off")
DUMP_SECONDS: Final = 120  # waiting for the archive to be written at exit, at most


def default_dir(env: dict[str, str] | None = None) -> Path:
    """``$XDG_CACHE_HOME/zoneq``, else ``~/.cache/zoneq``."""
    env = dict(os.environ) if env is None else env
    base = env.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "zoneq"


def archive_name(java: str, jars: Path) -> str:
    """The archive for this Java binary and these Spark jars (names, sizes and times)."""
    digest = hashlib.sha256()
    real = os.path.realpath(java)
    stat = os.stat(real)
    digest.update(f"{real}\0{stat.st_size}\0{stat.st_mtime_ns}\0".encode())
    for entry in sorted(os.scandir(jars), key=lambda e: e.name):
        info = entry.stat()
        digest.update(f"{entry.name}\0{info.st_size}\0{info.st_mtime_ns}\0".encode())
    return f"spark-classes-{digest.hexdigest()[:16]}.jsa"


def usable(path: Path) -> bool:
    """Whether ``path`` is a completely written dynamic archive."""
    try:
        with path.open("rb") as archive:
            return archive.read(len(DYNAMIC_MAGIC)) == DYNAMIC_MAGIC
    except OSError:
        return False


@dataclass(frozen=True, slots=True)
class ClassCache:
    path: Path
    recording: bool  # True: this run writes the archive at exit; False: it maps it

    @classmethod
    def at(cls, directory: Path, java: str, jars: Path) -> ClassCache:
        path = directory / archive_name(java, jars)
        if usable(path):
            return cls(path, recording=False)
        directory.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()  # an interrupted recording: record again
        return cls(path, recording=True)

    def java_options(self) -> list[str]:
        flag = "ArchiveClassesAtExit" if self.recording else "SharedArchiveFile"
        return [f"-XX:{flag}={self.path}", *QUIET]

    def finish(self, jvm: subprocess.Popen[bytes] | None) -> None:
        """After ``spark.stop()``: let a recording JVM exit and write the archive.

        PySpark's gateway JVM exits when its stdin closes (normally when Python exits);
        closing it here and waiting means no JVM outlives the command, still writing.
        """
        if not self.recording or jvm is None:
            return
        with contextlib.suppress(OSError):
            if jvm.stdin is not None:
                jvm.stdin.close()
        try:
            jvm.wait(DUMP_SECONDS)
        except subprocess.TimeoutExpired:
            jvm.kill()
            jvm.wait()
        if not usable(self.path):
            with contextlib.suppress(FileNotFoundError):
                self.path.unlink()
