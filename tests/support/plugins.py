"""Real plugin modules for tests: written to a directory as files and loaded by path."""

from __future__ import annotations

import textwrap
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from zoneq.config import Config, validate_config
from zoneq.plugin import PluginHost, SenderHeadersArgs

REPO = Path(__file__).resolve().parents[2]
BUNDLED = REPO / "plugins"

ZONES: dict[str, Any] = {"default": {}, "bounces": {}, "bulk": {}, "tx": {}}


def write_plugin(directory: Path, name: str, source: str) -> Path:
    """Write ``source`` (dedented) as ``<directory>/<name>.py`` and return its path."""
    path = directory / f"{name}.py"
    path.write_text(textwrap.dedent(source), encoding="utf-8")
    return path


def config_with(plugins: dict[str, dict[str, Any]], **sections: Any) -> Config:
    """A validated config with ``plugins`` (each table's ``module`` a path) and 4 zones."""
    data: dict[str, Any] = {"zones": ZONES, **sections}
    data["plugins"] = {
        name: {**table, "module": str(table["module"])} for name, table in plugins.items()
    }
    return validate_config(data)


def host_with(plugins: dict[str, dict[str, Any]], **sections: Any) -> PluginHost:
    return PluginHost.from_config(config_with(plugins, **sections))


def sender_args(message: bytes, *, sender: str = "a@src.test", chunk: int = 7) -> SenderHeadersArgs:
    """``sender:headers`` arguments for ``message`` (headers, blank line, body), the body
    served in small chunks as the queue would."""
    head, _, body = message.partition(b"\r\n\r\n")

    async def read_body() -> AsyncIterator[bytes]:
        for start in range(0, len(body), chunk):
            yield body[start : start + chunk]

    return SenderHeadersArgs(
        zone="default",
        message_id="m1",
        sender=sender,
        recipients=("b@dst.test",),
        domain="dst.test",
        headers=head + b"\r\n\r\n",
        body=read_body,
    )
