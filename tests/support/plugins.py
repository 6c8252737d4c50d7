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


HANGING_PLUGIN = """
import time
from pathlib import Path

from zoneq.plugin import Hook

# A plain (def) handler that hangs for recipients whose local part is "hang": it holds one
# of the plugin's threads until the file options.release exists (bounded, so a test that
# fails still ends), as a plugin stuck in a blocking call without its own timeout would.


def init(app):
    release = Path(app.options["release"])
    hung = Path(app.options["hung"])

    def rcpt_to(args):
        if args.recipient.partition("@")[0] != "hang":
            return None
        with hung.open("a") as out:
            out.write(args.recipient + "\\n")
        deadline = time.monotonic() + 30
        while not release.exists() and time.monotonic() < deadline:
            time.sleep(0.02)
        return None

    app.add_hook(Hook.SMTP_RCPT_TO, rcpt_to)
"""

FAST_PLUGIN = """
from zoneq.plugin import EnhancedStatus, Hook, Reply

# A plain handler at MAIL FROM that answers at once: it needs a thread of its own plugin.


def init(app):
    def mail_from(args):
        if args.sender.startswith("refused@"):
            return Reply(550, ("Sender refused by plugin",), EnhancedStatus(5, 7, 1))
        return None

    app.add_hook(Hook.SMTP_MAIL_FROM, mail_from)
"""


def hanging_plugins(directory: Path, timeout: str = "300ms") -> dict[str, dict[str, Any]]:
    """``[plugins]`` tables: ``hanging`` (``HANGING_PLUGIN``, released by creating
    ``directory/release``; each hung call appends to ``directory/hung``) and ``fast``."""
    options = {"release": str(directory / "release"), "hung": str(directory / "hung")}
    return {
        "hanging": {
            "module": str(write_plugin(directory, "hanging", HANGING_PLUGIN)),
            "timeout": timeout,
            "options": options,
        },
        "fast": {"module": str(write_plugin(directory, "fast", FAST_PLUGIN)), "timeout": timeout},
    }
