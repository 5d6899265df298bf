"""A join agent's relayed connections: what a group's processes on the agent's machine open to
the notebook's machine (a launcher's to the rendezvous store, a session rank's to the session's
socket) reaches a listener of the agent's instead, on loopback or in an owner-only directory,
and travels over the channel as a stream (stream_open, stream_data, stream_close): nothing of a
job listens beyond this machine but what gloo and NCCL must.

What a connection sends is read here and sent on; what the supervisor sends back is written to
the connection by one task, in the order it came.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
import socket
from collections.abc import Awaitable, Callable, Coroutine
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import ByteStream, SocketListener, TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from elastic_nb import protocol
from elastic_nb.supervisor.processes.peers import connected_from, peer_pid

__all__ = ["Relay"]

_READ = 1 << 16
Send = Callable[[protocol.Message, bytes | None], Awaitable[None]]


class Relay:
    """Every relayed connection of the agent's groups, by group and stream number."""

    def __init__(self, send: Send) -> None:
        self._send = send
        self._numbers = itertools.count(1)
        # What the supervisor sends to each connection, in order (one writer each).
        self._inboxes: dict[tuple[str, int], MemoryObjectSendStream[bytes]] = {}

    async def store(
        self, group: str, launcher: Callable[[], int | None], tg: TaskGroup
    ) -> tuple[SocketListener, int]:
        """A listener on loopback for the group's launchers' connections to the rendezvous
        store, and its port. torch's agent, the store's one client, unpickles its state: only
        the round's launcher (`launcher()`, its pid) may connect, not another local user's
        process."""
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.bind(("127.0.0.1", 0))
        sock.listen(socket.SOMAXCONN)
        listener = await SocketListener.from_socket(sock)

        async def admit(stream: ByteStream) -> None:
            raw = stream.extra(anyio.abc.SocketAttribute.raw_socket)
            if not await anyio.to_thread.run_sync(connected_from, launcher(), raw):
                await stream.aclose()
                return
            await self._carry(group, stream, protocol.agents.STREAM_STORE, None)

        tg.start_soon(_accept, listener, admit, tg)
        return listener, sock.getsockname()[1]

    async def sessions(self, group: str, path: Path, tg: TaskGroup) -> SocketListener:
        """A Unix socket, owner only, for the group's session ranks (each names itself in its
        hello; the supervisor checks its pid, which the relay passes on)."""
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        listener = await anyio.create_unix_listener(path)
        os.chmod(path, 0o600)

        async def carry(stream: ByteStream) -> None:
            raw = stream.extra(anyio.abc.SocketAttribute.raw_socket, None)
            await self._carry(group, stream, protocol.agents.STREAM_SESSION, peer_pid(raw))

        tg.start_soon(_accept, listener, carry, tg)
        return listener

    def deliver(
        self, msg: protocol.agents.StreamData | protocol.agents.StreamClose, blob: bytes | None
    ) -> None:
        """The supervisor's side of a relayed connection, to its writer here."""
        inbox = self._inboxes.get((msg["group"], msg["stream"]))
        if inbox is None:
            return
        if msg["kind"] == protocol.agents.STREAM_DATA and blob:
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                inbox.send_nowait(blob)
        elif msg["kind"] == protocol.agents.STREAM_CLOSE:
            inbox.close()

    def close(self, group: str) -> None:
        """The group has ended: its connections are closed (by their writers)."""
        for (g, _), inbox in list(self._inboxes.items()):
            if g == group:
                inbox.close()

    async def _carry(self, group: str, stream: ByteStream, to: str, peer: int | None) -> None:
        n = next(self._numbers)
        inbox, outbox = anyio.create_memory_object_stream[bytes](math.inf)
        self._inboxes[(group, n)] = inbox
        try:
            await self._send(
                protocol.agents.StreamOpen(
                    kind=protocol.agents.STREAM_OPEN, group=group, stream=n, to=to, peer=peer
                ),
                None,
            )
            async with anyio.create_task_group() as tg:
                tg.start_soon(_write_all, stream, outbox)
                while True:
                    try:
                        data = await stream.receive(_READ)
                    except (
                        anyio.EndOfStream,
                        anyio.BrokenResourceError,
                        anyio.ClosedResourceError,
                    ):
                        break
                    await self._send(
                        protocol.agents.StreamData(
                            kind=protocol.agents.STREAM_DATA, group=group, stream=n
                        ),
                        data,
                    )
                tg.cancel_scope.cancel()
        finally:
            self._inboxes.pop((group, n), None)
            inbox.close()
            with contextlib.suppress(Exception):  # the channel may be gone with the supervisor
                await self._send(
                    protocol.agents.StreamClose(
                        kind=protocol.agents.STREAM_CLOSE, group=group, stream=n
                    ),
                    None,
                )
            with contextlib.suppress(Exception):
                await stream.aclose()


async def _accept(
    listener: SocketListener,
    handler: Callable[[ByteStream], Coroutine[Any, Any, None]],
    tg: TaskGroup,
) -> None:
    """Each connection to `handler`, in `tg`, until the listener is closed (the group ended)."""
    while True:
        try:
            stream = await listener.accept()
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            return
        tg.start_soon(handler, stream)


async def _write_all(stream: ByteStream, outbox: MemoryObjectReceiveStream[bytes]) -> None:
    """What the supervisor sends to a relayed connection, in order; the connection closed
    once it has said its last (or the connection broke)."""
    async with outbox:
        async for data in outbox:
            try:
                await stream.send(data)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                return
    with contextlib.suppress(Exception):
        await stream.aclose()
