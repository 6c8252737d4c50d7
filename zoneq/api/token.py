"""The API's bearer token: from the config, from a file, or generated at first start.

With neither ``api.token`` nor ``api.token_file`` set, ``zoneq serve`` generates a random
token (256 bits, ``secrets``) into ``<server.data_dir>/api.token`` with mode 0600 (created
with O_EXCL, so two starts cannot race to different tokens) and logs where it is; the
``zoneq queue`` commands read it from there, so an administrator on the machine needs no
set-up and nobody else can read it.
"""

from __future__ import annotations

import logging
import os
import secrets
import stat
from pathlib import Path
from typing import Final

from zoneq.config import Config
from zoneq.errors import ConfigError

log = logging.getLogger("zoneq.api")

TOKEN_FILE: Final = "api.token"


def default_token_path(config: Config) -> Path:
    return Path(config.server.data_dir) / TOKEN_FILE


def _read(path: Path, key: str) -> str:
    try:
        token = path.read_text().strip().splitlines()
    except OSError as exc:
        raise ConfigError(key, f"cannot read the API token from {path}: {exc}") from exc
    if not token or not token[0]:
        raise ConfigError(key, f"{path} holds no API token")
    return token[0]


def token_path(config: Config) -> tuple[Path, str] | None:
    """The file the token is read from and the key that names it; None for ``api.token``."""
    api = config.api
    if api.token is not None:
        return None
    if api.token_file is not None:
        return Path(api.token_file), "api.token_file"
    return default_token_path(config), "api.token"


def token_warning(config: Config) -> str | None:
    """A warning when the token's file grants group or other read, else None.

    Anyone who can read the token can delete and submit mail through the API.  A warning,
    not a refusal like ssh's "UNPROTECTED PRIVATE KEY FILE": a token file shared on purpose
    (a group of operators) must not stop the mail.
    """
    where = token_path(config)
    if where is None:
        return None
    path, key = where
    try:
        mode = path.stat().st_mode
    except OSError:
        return None  # missing: ``find_token`` says so, or serve creates it 0600
    if not mode & (stat.S_IRGRP | stat.S_IROTH):
        return None
    return (
        f"{key}: {path} is readable by group or others (mode {stat.S_IMODE(mode):04o}); "
        "anyone who reads it can use the API: chmod 600 it"
    )


def find_token(config: Config) -> str | None:
    """The configured token, or the generated one if it exists; None if there is none yet.
    The one read of the token that serve, check-config and the commands all use."""
    where = token_path(config)
    if where is None:
        return config.api.token
    path, key = where
    if config.api.token_file is None and not path.exists():
        return None
    return _read(path, key)


def ensure_token(config: Config) -> str:
    """``find_token``, generating and storing one at first start."""
    token = find_token(config)
    if token is not None:
        if (warning := token_warning(config)) is not None:
            log.warning("%s", warning)
        return token
    path = default_token_path(config)
    path.parent.mkdir(parents=True, exist_ok=True)
    token = secrets.token_urlsafe(32)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        return _read(path, "api.token")  # another start won the race: use its token
    with os.fdopen(fd, "w") as out:
        out.write(token + "\n")
    log.info("generated an API token into %s (mode 0600)", path)
    return token
