"""A small test bed for a real ``zoneq serve``: smtp-sink as the MX of ok.test, dnsmasq
answering for it, and a serve config under the test's directory."""

from __future__ import annotations

import random
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from tests.support.dnsmasq import running_dnsmasq
from tests.support.serve import write_serve_config
from tests.support.smtpsink import Sink, run_smtp_sink


@contextmanager
def ok_test_bed(directory: Path) -> Iterator[tuple[Sink, Path]]:
    """smtp-sink as the MX of ok.test, dnsmasq, and a serve config with the API on a free
    port of 127.0.0.1, messages up to 200 MiB, and no token configured (serve generates
    one)."""
    sink_ip = f"127.0.{random.randint(1, 250)}.{random.randint(2, 250)}"
    with run_smtp_sink(host=sink_ip) as sink:
        records = ["mx-host=ok.test,mx.ok.test,10", f"host-record=mx.ok.test,{sink_ip}"]
        with running_dnsmasq(records, directory / "dns") as dns:
            config = write_serve_config(directory / "zoneq", mx_port=sink.port, dns_port=dns.port)
            text = config.read_text().replace(
                "[receiver]\n", '[receiver]\nmax_message_size = "200MiB"\n'
            )
            config.write_text(text)
            yield sink, config
