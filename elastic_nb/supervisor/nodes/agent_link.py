"""A join agent as the supervisor sees it (`JoinAgentLink`): the orders it is sent, each answer
matched to its order, and its news routed to the group each concerns (its round's site there,
remote_site.RemoteSite, as a `LinkedSite`);
and the connections on its machine it relays (`RelayedStream`), as byte streams here.
"""

from __future__ import annotations

import contextlib
import math
import time
import typing
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

import anyio
from anyio.abc import ByteStream

from elastic_nb import protocol
from elastic_nb.supervisor.nodes.files import NodeFiles, write_chunk

__all__ = ["ANSWER_S", "JoinAgentLink", "LinkedSite", "NodeLost", "RelayedStream"]

R = TypeVar("R")  # an answer's data

# How long an order waits for its agent's answer past the order's own time (a stop's grace,
# a probe's wait): what an agent's machine may take to act and send its files; a teardown never
# waits longer on a machine.
ANSWER_S = 20.0
ORDER_S = 60.0  # an order with no time of its own (an open: a launcher taken; a cell's files)


class LinkedSite(Protocol):
    """What hears a group's news from the agent: its round's site there (remote_site.RemoteSite,
    as the link sees it)."""

    round: int | None  # the round's attempt

    def on_beat(self, beat: protocol.agents.GroupBeat) -> None: ...
    def on_news(self, msg: protocol.agents.NodeNews) -> None: ...
    def on_lost(self, why: str, at: float) -> None:
        """The agent is gone: the round's ranks with it, as of `at` (last heard from)."""

    async def on_stream(self, stream: ByteStream, to: str, peer: int | None) -> None:
        """A connection from the agent's machine, relayed (`to`: which listener it reached)."""


class NodeLost(ConnectionError):
    """The agent left (or was dropped) before it answered."""


class RelayedStream(ByteStream):
    """A connection on an agent's machine (a launcher's to the store, a session rank's to its
    session), as a byte stream here: what it sends arrives as the agent's stream_data."""

    def __init__(self, agent: JoinAgentLink, group: str, stream: int) -> None:
        self._agent, self._group, self._stream = agent, group, stream
        self._in, self._out = anyio.create_memory_object_stream[bytes](math.inf)
        self._closed = False

    def feed(self, data: bytes) -> None:
        with contextlib.suppress(anyio.ClosedResourceError, anyio.BrokenResourceError):
            self._in.send_nowait(data)

    def ended(self) -> None:
        """The other end closed."""
        self._in.close()

    async def receive(self, max_bytes: int = 65536) -> bytes:
        try:
            return await self._out.receive()
        except anyio.EndOfStream:
            raise anyio.EndOfStream from None

    async def send(self, item: bytes) -> None:
        if self._closed:
            raise anyio.ClosedResourceError
        msg = protocol.agents.StreamData(
            kind=protocol.agents.STREAM_DATA, group=self._group, stream=self._stream
        )
        if not await self._agent.send(msg, item):
            raise anyio.BrokenResourceError

    async def send_eof(self) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        if not self._closed:
            self._closed = True
            self._in.close()
            msg = protocol.agents.StreamClose(
                kind=protocol.agents.STREAM_CLOSE, group=self._group, stream=self._stream
            )
            await self._agent.send(msg)


