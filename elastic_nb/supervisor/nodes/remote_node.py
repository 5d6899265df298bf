"""A node on another machine: a join agent as the supervisor sees it (`AgentLink`: its orders,
the answers awaited, its news routed to the group each concerns), and one group's round on it
(`RemoteNode`), through its channel.

The second implementation of `processes.node.Node`: the group asks it what it asks a
`LocalNode`, and the agent answers with its own `LocalNode` there. What the group must know at
once (is a rank alive, a zombie, how the launcher is doing, its ranks' memory) comes in the
agent's heartbeat and news and is read here without asking; what takes the ranks' answer (their
stacks, a flight-recorder probe) or the agent's action (a signal, the teardown) is an order. The
ranks' files are mirrored into the group's run directory as they grow, so the run directory's
readers need no node at all.

When the agent is lost, every rank it ran for the group is gone at the moment it was last
heard from, marked as lost with the reason: a departure is a failure of that node's ranks, and
the group restarts (or ends) as for any failure.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import ByteStream

from elastic_nb import protocol
from elastic_nb.common.host_memory import MemoryLimit
from elastic_nb.common.rundir import RunDir
from elastic_nb.common.spec import JobSpec
from elastic_nb.supervisor.forensics.watchdogs import Agent
from elastic_nb.supervisor.nodes.files import INPUTS, NodeFiles, pack, write_chunk
from elastic_nb.supervisor.processes.node import MemoryReading, Node, StackDump, Survivor
from elastic_nb.supervisor.ranks.rank_state import RankState

__all__ = ["AgentLink", "NodeLost", "RelayedStream", "RemoteNode"]

# A session rank's relayed connection: the stream, its pid as the agent saw it, the node.
SessionStreams = Callable[[ByteStream, int | None, Node], Awaitable[None]]

# How long an order waits for its agent's answer past the order's own time (a stop's grace,
# a probe's wait): what a node's machine may take to act and send its files; a teardown never
# waits longer on a machine.
ANSWER_S = 20.0
ORDER_S = 60.0  # an order with no time of its own (an open: a launcher taken; a cell's files)

log = logging.getLogger(__name__)


class NodeLost(ConnectionError):
    """The agent left (or was dropped) before it answered."""


class RelayedStream(ByteStream):
    """A connection on an agent's machine (a launcher's to the store, a session rank's to its
    session), as a byte stream here: what it sends arrives as the agent's stream_data."""

    def __init__(self, agent: AgentLink, group: str, stream: int) -> None:
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


