"""Finding this user's supervisors (elastic_nb.registry) and asking them things, for the server
extension. Requests go over the supervisor's private Unix socket, as a non-kernel client: a
connection that ends is nothing to the supervisor (only its kernel's is its lifeline). Blocking
calls: the handlers run them in a thread.
"""

from __future__ import annotations

import itertools
import socket
from dataclasses import dataclass
from typing import Any

from elastic_nb import protocol, registry
from elastic_nb.client import runtime_dir

__all__ = ["Supervisor", "SupervisorError", "find"]

TIMEOUT_S = 10.0  # a request the supervisor answers from memory; stacks take a probe round


class SupervisorError(RuntimeError):
    """The supervisor refused the request (unknown job, not running) or could not be reached."""

    def __init__(self, message: str, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing


@dataclass(frozen=True)
class Supervisor:
    pid: int
    kernel_id: str | None
    socket: str

    def request(self, kind: str, timeout: float = TIMEOUT_S, **fields: Any) -> dict[str, Any]:
        """One request, its reply's fields; SupervisorError if refused or unreachable."""
        req = next(_REQ)
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(timeout)
                sock.connect(self.socket)
                sock.sendall(
                    protocol.encode(protocol.HELLO, version=protocol.VERSION, role="panel")
                    + protocol.encode(kind, req=req, **fields)
                )
                decoder = protocol.FrameDecoder()
                while True:
                    data = sock.recv(1 << 16)
                    if not data:
                        raise SupervisorError(f"supervisor {self.pid} closed the connection")
                    for msg, _ in decoder.feed(data):
                        if msg["kind"] == protocol.HELLO and msg.get("error"):
                            raise SupervisorError(msg["error"])
                        if msg["kind"] == protocol.REPLY and msg.get("req") == req:
                            if not msg.get("ok"):
                                error = str(msg.get("error"))
                                raise SupervisorError(error, missing=error.startswith("KeyError"))
                            return {k: v for k, v in msg.items() if k not in ("kind", "req", "ok")}
        except OSError as e:
            raise SupervisorError(f"supervisor {self.pid} cannot be reached: {e}") from e


_REQ = itertools.count(1)


def find() -> list[Supervisor]:
    """Every live supervisor of this user (registry.find drops the stale)."""
    return [Supervisor(r.pid, r.kernel_id, r.socket) for r in registry.find(runtime_dir())]
