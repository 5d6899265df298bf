"""One framed connection, the type both ends of every socket channel use: it sends messages,
reads its channel's messages (checked by the channel's parser as they arrive), matches each reply
to its request, and closes. It has two faces over the same framing, as an HTTP client has a
blocking and an async one: `Connection` for the threads of the kernel, the panel's server
extension and a session's rank, `AsyncConnection` for the supervisor's anyio tasks.

`Requests` is the matching alone: a request carries a number (`req`), its reply the same number.
The agents' link uses it directly (its frames travel as ZeroMQ messages, not a byte stream).
"""

from __future__ import annotations

import contextlib
import itertools
import queue
import socket
import threading
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from elastic_nb.protocol.wire import Frame, FrameDecoder, encode

if TYPE_CHECKING:
    from anyio.abc import ByteStream

__all__ = ["AsyncConnection", "Connection", "Gone", "Requests"]

In = TypeVar("In")  # what the channel's parser makes of a frame
R = TypeVar("R")  # a reply

_CHUNK = 1 << 16


class Gone(ConnectionError):
    """The other side is gone (or was never reached): no reply can come."""


class Requests(Generic[R]):
    """Requests in flight on one connection, each numbered (from 1) and waiting for the reply
    that carries its number back. A thread waits with `ask`, a task with `ask_async`; the
    connection's reader hands each reply to `reply`, and `close` ends every wait with Gone."""

    def __init__(self) -> None:
        self._numbers = itertools.count(1)
        self._waiting: dict[int, Callable[[R | None], None]] = {}
        self._closed = False

    def number(self) -> int:
        """The number of the next request."""
        return next(self._numbers)

    def reply(self, req: object, msg: R) -> bool:
        """Hand a reply to the request it answers; False if none waits for it (timed out)."""
        deliver = self._waiting.pop(req, None) if type(req) is int else None
        if deliver is None:
            return False
        deliver(msg)
        return True

    def close(self) -> None:
        self._closed = True
        for deliver in [*self._waiting.values()]:
            deliver(None)
        self._waiting.clear()

    def ask(self, req: int, send: Callable[[], object], timeout: float | None) -> R:
        """Send request `req` (`send` returning False: it could not go) and wait for its reply.
        Raises Gone if it could not go or the connection closed first, TimeoutError if no
        reply came within `timeout`."""
        box: queue.Queue[R | None] = queue.Queue(1)
        self._open(req, box.put)
        try:
            if send() is False:
                raise Gone("the request could not be sent")
            try:
                return self._got(box.get(timeout=timeout))
            except queue.Empty:
                raise TimeoutError from None
        finally:
            self._waiting.pop(req, None)

    async def ask_async(
        self, req: int, send: Callable[[], Awaitable[object]], timeout: float | None
    ) -> R:
        """`ask`, for a task."""
        import anyio

        done, box = anyio.Event(), list[R | None]()

        def deliver(msg: R | None) -> None:
            box.append(msg)
            done.set()

        self._open(req, deliver)
        try:
            if await send() is False:
                raise Gone("the request could not be sent")
            with anyio.fail_after(timeout):
                await done.wait()
            return self._got(box[0])
        finally:
            self._waiting.pop(req, None)

    def _open(self, req: int, deliver: Callable[[R | None], None]) -> None:
        if self._closed:
            raise Gone("the connection is closed")
        self._waiting[req] = deliver

    @staticmethod
    def _got(msg: R | None) -> R:
        if msg is None:
            raise Gone("the connection closed before the reply came")
        return msg


class Connection(Generic[In]):
    """A framed connection on a blocking socket. Any thread may send (whole frames: a lock);
    one thread reads (`receive`, or iterating), handing replies to `requests`."""

    def __init__(self, sock: socket.socket, parse: Callable[[Frame], In]) -> None:
        self.sock = sock
        self.requests = Requests[In]()
        self._parse = parse
        self._decoder = FrameDecoder()
        self._ready: deque[tuple[Frame, bytes | None]] = deque()
        self._send_lock = threading.Lock()

    def send(self, msg: Any, blob: bytes | None = None) -> None:
        """One message (a channel's TypedDict) and its blob; raises OSError if it cannot go."""
        data = encode(msg, blob)
        with self._send_lock:
            self.sock.sendall(data)

    def receive(self) -> tuple[In, bytes | None] | None:
        """The next message and its blob, None at the end of the stream; ProtocolError for a
        frame that is not one of the channel's messages."""
        while not self._ready:
            data = self.sock.recv(_CHUNK)
            if not data:
                return None
            self._ready.extend(self._decoder.feed(data))
        frame, blob = self._ready.popleft()
        return self._parse(frame), blob

    def __iter__(self) -> Iterator[tuple[In, bytes | None]]:
        while (item := self.receive()) is not None:
            yield item

    def shutdown(self) -> None:
        """End both directions now: the reader sees the end, the other side too."""
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)

    def close(self) -> None:
        self.requests.close()
        with contextlib.suppress(OSError):
            self.sock.close()


class AsyncConnection(Generic[In]):
    """A framed connection on an anyio byte stream. Any task may send (whole frames: a lock);
    one task reads (iterating). A send on a broken connection marks it `closed` and is dropped:
    the reader learns of the end from the stream."""

    def __init__(self, stream: ByteStream, parse: Callable[[Frame], In]) -> None:
        import anyio

        self.stream = stream
        self.requests = Requests[In]()
        self.closed = False
        self._parse = parse
        self._decoder = FrameDecoder()
        self._send_lock = anyio.Lock()

    async def send(self, msg: Any, blob: bytes | None = None) -> bool:
        """One message and its blob; False if the connection is closed or broke."""
        import anyio

        if self.closed:
            return False
        data = encode(msg, blob)
        async with self._send_lock:
            try:
                await self.stream.send(data)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                self.closed = True
                return False
        return True

    async def __aiter__(self) -> AsyncIterator[tuple[In, bytes | None]]:
        """Every message until the stream ends (or breaks, or is closed by another task)."""
        import anyio

        ended = (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError)
        while True:
            try:
                data = await self.stream.receive(_CHUNK)
            except ended:
                self.closed = True
                self.requests.close()
                return
            for frame, blob in self._decoder.feed(data):
                yield self._parse(frame), blob

    async def aclose(self) -> None:
        self.closed = True
        self.requests.close()
        with contextlib.suppress(Exception):
            await self.stream.aclose()
