"""What a receiver process is handed (``supervisor.py``) and how it takes it (``zoneq
receiver``): the listening sockets as inherited descriptors named on its command line, the
implicit-TLS one (``receiver.tls_listen``) only when there is one.  Real sockets on
127.0.0.1 and a real ``python -m zoneq receiver`` process."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from zoneq.cli import build_parser
from zoneq.supervisor import _Sockets


async def _attach(sock: socket.socket, name: str) -> None:
    raise AssertionError("not called: fd_args only names the descriptors")


@pytest.fixture
def listeners() -> Iterator[tuple[socket.socket, socket.socket]]:
    with (
        socket.create_server(("127.0.0.1", 0)) as plain,
        socket.create_server(("127.0.0.1", 0)) as tls,
    ):
        yield plain, tls


@pytest.mark.parametrize("with_tls", [False, True])
def test_each_descriptor_handed_down_is_named_once_and_parses_back(
    listeners: tuple[socket.socket, socket.socket], with_tls: bool
) -> None:
    plain, tls = listeners
    sockets = _Sockets(plain, _attach, tls if with_tls else None)
    fds, args = sockets.fd_args(intake_fd=99)
    expected = (plain.fileno(), 99, tls.fileno()) if with_tls else (plain.fileno(), 99)
    assert fds == expected
    parsed = build_parser(internal_only=True).parse_args(["receiver", "--name", "r", *args])
    assert (parsed.listen_fd, parsed.intake_fd) == (plain.fileno(), 99)
    assert parsed.tls_listen_fd == (tls.fileno() if with_tls else None)
