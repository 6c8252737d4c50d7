"""A certificate for the receiver's STARTTLS, made once per test session with openssl."""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.support.testbed import missing

HOSTNAME = "mx.zoneq.test"  # the harness config's server.hostname, and the certificate's name


@dataclass(frozen=True)
class TlsFiles:
    cert: Path
    key: Path
    other_key: Path  # a key that does not belong to ``cert``


def _self_signed(directory: Path, name: str) -> tuple[Path, Path]:
    cert, key = directory / f"{name}.crt", directory / f"{name}.key"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "ec",
            "-pkeyopt",
            "ec_paramgen_curve:prime256v1",
            "-nodes",
            "-days",
            "2",
            "-subj",
            f"/CN={HOSTNAME}",
            "-addext",
            f"subjectAltName=DNS:{HOSTNAME},IP:127.0.0.1",
            "-keyout",
            str(key),
            "-out",
            str(cert),
        ],
        check=True,
        capture_output=True,
        timeout=60,
    )
    return cert, key


@pytest.fixture(scope="session")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    if shutil.which("openssl") is None:
        missing("openssl is not installed")
    directory = tmp_path_factory.mktemp("tls")
    cert, key = _self_signed(directory, "server")
    _, other_key = _self_signed(directory, "other")
    return TlsFiles(cert, key, other_key)
