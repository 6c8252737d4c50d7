"""What ``zoneq queue`` makes of names and text the operator or a sender chose: path segments
percent-encoded whole (any spelling is one segment, none can reach another endpoint), table
columns sized by display width, and every input HTTP cannot carry a clear error with the
CLI's exit status, never a traceback.

Pure units, plus ``ApiClient`` and the real command against listeners of the test's own on
127.0.0.1 (a closed port, a server that does not speak HTTP): no ``zoneq serve`` needed.
"""

from __future__ import annotations

import json
import socket
import threading
import unicodedata
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from urllib.parse import unquote

import pytest
from hypothesis import given
from hypothesis import strategies as st

from tests.support.command import zoneq
from zoneq.api.client import ApiClient, ApiError, InvalidRequest, quoted_path
from zoneq.api.command import printable, table

# --- path segments ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("segments", "expected"),
    [
        (("zones", "default", "recipients"), "/zones/default/recipients"),
        (("domains", "bücher.example", "retry"), "/domains/b%C3%BCcher.example/retry"),
        (("zones", "défault"), "/zones/d%C3%A9fault"),
        (("zones", "no such zone"), "/zones/no%20such%20zone"),
        (("messages", "../zones/default", "hold"), "/messages/..%2Fzones%2Fdefault/hold"),
        (("messages", "a?b#c%d"), "/messages/a%3Fb%23c%25d"),
        (("domains", "例子.测试"), "/domains/%E4%BE%8B%E5%AD%90.%E6%B5%8B%E8%AF%95"),
        (("suppression", "*"), "/suppression/%2A"),
        (("zones", "x\r\nHost: evil"), "/zones/x%0D%0AHost%3A%20evil"),
    ],
)
def test_each_segment_is_percent_encoded_whole(segments: tuple[str, ...], expected: str) -> None:
    assert quoted_path(*segments) == expected


@pytest.mark.parametrize("segment", ["", ".", ".."])
def test_segments_a_normalizer_would_remove_are_refused(segment: str) -> None:
    # RFC 3986 section 5.2.4: "messages/../hold" would be "hold", another resource.
    with pytest.raises(InvalidRequest, match="cannot name"):
        quoted_path("messages", segment, "hold")


@given(st.text(min_size=1).filter(lambda s: s not in (".", "..")))
def test_any_name_is_one_segment_that_decodes_back(name: str) -> None:
    quoted = quoted_path("zones", name, "recipients")
    # Printable ASCII with no space: http.client sends it as it is.
    assert quoted.isascii() and quoted.isprintable() and " " not in quoted
    head, zone, tail = quoted.lstrip("/").split("/")
    assert (head, unquote(zone, errors="strict"), tail) == ("zones", name, "recipients")


# --- table widths -----------------------------------------------------------------------


# Terminal columns by the Unicode East Asian Width property (UAX #11) and general category:
# wide (W/F) characters take 2, combining marks (Mn) 0.
@pytest.mark.parametrize(
    ("cell", "columns"),
    [
        ("ann@ok.test", 11),
        ("李@例子.测试", 12),
        ("e\u0301", 1),  # e + COMBINING ACUTE ACCENT: one column, two code points
        ("Grüße", 5),
        ("ｶﾀｶﾅ", 4),  # halfwidth katakana: narrow
        ("\uff21\uff22", 4),  # fullwidth Latin A and B: wide
        ("日本\u3099", 4),
        ("\x1b[2J", 7),  # escaped by printable() first: "\\x1b[2J"
    ],
)
def test_columns_after_a_cell_start_at_its_display_width(cell: str, columns: int) -> None:
    # The widest cell of the first column sets it; the second column starts 2 after.
    lines = table([[cell, "ready"], ["a", "held"]], ["r", "state"]).split("\n")
    width = max(columns, 1)
    assert lines == [
        "r" + " " * (width - 1) + "  state",
        printable(cell) + " " * (width - columns) + "  ready",
        "a" + " " * (width - 1) + "  held",
    ]


WIDE_OR_MARKED = st.text(
    alphabet=st.sampled_from("ab李例子测试日本ｶﾀ\uff21é\u0301\u3099@. "), min_size=1, max_size=8
)


@given(st.lists(st.tuples(WIDE_OR_MARKED, WIDE_OR_MARKED), min_size=1, max_size=6))
def test_every_row_starts_its_columns_at_the_same_display_column(
    rows: list[tuple[str, str]],
) -> None:
    lines = table([[a, b, "|"] for a, b in rows], ["x", "y", "|"]).split("\n")
    # Each line ends with the third column's one-column "|": its display width is the
    # same on every line exactly when the two columns before it are aligned.
    widths = {_display_width(line) for line in lines}
    assert len(widths) == 1, lines


