"""Throughput of the streaming DATA encoder against aiosmtplib's whole-message approach.

With zoneq installed (pip install -e .):  python tools/bench/encoder_bench.py [--megabytes 100]

zoneq feeds the body to ``DotStuffer`` in 64 KiB chunks, as the store hands it out.  aiosmtplib
(``SMTPProtocol.execute_data_command``) takes the whole message as one ``bytes`` and runs
``normalize_message_line_endings`` (a regex turning bare CR/LF into CRLF, then a CRLF appended if
missing), then ``PERIOD_REGEX.sub(b"..", ...)``, then appends ``.`` CRLF.  The same three steps
are timed here with its own function and regex, on the same body joined into one string (the
join is not timed).  aiosmtplib does not fold long lines, so row (d) is not like for like.

MB/s is body octets in, per second, in units of 10**6; best of 3 runs.
"""

from __future__ import annotations

import argparse
import functools
import random
import sys
import time
from collections.abc import Callable

from zoneq.protocol.encoder import dot_stuff

CHUNK = 64 * 1024
BLOCK = 2 * 1024 * 1024  # unique text generated, then repeated up to the wanted size


def _text(rng: random.Random, size: int, line_len: tuple[int, int], dot_every: int) -> bytes:
    """CRLF text of about ``size`` octets; every ``dot_every``-th line starts with "." (0: none)."""
    words = [
        bytes(rng.choices(b"abcdefghijklmnopqrstuvwxyz", k=rng.randint(1, 10))) for _ in range(2000)
    ]
    lines: list[bytes] = []
    total = 0
    while total < size:
        want = rng.randint(*line_len)
        parts: list[bytes] = []
        length = 0
        while length < want:
            word = rng.choice(words)
            parts.append(word)
            length += len(word) + 1
        line = b" ".join(parts)[:want]
        if dot_every and len(lines) % dot_every == 0:
            line = b"." + line[1:]
        lines.append(line)
        total += len(line) + 2
    return b"\r\n".join(lines) + b"\r\n"


def _body(block: bytes, megabytes: int) -> bytes:
    return block * max(1, megabytes * 10**6 // len(block))


def _chunks(body: bytes) -> list[bytes]:
    return [body[i : i + CHUNK] for i in range(0, len(body), CHUNK)]


def _zoneq(chunks: list[bytes]) -> int:
    return sum(len(wire) for wire in dot_stuff(chunks))


def _aiosmtplib_wire(message: bytes) -> bytes:
    from aiosmtplib.protocol import PERIOD_REGEX, normalize_message_line_endings

    message = normalize_message_line_endings(message)
    message = PERIOD_REGEX.sub(b"..", message)
    return message + b".\r\n"


def _aiosmtplib(message: bytes) -> int:
    return len(_aiosmtplib_wire(message))


def _agree(block: bytes) -> None:
    """Sanity check, untimed: without folding, both give the same wire bytes."""
    ours = b"".join(dot_stuff(_chunks(block), max_line_length=0))
    if _aiosmtplib_wire(block) != ours:
        raise SystemExit("zoneq and aiosmtplib disagree on the wire bytes")


def _best_of_3(run: Callable[[], int]) -> float:
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        run()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--megabytes", type=int, default=100, help="body size per case")
    args = parser.parse_args()

    try:
        import aiosmtplib.protocol  # noqa: F401

        have_aiosmtplib = True
    except ImportError:
        have_aiosmtplib = False

    rng = random.Random(5321)
    crlf = _text(rng, BLOCK, (50, 110), 0)
    cases = {
        "(a) CRLF text, ~80-octet lines": crlf,
        "(b) LF-only text": crlf.replace(b"\r\n", b"\n"),
        "(c) CRLF, every 2nd line starts with '.'": _text(rng, BLOCK, (50, 110), 2),
        "(d) CRLF, 1500-2500-octet lines (folded)": _text(rng, BLOCK, (1500, 2500), 0),
    }
    print(f"python {sys.version.split()[0]}, {CHUNK // 1024} KiB chunks, best of 3")
    print(f"{'input':44} {'MB':>6} {'zoneq MB/s':>11} {'aiosmtplib MB/s':>16}")
    for name, block in cases.items():
        body = _body(block, args.megabytes)
        chunks = _chunks(body)
        seconds = _best_of_3(functools.partial(_zoneq, chunks))
        ours = len(body) / seconds / 1e6
        theirs = "n/a"
        if have_aiosmtplib:
            _agree(block)
            seconds = _best_of_3(functools.partial(_aiosmtplib, body))
            theirs = f"{len(body) / seconds / 1e6:.0f}"
        print(f"{name:44} {len(body) / 1e6:6.0f} {ours:11.0f} {theirs:>16}")
        del body, chunks
    if not have_aiosmtplib:
        print("aiosmtplib is not importable: its column was not measured")


if __name__ == "__main__":
    main()
