"""Who is at the other end of a connection the supervisor (or a join agent) accepted: a Unix
socket's peer, by its credentials (SO_PEERCRED); a loopback TCP connection's, by the kernel's
table of connections. A session rank and a relayed launcher are admitted by these pids.
"""

from __future__ import annotations

import contextlib
import socket
import struct
from typing import Any

import psutil

__all__ = ["connected_from", "peer_pid"]


def peer_pid(sock: socket.socket | None) -> int | None:
    """The pid at the other end of a Unix socket (its credentials, as the kernel took them at
    connect); None for a socket that has none."""
    if sock is None:
        return None
    with contextlib.suppress(OSError):
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid: int = struct.unpack("3i", creds)[0]
        return pid
    return None


def connected_from(pid: int | None, sock: socket.socket) -> bool:
    """Whether the process at the other end of a loopback connection we accepted is `pid`."""
    if pid is None:
        return False
    try:
        ours, theirs = _end(sock.getsockname()), _end(sock.getpeername())
    except OSError:
        return False
    for c in psutil.net_connections("tcp"):
        if c.laddr and c.raddr and (_end(c.laddr), _end(c.raddr)) == (theirs, ours):
            return bool(c.pid == pid)
    return False


def _end(address: Any) -> tuple[str, int]:
    """A TCP endpoint as (IPv4 address, port): torch's store client connects from an IPv6
    socket, whose end is an IPv4-mapped address (::ffff:127.0.0.1)."""
    ip, port = address[0], address[1]
    return ip.removeprefix("::ffff:"), int(port)
