"""Finding this user's supervisors (elastic_nb.common.registry) and asking them things, for the server
extension. Requests go over the supervisor's private Unix socket, as a non-kernel client
(`protocol.kernel.ROLE_PANEL`): a connection that ends is nothing to the supervisor (only its kernel's
is its lifeline). Blocking calls: the handlers run them in a thread.
"""

from __future__ import annotations

import errno
import socket
import typing
from dataclasses import dataclass
from typing import TypeVar

from elastic_nb import protocol
from elastic_nb.common import registry
from elastic_nb.common.registry import runtime_dir

__all__ = ["RegisteredSupervisor", "SupervisorError", "find"]

TIMEOUT_S = 10.0  # a request the supervisor answers from memory; stacks take a probe round
# connect() on a socket file nobody listens on: the supervisor is gone, its registration stale.
_DEAD = (errno.ECONNREFUSED, errno.ENOENT)
R = TypeVar("R")


class SupervisorError(RuntimeError):
    """The supervisor refused the request (unknown job, not running) or could not be reached."""

    def __init__(self, message: str, missing: bool = False) -> None:
        super().__init__(message)
        self.missing = missing


@dataclass(frozen=True)
class RegisteredSupervisor:
    registration: registry.Registration

    @property
    def pid(self) -> int:
        return self.registration.pid

    @property
    def kernel_id(self) -> str | None:
        return self.registration.kernel_id

    def request(
        self, msg: protocol.kernel.Request, reply: type[R], timeout: float = TIMEOUT_S
    ) -> R:
        """One request (one connection: its `req` is the only one), its reply's data (of the type
        `reply`); SupervisorError if refused or unreachable."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
            sock.settimeout(timeout)
            try:
                sock.connect(self.registration.socket)
            except OSError as e:
                if e.errno in _DEAD:
                    registry.forget(self.registration)
                raise SupervisorError(f"supervisor {self.pid} cannot be reached: {e}") from e
            conn = protocol.connection.Connection(sock, protocol.kernel.kernel_news)
            hello = protocol.kernel.Hello(
                kind=protocol.kernel.HELLO,
                version=protocol.wire.VERSION,
                role=protocol.kernel.ROLE_PANEL,
            )
            try:
                conn.send(hello)
                conn.send(msg)
                for answer, _ in conn:
                    if answer["kind"] == protocol.kernel.HELLO and answer.get("error"):
                        raise SupervisorError(str(answer["error"]))  # another elastic_nb version
                    if answer["kind"] == protocol.kernel.REPLY and answer["req"] == msg["req"]:
                        return typing.cast(R, self._data(msg["kind"], answer))
            except OSError as e:
                raise SupervisorError(f"supervisor {self.pid} did not answer: {e}") from e
        raise SupervisorError(f"supervisor {self.pid} closed the connection")

    @staticmethod
    def _data(kind: str, answer: protocol.kernel.Reply) -> protocol.wire.Frame:
        if not answer["ok"]:
            error = str(answer.get("error"))
            # The supervisor's refusal of an id it does not know: a KeyError.
            raise SupervisorError(error, missing=error.startswith("KeyError"))
        return protocol.wire.check_reply(protocol.kernel.REPLIES, kind, answer["data"])


def find() -> list[RegisteredSupervisor]:
    """Every live supervisor of this user (registry.find drops the stale)."""
    return [RegisteredSupervisor(r) for r in registry.find(runtime_dir())]