class AgentLink:
    """One join agent, as the supervisor sees it."""

    def __init__(
        self,
        send: Callable[[bytes, protocol.Message, bytes | None], Awaitable[bool]],
        spawn: Callable[..., None],
        peer: bytes,
        number: int,
        info: protocol.agents.NodeInfo,
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
        self.nodes: dict[str, RemoteNode] = {}  # group -> its current round's node here
        self.dirs: dict[tuple[str, str], Path] = {}  # (group, root) -> the run directory here
        self.streams: dict[tuple[str, int], RelayedStream] = {}
        self.files = NodeFiles(f"{number}-{info['name']}")  # what it may write here
        self._refused_files: set[tuple[str, str]] = set()  # said once each
        self._answers: dict[int, tuple[anyio.Event, list[protocol.agents.Answer]]] = {}
        self._reqs = itertools.count(1)
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
        self, msg: Any, blob: bytes | None = None, timeout: float = ORDER_S
    ) -> dict[str, Any]:
        """Send an order carrying a request number; its answer's data. Raises NodeLost if the
        agent goes first or does not answer within `timeout` (its order's own time, then the
        way back), RuntimeError with the agent's words if it failed."""
        req = next(self._reqs)
        msg = {**msg, "req": req}
        done, box = anyio.Event(), list[protocol.agents.Answer]()
        self._answers[req] = (done, box)
        try:
            if not await self.send(msg, blob):
                raise NodeLost(f"{self.label()} is gone: {self.why or 'it left'}")
            with anyio.move_on_after(timeout):
                await done.wait()  # set by the answer, or by gone()
            if not box:
                why = self.why if self.state != "ready" else f"no answer in {timeout:g} s"
                raise NodeLost(f"{self.label()}, {msg['kind']}: {why}")
            answer = box[0]
            if not answer["ok"]:
                raise RuntimeError(f"{self.label()}: {answer.get('error', 'failed')}")
            data: dict[str, Any] = answer["data"]
            return data
        finally:
            self._answers.pop(req, None)

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
            node = self.nodes.get(group)
            if node is not None:
                node.on_beat(beat)

    def _on_answer(self, msg: protocol.agents.Answer, _b: bytes | None) -> None:
        waiting = self._answers.get(msg["req"])
        if waiting is not None:
            waiting[1].append(msg)
            waiting[0].set()

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
        node = self.nodes.get(msg["group"])
        if node is None:
            raise protocol.wire.ProtocolError(f"a stream of an unknown group: {msg['group']}")
        stream = RelayedStream(self, msg["group"], msg["stream"])
        self.streams[(msg["group"], msg["stream"])] = stream
        self.spawn(node.on_stream, stream, msg["to"], msg["peer"])

    def _on_stream_data(self, msg: protocol.agents.StreamData, blob: bytes | None) -> None:
        relayed = self.streams.get((msg["group"], msg["stream"]))
        if relayed is not None:
            relayed.feed(blob or b"")

    def _on_stream_close(self, msg: protocol.agents.StreamClose, _b: bytes | None) -> None:
        relayed = self.streams.pop((msg["group"], msg["stream"]), None)
        if relayed is not None:
            relayed.ended()

    def _on_launcher(self, msg: protocol.agents.LauncherSaid, blob: bytes | None) -> None:
        said = msg["msg"]
        if said.get("kind") == protocol.launcher.START:
            self.files.started(msg["group"], int(said["attempt"]), int(said["rank"]))
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
        """A group's news (its launcher's word and exit, a rank gone, memory), to its node."""
        node = self.nodes.get(msg["group"])
        if node is None:
            return  # the news of a round that has been closed here: nobody listens any more
        node.on_news(msg)

    def gone(self, state: str, why: str) -> None:
        """It left (`left`: it said bye) or was lost: everything waiting on it learns so."""
        if self.state != "ready":
            return
        self.state, self.why = state, why
        self.lost.set()
        for done, _ in self._answers.values():
            done.set()
        for stream in self.streams.values():
            stream.ended()
        self.streams.clear()
        for node in list(self.nodes.values()):
            node.on_lost(why, self.last_heard_wall)

    def describe(self) -> dict[str, Any]:
        return {
            "node": self.number,
            **self.info,
            "state": self.state,
            "why": self.why,
            "joined": self.joined,
            "last_heard_s": time.monotonic() - self.last_heard,
            "groups": sorted(self.nodes),
        }


# Each piece of news on the agents' channel from a joined agent, and its handler (an AgentLink
# method); its hello and bye are the cluster's.
_NEWS: dict[str, Callable[[AgentLink, Any, bytes | None], None]] = {
    protocol.agents.BEAT: AgentLink._on_beat,
    protocol.agents.ANSWER: AgentLink._on_answer,
    protocol.agents.FILE: AgentLink._on_file,
    protocol.agents.STREAM_OPEN: AgentLink._on_stream_open,
    protocol.agents.STREAM_DATA: AgentLink._on_stream_data,
    protocol.agents.STREAM_CLOSE: AgentLink._on_stream_close,
    protocol.agents.LAUNCHER: AgentLink._on_launcher,
    protocol.agents.LAUNCHER_EXIT: AgentLink._on_group_news,
    protocol.agents.RANK_GONE: AgentLink._on_group_news,
    protocol.agents.MEMORY: AgentLink._on_group_news,
}


