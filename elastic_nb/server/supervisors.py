"""Finding this user's supervisors (elastic_nb.common.registry) and asking them things, for the server
extension. Requests go over the supervisor's private Unix socket, as a non-kernel client
(`protocol.kernel.ROLE_PANEL`): a connection that ends is nothing to the supervisor (only its kernel's
is its lifeline). Blocking calls: the handlers run them in a thread.
"""

from __future__ import annotations

import errno
import socket
from dataclasses import dataclass
from typing import Any

from elastic_nb import protocol
from elastic_nb.common import registry
from elastic_nb.common.registry import runtime_dir

__all__ = ["Supervisor", "SupervisorError", "find"]

TIMEOUT_S = 10.0  # a request the supervisor answers from memory; stacks take a probe round
# connect() on a socket file nobody listens on: the supervisor is gone, its registration stale.
_DEAD = (errno.ECONNREFUSED, errno.ENOENT)


class SupervisorError(RuntimeError):
    """The supervisor refused the request (unknown job, not running) or could not be reached."""

    def __init__(self, message: str, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing


@dataclass(frozen=True)
class Supervisor:
    registration: registry.Registration

    @property
    def pid(self) -> int:
        return self.registration.pid

    @property
    def kernel_id(self) -> str | None:
        return self.registration.kernel_id

    def request(
        self, msg: protocol.kernel.KernelRequest, timeout: float = TIMEOUT_S
    ) -> dict[str, Any]:
        """One request (one connection: its `req` is the only one), its reply's data;
        SupervisorError if refused or unreachable."""
        req = msg["req"] if msg["kind"] != protocol.kernel.HELLO else 0
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            try:
                sock.connect(self.registration.socket)
            except OSError as e:
                if e.errno in _DEAD:
                    registry.forget(self.registration)
                raise SupervisorError(f"supervisor {self.pid} cannot be reached: {e}") from e
            try:
                hello = protocol.kernel.Hello(
                    kind=protocol.kernel.HELLO,
                    version=protocol.wire.VERSION,
                    role=protocol.kernel.ROLE_PANEL,
                )
                sock.sendall(protocol.wire.encode(hello) + protocol.wire.encode(msg))
                return _reply(sock, req, self.pid)
            except OSError as e:
                raise SupervisorError(f"supervisor {self.pid} did not answer: {e}") from e


def _reply(sock: socket.socket, req: int, pid: int) -> dict[str, Any]:
    decoder = protocol.wire.FrameDecoder()
    while True:
        data = sock.recv(1 << 16)
        if not data:
            raise SupervisorError(f"supervisor {pid} closed the connection")
        for frame, _ in decoder.feed(data):
            if frame.get("kind") == protocol.kernel.HELLO and frame.get("error"):
                raise SupervisorError(str(frame["error"]))  # another version of elastic_nb
            msg = protocol.kernel.kernel_news(frame)
            if msg["kind"] == protocol.kernel.REPLY and msg["req"] == req:
                if not msg["ok"]:
                    error = str(msg.get("error"))
                    # The supervisor's refusal of an id it does not know: a KeyError.
                    raise SupervisorError(error, missing=error.startswith("KeyError"))
                return msg["data"]


def find() -> list[Supervisor]:
    """Every live supervisor of this user (registry.find drops the stale)."""
    return [Supervisor(r) for r in registry.find(runtime_dir())]
