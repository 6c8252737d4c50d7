"""``zoneq serve`` with ``receiver.processes``: finding its receiver processes.

``tests/support/serve.py`` knows a child as ready once the core logged its worker hello;
a receiver process is ready once the core logged ``receiver pid N (NAME) connected`` (its
intake socket is up), so ``ReceiverServe`` counts both.  ``owner_of`` finds which receiver
process holds a client's TCP connection (``/proc/net/tcp`` gives the socket's inode, and
``/proc/<pid>/fd`` who has it open), so a test can kill exactly that one.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path

from tests.support.serve import Serve, alive, start_serve

CONNECTED = re.compile(r"receiver pid (\d+) \((\S+)\) connected")


@dataclass
class ReceiverServe(Serve):
    def connected(self) -> set[int]:
        return super().connected() | set(self.receivers())

    def receivers(self) -> list[int]:
        """PIDs of the receiver processes that connected to the core and still run."""
        pids = [int(pid) for pid, _ in CONNECTED.findall(self.log_text())]
        return [pid for pid in dict.fromkeys(pids) if alive(pid)]

    def receiver_names(self) -> dict[int, str]:
        return {int(pid): name for pid, name in CONNECTED.findall(self.log_text())}


def start_receiver_serve(config: Path, log: Path) -> ReceiverServe:
    serve = start_serve(config, log)
    return ReceiverServe(serve.process, serve.config, serve.log, serve.started)


def _socket_inode(server_port: int, client_port: int) -> int | None:
    """The inode of the server side of 127.0.0.1:client_port -> :server_port."""
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        local_port = int(fields[1].split(":")[1], 16)
        remote_port = int(fields[2].split(":")[1], 16)
        if local_port == server_port and remote_port == client_port:
            return int(fields[9])
    return None


def owner_of(pids: list[int], server_port: int, client_port: int) -> int | None:
    """Which of ``pids`` holds the accepted socket of a client's connection."""
    inode = _socket_inode(server_port, client_port)
    if inode is None:
        return None
    target = f"socket:[{inode}]"
    for pid in pids:
        fd_dir = Path(f"/proc/{pid}/fd")
        try:
            links = [os.readlink(fd_dir / fd) for fd in os.listdir(fd_dir)]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if target in links:
            return pid
    return None
