"""``zoneq check-config`` gives the verdict ``zoneq serve`` gives (issue 4), as real processes.

Each config here once passed check-config and then crashed serve, or started a serve that
could never deliver: both must now refuse it, naming the key, with no traceback.  serve
refuses before it opens the queue or binds a port, so nothing is left running.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.command import zoneq
from tests.support.serve import set_config_line, write_serve_config

pytestmark = pytest.mark.integration


@pytest.mark.parametrize(
    ("section", "line", "key"),
    [
        ("storage", 'event_retention = "100000d"', "storage.event_retention"),
        ("delivery", 'nameservers = ["not-an-ip"]', "delivery.nameservers[0]"),
        ("server", 'data_dir = ""', "server.data_dir"),
        ("receiver", 'listen = "no such host:2525"', "receiver.listen"),
        # Serve named no key for an address not of this host, and had opened the queue.
        ("receiver", 'listen = "192.0.2.1:2525"', "receiver.listen"),
    ],
)
def test_check_config_and_serve_both_refuse(
    tmp_path: Path, section: str, line: str, key: str
) -> None:
    config = write_serve_config(tmp_path / "zoneq", mx_port=25, dns_port=53)
    if section == "storage":
        config.write_text(config.read_text() + "\n[storage]\n")
    set_config_line(config, section, line)
    checked = zoneq("check-config", str(config), timeout=60)
    served = zoneq("serve", "--config", str(config), timeout=60)
    for done in (checked, served):
        assert done.returncode != 0, done.stderr
        assert "Traceback" not in done.stderr, done.stderr
        assert f"{key}: " in done.stderr, done.stderr
    assert not (tmp_path / "zoneq" / "queue").exists()  # refused before opening anything
