"""Is there a Java PySpark can use?  Asked before Spark starts, so the answer is clear.

Without this check a missing or old Java shows up as a gateway error from deep inside
PySpark (``JAVA_GATEWAY_EXITED``) or a JVM ``UnsupportedClassVersionError``.  PySpark finds
Java the way this does: ``$JAVA_HOME/bin/java`` when ``JAVA_HOME`` is set, else ``java`` on
``PATH``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections.abc import Mapping
from typing import Final

from zoneq.analytics.errors import AnalyticsError

# Spark 4 runs on Java 17 and 21 (its release notes); 3.5 also on 8 and 11.  The analytics
# extra allows both, so the floor follows the installed PySpark.
MIN_JAVA_SPARK4: Final = 17
MIN_JAVA_SPARK3: Final = 8
_VERSION: Final = re.compile(r'version "(\d+)(?:\.(\d+))?[^"]*"')
INSTALL_HINT: Final = "install a Java runtime (Debian: apt-get install openjdk-17-jre-headless)"


def java_command(env: Mapping[str, str]) -> str | None:
    home = env.get("JAVA_HOME")
    if home:
        candidate = os.path.join(home, "bin", "java")
        return candidate if os.access(candidate, os.X_OK) else None
    return shutil.which("java", path=env.get("PATH", os.defpath))


def parse_major(version_output: str) -> int | None:
    """The major version from ``java -version`` output (``1.8.0_x`` is 8)."""
    match = _VERSION.search(version_output)
    if match is None:
        return None
    major = int(match.group(1))
    if major == 1 and match.group(2) is not None:
        return int(match.group(2))
    return major


def required_major(spark_version: str) -> int:
    return MIN_JAVA_SPARK4 if int(spark_version.split(".", maxsplit=1)[0]) >= 4 else MIN_JAVA_SPARK3


def check_java(spark_version: str, env: Mapping[str, str] | None = None) -> int:
    """The Java major version, or ``AnalyticsError`` saying what is missing and what to do."""
    env = os.environ if env is None else env
    need = required_major(spark_version)
    java = java_command(env)
    if java is None:
        where = f"JAVA_HOME={env['JAVA_HOME']}" if env.get("JAVA_HOME") else "PATH"
        raise AnalyticsError(
            f"no Java found ({where}): PySpark {spark_version} needs Java {need} or newer; "
            f"{INSTALL_HINT}, or set JAVA_HOME"
        )
    try:
        done = subprocess.run(
            [java, "-version"], capture_output=True, text=True, timeout=30, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise AnalyticsError(f"cannot run {java} -version: {exc}") from exc
    major = parse_major(done.stderr + done.stdout)
    if major is None:
        raise AnalyticsError(f"cannot tell the version of {java}: {done.stderr.strip()[:200]}")
    if major < need:
        raise AnalyticsError(
            f"{java} is Java {major}; PySpark {spark_version} needs Java {need} or newer: "
            f"{INSTALL_HINT}, or point JAVA_HOME at one"
        )
    return major