class RemoteNode(Node):
    def __init__(
        self,
        rd: RunDir,
        agent: AgentLink,
        store_port: int,
        session_streams: SessionStreams | None,
        ship: dict[str, Path],
    ) -> None:
        """`store_port`: the group's rendezvous store here (its launchers' connections are
        relayed to it); `session_streams`: who takes a session rank's connection; `ship`: the
        files the group's ranks read there, the first time the agent serves the group."""
        super().__init__(rd, agent.number, agent.name)
        self.link = agent
        self._store_port = store_port
        self._session_streams = session_streams
        self._ship = ship
        self._group: str | None = None
        self._news, self._said = anyio.create_memory_object_stream[protocol.launcher.LauncherNews](
            math.inf
        )
        self._launcher: int | None = None
        self._launcher_alive = False
        self._exited = anyio.Event()
        self._outcome: tuple[str, str] = ("failed", "its node never reported")
        self._gone: dict[tuple[int, int], anyio.Event] = {}
        self._seen_gone: dict[tuple[int, int], tuple[float, int | None]] = {}
        self._beat: protocol.agents.GroupBeat | None = None
        self._beat_at: float | None = None
        self._reading = MemoryReading({}, {}, None, gpus=False)
        self.lost: str | None = None

    @property
    def label(self) -> str:
        return self.link.label()

    # ---- the launcher --------------------------------------------------------------------------

    async def start(
        self,
        group: str,
        spec: JobSpec,
        env: dict[str, str],
        plan: protocol.launcher.LaunchRound | None = None,
    ) -> bool:
        assert plan is not None, "a node on another machine runs multi-node rounds only"
        self._group = group
        agent = self.link
        files = b""
        if (group, "") not in agent.dirs:  # the agent has not served this group yet
            files = await anyio.to_thread.run_sync(pack, self._ship)
            agent.dirs[(group, "")] = self.rd.path
        agent.nodes[group] = self
        self.clock_offset = agent.clock_offset or 0.0
        order = protocol.agents.Open(
            kind=protocol.agents.OPEN,
            req=0,
            group=group,
            spec=spec.to_dict(),
            env=dict(spec.env),
            round={k: plan[k] for k in ("attempt", "nnodes", "run_id", "key")},
            session=spec.session,
        )
        try:
            answer = await agent.request(order, files)
        except NodeLost:
            self.on_lost(agent.why or "it left", agent.last_heard_wall)
            return False
        self._launcher = answer.get("launcher")
        self._launcher_alive = True
        return bool(answer.get("warm"))

    async def messages(self) -> AsyncIterator[protocol.launcher.LauncherNews]:
        async with self._said:
            async for msg in self._said:
                yield msg

    @property
    def launcher_pid(self) -> int | None:
        return self._launcher

    def launcher_alive(self) -> bool:
        return self._launcher_alive and self.lost is None

    async def launcher_exited(self) -> None:
        await self._exited.wait()

    def launcher_outcome(self, log: Path) -> tuple[str, str]:
        return self._outcome

    def agent(self) -> Agent:
        beat = self._beat
        state = None
        if beat is not None and beat["state"]:
            state = (beat["state"][0], beat["state"][1])
        last_tick = None
        if beat is not None and beat["tick_age"] is not None and self._beat_at is not None:
            last_tick = self._beat_at - beat["tick_age"]
        # As long as the channel takes to call the machine lost: past it, a silent loop is
        # the agent's own, not the way here.
        return Agent(self._launcher or 0, state, last_tick, slack=protocol.agents.LOST_AFTER_S)

    def ranks_up(self, spec: JobSpec) -> None:
        self._order(protocol.agents.RanksUp(kind=protocol.agents.RANKS_UP, group=self._group or ""))

    # ---- ranks -----------------------------------------------------------------------------

    async def wait_gone(self, r: RankState) -> tuple[float, float]:
        key = (r.attempt, r.rank)
        await self._gone.setdefault(key, anyio.Event()).wait()
        t, code = self._seen_gone[key]
        if r.exit_code is None and code is not None:
            r.exit_code = code
        if self.lost is not None and r.lost is None and code is None:
            r.lost = f"its node left: {self.lost}"
        return t, time.monotonic() - max(0.0, time.time() - t)

    def alive(self, r: RankState) -> bool:
        return r.died_at is None and (r.attempt, r.rank) not in self._seen_gone and not self.lost

    def signal(self, r: RankState, sig: int) -> bool:
        if not self.alive(r):
            return False
        self._order(
            protocol.agents.Signal(
                kind=protocol.agents.SIGNAL,
                group=self._group or "",
                attempt=r.attempt,
                rank=r.rank,
                sig=sig,
            )
        )
        return True

    def unreaped(self, r: RankState) -> bool:
        beat = self._beat
        return beat is not None and [r.attempt, r.rank] in beat["zombies"]

    def armed(self, r: RankState) -> bool:
        return self.rd.stacks(r.attempt, r.rank).exists()  # mirrored as soon as it is armed

    async def stacks(self, ranks: list[RankState], wait_s: float) -> dict[int, StackDump]:
        if not ranks:
            return {}
        try:
            answer = await self.link.request(
                protocol.agents.NodeStacks(
                    kind=protocol.agents.STACKS,
                    req=0,
                    group=self._group or "",
                    ranks=[[r.attempt, r.rank] for r in ranks],
                    wait_s=wait_s,
                ),
                timeout=wait_s + ANSWER_S,
            )
        except (NodeLost, RuntimeError):
            answer = {"dumps": {}}
        out = {}
        for r in ranks:
            d = answer["dumps"].get(str(r.rank))
            path = str(self.rd.stacks(r.attempt, r.rank))
            if d is None:
                out[r.rank] = StackDump("", path, None, asked=False)
            else:
                state = (d["state"][0], d["state"][1]) if d["state"] else None
                out[r.rank] = StackDump(d["text"], path, state, d["asked"])
        return out

    async def probe(self, r: RankState, what: str, wait_s: float) -> dict[str, Any] | None:
        if not self.alive(r):
            return None
        try:
            answer = await self.link.request(
                protocol.agents.Probe(
                    kind=protocol.agents.PROBE,
                    req=0,
                    group=self._group or "",
                    attempt=r.attempt,
                    rank=r.rank,
                    what=what,
                    wait_s=wait_s,
                ),
                timeout=wait_s + ANSWER_S,
            )
        except (NodeLost, RuntimeError):
            return None
        record = answer.get("record")
        return record if isinstance(record, dict) else None

    def oom_kills(self) -> int | None:
        beat = self._beat
        return None if beat is None else beat["oom_kills"]

    def read_memory(self, ranks: list[RankState]) -> MemoryReading:
        return self._reading.of(ranks)  # the newest its agent sent

    # ---- the end ---------------------------------------------------------------------------

    def running(self, leftovers_too: bool = True) -> bool:
        if self.lost is not None:
            return False
        beat = self._beat
        if beat is None:
            return self._launcher_alive
        return beat["launcher_alive"] or (leftovers_too and beat["running"])

    async def wait_stopped(self, timeout: float, leftovers_too: bool = True) -> None:
        with anyio.move_on_after(timeout):
            while self.running(leftovers_too):
                await anyio.sleep(protocol.agents.BEAT_S)

    async def leftovers_after_success(
        self, grace: float, stuck: Callable[[], bool]
    ) -> list[dict[str, Any]]:
        try:
            answer = await self.link.request(
                protocol.agents.Leftovers(
                    kind=protocol.agents.LEFTOVERS,
                    req=0,
                    group=self._group or "",
                    grace=grace,
                    stuck=stuck(),
                ),
                timeout=grace + ANSWER_S,
            )
        except (NodeLost, RuntimeError):
            return []
        return [{**p, "node": self.label} for p in answer.get("leftovers", [])]

    async def stop(
        self, grace: float, on_signal: Callable[[str, list[int]], None]
    ) -> list[Survivor]:
        if self.lost is not None or self._group is None:
            return []
        answer: dict[str, Any] | None = None
        # Bounded: a teardown (shielded from cancellation) must end whatever the agent does.
        with contextlib.suppress(NodeLost, RuntimeError):
            answer = await self.link.request(
                protocol.agents.NodeStop(
                    kind=protocol.agents.STOP, req=0, group=self._group, grace=grace
                ),
                timeout=grace + ANSWER_S,
            )
        if answer is None:
            if self.lost is None:
                log.warning("%s did not answer the stop of %s in time", self.label, self._group)
            return []
        for sig, pids in answer.get("signals", []):
            on_signal(f"{sig} on {self.label}", pids)
        self._launcher_alive = False
        return [Survivor(pid, f"{state} on {self.label}") for pid, state in answer["survivors"]]

    def close(self, ended: bool = True) -> None:
        group = self._group
        if group is None:
            return
        if self.link.nodes.get(group) is self:
            del self.link.nodes[group]
        # Its run directories stay known: the agent sends what is left of the group's files
        # (its launcher's last lines) as it closes it.
        self._order(protocol.agents.Close(kind=protocol.agents.CLOSE, group=group, ended=ended))
        self._news.close()
        # Its launcher's exit, if still untold, is no longer listened for: its reader ends.
        self._exited.set()

    # ---- a session cell's files ----------------------------------------------------------------

    async def cell_dir(self, cell_id: str, rd: RunDir) -> str | None:
        """A session cell's run directory on the agent's machine (its files sent there first);
        what the rank there is told to run. None: the agent has gone (its loss restarts the
        session's ranks)."""
        ship = {f"run/{name}": rd.path / name for name in INPUTS}
        for path in JobSpec.from_json(rd.spec.read_text()).ship:
            ship[f"cwd/{Path(path).name}"] = Path(path)
        files = await anyio.to_thread.run_sync(pack, ship)
        self.link.dirs[(self._group or "", cell_id)] = rd.path
        try:
            answer = await self.link.request(
                protocol.agents.CellFiles(
                    kind=protocol.agents.CELL, req=0, group=self._group or "", cell=cell_id
                ),
                files,
            )
        except NodeLost:
            return None
        return str(answer["run_dir"])

    # ---- the agent's news ------------------------------------------------------------------

    def _order(self, msg: protocol.Message) -> None:
        self.link.spawn(self.link.send, msg)

    def on_beat(self, beat: protocol.agents.GroupBeat) -> None:
        self._beat, self._beat_at = beat, time.monotonic()

    def on_news(self, msg: protocol.agents.NodeNews) -> None:
        if msg["kind"] == protocol.agents.LAUNCHER:
            assert msg["kind"] == protocol.agents.LAUNCHER
            said = protocol.launcher.launcher_news(msg["msg"])
            if said["kind"] == protocol.launcher.START:
                self._gone.setdefault((said["attempt"], said["rank"]), anyio.Event())
            # Its reader gone (the group's tasks ended by a bug of ours): nobody listens.
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                self._news.send_nowait(said)
        elif msg["kind"] == protocol.agents.LAUNCHER_EXIT:
            assert msg["kind"] == protocol.agents.LAUNCHER_EXIT
            self._outcome = (msg["outcome"], f"{self.label}: {msg['reason']}")
            self._launcher_alive = False
            self._news.close()
            self._exited.set()
        elif msg["kind"] == protocol.agents.RANK_GONE:
            assert msg["kind"] == protocol.agents.RANK_GONE
            key = (msg["attempt"], msg["rank"])
            self._seen_gone[key] = (msg["t"] + self.clock_offset, msg["code"])
            self._gone.setdefault(key, anyio.Event()).set()
        elif msg["kind"] == protocol.agents.MEMORY:
            assert msg["kind"] == protocol.agents.MEMORY
            limit = MemoryLimit(**msg["limit"]) if msg["limit"] else None
            self._reading = MemoryReading(
                {int(k): v for k, v in msg["rss"].items()},
                {int(k): v for k, v in msg["gpu"].items()},
                limit,
                msg["gpus"],
            )

    def on_lost(self, why: str, at: float) -> None:
        """The agent is gone: its ranks with it, as of when it was last heard from."""
        if self.lost is not None:
            return
        self.lost = why
        self._launcher_alive = False
        self._outcome = ("failed", f"{self.label} left: {why}")
        for key, event in self._gone.items():
            if key not in self._seen_gone:
                self._seen_gone[key] = (at, None)
            event.set()
        self._news.close()
        self._exited.set()

    async def on_stream(self, stream: ByteStream, to: str, peer: int | None) -> None:
        """A connection from the agent's machine: a launcher's to the group's rendezvous store
        (joined to it here, on loopback), or a session rank's to its session."""
        if to == protocol.agents.STREAM_SESSION and self._session_streams is not None:
            await self._session_streams(stream, peer, self)
            return
        if to != protocol.agents.STREAM_STORE:
            await stream.aclose()
            return
        try:
            store = await anyio.connect_tcp("127.0.0.1", self._store_port)
        except OSError:
            await stream.aclose()
            return
        async with store, anyio.create_task_group() as tg:

            async def pump(a: ByteStream, b: ByteStream) -> None:
                try:
                    while True:
                        await b.send(await a.receive())
                except (
                    anyio.EndOfStream,
                    anyio.BrokenResourceError,
                    anyio.ClosedResourceError,
                    OSError,
                ):
                    pass
                tg.cancel_scope.cancel()

            tg.start_soon(pump, stream, store)
            tg.start_soon(pump, store, stream)
        await stream.aclose()