class JoinAgentLink:
    """One join agent, as the supervisor sees it."""

    def __init__(
        self,
        send: Callable[[bytes, protocol.Message, bytes | None], Awaitable[bool]],
        spawn: Callable[..., None],
        peer: bytes,
        number: int,
        info: protocol.records.NodeInfo,
        endpoint: str,
    ) -> None:
        self._send = send
        self.spawn = spawn  # a task of the cluster's (it outlives any group)
        self.peer = peer
        self.number = number
        self.info = info
        self.endpoint = endpoint  # "ip:port" of its connection, as the monitor names it
        self.joined = time.time()
        self.last_heard = time.monotonic()
        self.last_heard_wall = time.time()
        self.state = "ready"  # ready, lost, left
        self.why: str | None = None  # why it is no longer ready
        self.clock_offset: float | None = None  # ours - its wall clock (the least one seen)
        self.sites: dict[str, LinkedSite] = {}  # group -> its current round's site there
        self.dirs: dict[tuple[str, str], Path] = {}  # (group, root) -> the run directory here
        self.streams: dict[tuple[str, int], RelayedStream] = {}
        self.files = NodeFiles(f"{number}-{info['name']}")  # what it may write here
        self._refused_files: set[tuple[str, str]] = set()  # said once each
        self._requests = protocol.connection.Requests[protocol.agents.Answer]()
        self.lost = anyio.Event()

    @property
    def name(self) -> str:
        return self.info["name"]

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def label(self) -> str:
        return f"node {self.number} ({self.name})"

    async def send(self, msg: protocol.Message, blob: bytes | None = None) -> bool:
        if self.state != "ready":
            return False
        return await self._send(self.peer, msg, blob)

    async def request(
        self,
        msg: protocol.agents.Request,
        answer: type[R],
        blob: bytes | None = None,
        timeout: float = ORDER_S,
    ) -> R:
        """Send an order, numbered here, and wait for its answer's data (of the type `answer`,
        which protocol.agents.ANSWERS names for the order). Raises NodeLost if the agent goes
        first or does not answer within `timeout` (its order's own time, then the way back),
        RuntimeError with the agent's words if it failed."""
        kind = msg["kind"]
        assert protocol.agents.ANSWERS[kind] is answer, f"{kind} is answered with another type"
        req = self._requests.number()
        order = typing.cast(protocol.agents.Request, {**msg, "req": req})
        try:
            said = await self._requests.ask_async(req, lambda: self.send(order, blob), timeout)
        except protocol.connection.Gone:
            raise NodeLost(f"{self.label()}, {kind}: {self.why or 'it left'}") from None
        except TimeoutError:
            raise NodeLost(f"{self.label()}, {kind}: no answer in {timeout:g} s") from None
        if not said["ok"]:
            raise RuntimeError(f"{self.label()}: {said.get('error', 'failed')}")
        return typing.cast(
            R, protocol.wire.check_reply(protocol.agents.ANSWERS, kind, said["data"])
        )

    def heard(self, t: float | None = None) -> None:
        now_wall = time.time()
        self.last_heard = time.monotonic()
        self.last_heard_wall = now_wall
        if t is not None:
            offset = now_wall - t  # its clock + the message's way here: the least is nearest
            if self.clock_offset is None or offset < self.clock_offset:
                self.clock_offset = offset

    def dispatch(self, msg: protocol.agents.NodeNews, blob: bytes | None) -> None:
        """The agent's news, to whom it concerns (its kind's handler in `_NEWS`)."""
        handler = _NEWS.get(msg["kind"])
        if handler is None:  # the handshake's hello, or bye: the cluster's
            raise protocol.wire.ProtocolError(f"{msg['kind']!r} from an agent that has joined")
        handler(self, msg, blob)

    # ---- the agent's news (each its handler in _NEWS) ------------------------------------------

    def _on_beat(self, msg: protocol.agents.Beat, _b: bytes | None) -> None:
        for group, beat in msg["groups"].items():
            site = self.sites.get(group)
            if site is not None and site.round == beat["round"]:
                site.on_beat(beat)

    def _on_answer(self, msg: protocol.agents.Answer, _b: bytes | None) -> None:
        self._requests.reply(msg["req"], msg)

    def _on_file(self, msg: protocol.agents.FileChunk, blob: bytes | None) -> None:
        top = self.dirs.get((msg["group"], msg["root"]))
        if top is None:
            raise protocol.wire.ProtocolError(f"a file of an unknown group: {msg['group']}")
        try:
            self.files.admit(msg["group"], msg["path"], msg["offset"], len(blob or b""))
            write_chunk(top, msg["path"], msg["offset"], blob or b"")
        except ValueError as e:
            key = (msg["group"], msg["path"])
            if key not in self._refused_files:  # its next chunks are dropped unsaid
                self._refused_files.add(key)
                raise ValueError(f"{self.label()} sent {e}") from None

    def _on_stream_open(self, msg: protocol.agents.StreamOpen, _b: bytes | None) -> None:
        site = self.sites.get(msg["group"])
        if site is None:
            raise protocol.wire.ProtocolError(f"a stream of an unknown group: {msg['group']}")
        stream = RelayedStream(self, msg["group"], msg["stream"])
        self.streams[(msg["group"], msg["stream"])] = stream
        self.spawn(site.on_stream, stream, msg["to"], msg["peer"])

    def _on_stream_data(self, msg: protocol.agents.StreamData, blob: bytes | None) -> None:
        relayed = self.streams.get((msg["group"], msg["stream"]))
        if relayed is not None:
            relayed.feed(blob or b"")

    def _on_stream_close(self, msg: protocol.agents.StreamClose, _b: bytes | None) -> None:
        relayed = self.streams.pop((msg["group"], msg["stream"]), None)
        if relayed is not None:
            relayed.ended()

    def _on_launcher(self, msg: protocol.agents.LauncherSaid, blob: bytes | None) -> None:
        # Checked before anything is taken from it (its site reads it again, checked).
        said = protocol.launcher.launcher_news(msg["msg"])
        protocol.launcher.hear(said, _Starts(self.files, msg["group"]))
        self._on_group_news(msg, blob)

    def _on_group_news(
        self,
        msg: (
            protocol.agents.LauncherSaid
            | protocol.agents.LauncherExit
            | protocol.agents.RankGone
            | protocol.agents.MemoryRead
        ),
        _b: bytes | None,
    ) -> None:
        """A group's news (its launcher's word and exit, a rank gone, memory), to its site: the
        site of its round (protocol.agents: a closed round's news can come after the next round
        has opened there; nobody listens to it any more)."""
        site = self.sites.get(msg["group"])
        if site is None or site.round != msg["round"]:
            return
        site.on_news(msg)

    def gone(self, state: str, why: str) -> None:
        """It left (`left`: it said bye) or was lost: everything waiting on it learns so."""
        if self.state != "ready":
            return
        self.state, self.why = state, why
        self.lost.set()
        self._requests.close()
        for stream in self.streams.values():
            stream.ended()
        self.streams.clear()
        for site in list(self.sites.values()):
            site.on_lost(why, self.last_heard_wall)

    def describe(self) -> protocol.kernel.JoinedMachine:
        return protocol.kernel.JoinedMachine(
            **self.info,
            node=self.number,
            state=self.state,
            why=self.why,
            joined=self.joined,
            last_heard_s=time.monotonic() - self.last_heard,
            groups=sorted(self.sites),
        )