def _display_width(text: str) -> int:
    # Independent of the table's own measure: count by code point properties.
    return sum(
        0 if unicodedata.combining(c) else 2 if unicodedata.east_asian_width(c) in ("W", "F") else 1
        for c in text
    )


# --- ApiClient: faults become ApiError or InvalidRequest, never a traceback ------------


@contextmanager
def not_http(answer_with: bytes = b"SMTP? 220 not http\r\n\r\n") -> Iterator[int]:
    """A listener on 127.0.0.1 that answers one request with ``answer_with`` (by default a
    line that is not HTTP), then closes."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]

    def answer() -> None:
        with server:
            server.settimeout(10)
            try:
                conn, _ = server.accept()
            except OSError:
                return
            with conn:
                conn.recv(65536)
                conn.sendall(answer_with)

    thread = threading.Thread(target=answer, daemon=True)
    thread.start()
    try:
        yield port
    finally:
        thread.join(timeout=15)


def closed_port() -> int:
    with socket.create_server(("127.0.0.1", 0)) as probe:
        return int(probe.getsockname()[1])


def test_an_answer_that_is_not_http_is_an_api_error() -> None:
    with not_http() as port, pytest.raises(ApiError) as caught:
        ApiClient("127.0.0.1", port, "t", timeout=10).call("GET", "/api/v1/queue")
    assert caught.value.status == 0 and "cannot reach the API" in caught.value.message
    assert caught.value.json() == {"error": {"status": 0, "message": caught.value.message}}


@pytest.mark.parametrize(
    ("host", "token"),
    [
        ("127.0.0.1", "bad\r\nX-Injected: 1"),  # a header value with CR LF
        ("127.0.0.1", "tökën-ü\u20ac"),  # outside Latin-1
        ("a..b", "t"),  # an empty label: the idna codec refuses it
        ("bad host", "t"),  # http.client refuses a space in a host
    ],
)
def test_what_http_cannot_carry_is_an_invalid_request(host: str, token: str) -> None:
    with pytest.raises(InvalidRequest, match="cannot send a request"):
        ApiClient(host, closed_port(), token, timeout=10).call("GET", "/api/v1/queue")


def test_a_download_that_breaks_off_is_an_error_and_leaves_no_part(tmp_path: Path) -> None:
    """The API's answer ends before its Content-Length (the server failed to read the
    rest): an error, exit 1, and no partial file that could pass for the message."""
    broken = b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nFrom: a@b.test\r\n"
    target = tmp_path / "message.eml"
    with not_http(broken) as port:
        done = zoneq(
            "queue", "source", "0018bcfe56800000", "-o", str(target),
            "--api", f"127.0.0.1:{port}", "--token", "t",
        )  # fmt: skip
    assert done.returncode == 1, done.stderr
    assert "the download broke off" in done.stderr and "Traceback" not in done.stderr
    assert not target.exists()


# --- the command: exit status and --json on failures -------------------------------------


def test_json_on_a_connection_refused_is_the_api_error_shape_on_stdout() -> None:
    port = closed_port()
    done = zoneq("queue", "counts", "--api", f"127.0.0.1:{port}", "--token", "t", "--json")
    assert done.returncode == 1, done.stderr
    answer = json.loads(done.stdout)
    assert answer["error"]["status"] == 0
    assert f"cannot reach the API at 127.0.0.1:{port}" in answer["error"]["message"]
    assert done.stderr.startswith("zoneq: cannot reach the API") and done.stderr.endswith("(0)\n")


@pytest.mark.parametrize(
    ("args", "said"),
    [
        (("browse", ""), "'' cannot name a zone"),
        (("show", ".."), "'..' cannot name"),
        (("pause", "."), "'.' cannot name"),
        (("counts", "--api", "nowhere"), "invalid listen address 'nowhere'"),
        (("counts", "--token", "x\ny"), "cannot send a request"),
        (("counts", "--api", "a..b:1"), "cannot send a request"),
    ],
)
def test_bad_input_is_a_usage_error_with_nothing_on_stdout(
    args: tuple[str, ...], said: str
) -> None:
    given = list(args)  # nothing may be sent: the closed port would say so (exit 1)
    if "--api" not in given:
        given += ["--api", f"127.0.0.1:{closed_port()}"]
    if "--token" not in given:
        given += ["--token", "t"]
    done = zoneq("queue", *given, "--json")
    assert done.returncode == 2, (done.stdout, done.stderr)
    assert said in done.stderr and "Traceback" not in done.stderr
    assert done.stdout == ""