# Each piece of news on the agents' channel from a joined agent, and its handler (an JoinAgentLink
# method); its hello and bye are the cluster's.
_NEWS: dict[str, Callable[[JoinAgentLink, Any, bytes | None], None]] = {
    protocol.agents.BEAT: JoinAgentLink._on_beat,
    protocol.agents.ANSWER: JoinAgentLink._on_answer,
    protocol.agents.FILE: JoinAgentLink._on_file,
    protocol.agents.STREAM_OPEN: JoinAgentLink._on_stream_open,
    protocol.agents.STREAM_DATA: JoinAgentLink._on_stream_data,
    protocol.agents.STREAM_CLOSE: JoinAgentLink._on_stream_close,
    protocol.agents.LAUNCHER: JoinAgentLink._on_launcher,
    protocol.agents.LAUNCHER_EXIT: JoinAgentLink._on_group_news,
    protocol.agents.RANK_GONE: JoinAgentLink._on_group_news,
    protocol.agents.MEMORY: JoinAgentLink._on_group_news,
}


class _Starts(protocol.launcher.Listener):
    """A rank an agent's launcher started: its files are mirrored home from then on."""

    def __init__(self, files: NodeFiles, group: str) -> None:
        self.files, self.group = files, group

    def started(self, msg: protocol.launcher.Start) -> None:
        self.files.started(self.group, msg["attempt"], msg["rank"])
