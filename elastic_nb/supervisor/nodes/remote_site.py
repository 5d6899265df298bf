"""A site on another machine: one group's round on a join agent (`RemoteSite`), through the
agent's link (agent_link.JoinAgentLink).

The second implementation of `processes.site.Site`: the group asks it what it asks a
`LocalSite`, and the agent answers with its own `LocalSite` there. What the group must know at
once (is a rank alive, a zombie, how the launcher is doing, its ranks' memory) comes in the
agent's heartbeat and news and is read here without asking; what takes the ranks' answer (their
stacks, a flight-recorder probe) or the agent's action (a signal, the teardown) is an order. The
ranks' files are mirrored into the group's run directory as they grow, so the run directory's
readers need no site at all.

When the agent is lost, every rank it ran for the group is gone at the moment it was last
heard from, marked as lost with the reason: a departure is a failure of that node's ranks, and
the group restarts (or ends) as for any failure.
"""

from __future__ import annotations

import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import anyio
from anyio.abc import ByteStream

from elastic_nb import protocol
from elastic_nb.common.host_memory import MemoryLimit
from elastic_nb.common.rank_state import RankState
from elastic_nb.common.rundir import RunDir
from elastic_nb.common.spec import JobSpec
from elastic_nb.supervisor.forensics.watchdogs import TorchAgent
from elastic_nb.supervisor.nodes.agent_link import ANSWER_S, JoinAgentLink, NodeLost
from elastic_nb.supervisor.nodes.files import INPUTS, pack
from elastic_nb.supervisor.processes.site import MemoryReading, Site, StackDump, Survivor, Work

__all__ = ["RemoteSite"]

R = TypeVar("R")  # an answer's data


# A session rank's relayed connection: the stream, its pid as the agent saw it, the site.
SessionStreams = Callable[[ByteStream, int | None, Site], Awaitable[None]]


log = logging.getLogger(__name__)


class RemoteSite(Site):
    def __init__(
        self,
        rd: RunDir,
        agent: JoinAgentLink,
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
        self.round: int | None = None  # its round's attempt (the agent's news names the round)
        self._news, self._said = anyio.create_memory_object_stream[protocol.launcher.LauncherNews](
            math.inf
        )
        self._launcher: int | None = None
        self._launcher_alive = False
        self._exited = anyio.Event()
        self._outcome: tuple[str, str] = ("failed", "its node never reported")
        self._gone: dict[tuple[int, int], anyio.Event] = {}
        self._starts = _Starts(self._gone)
        self._seen_gone: dict[tuple[int, int], tuple[float, int | None]] = {}
        self._beat: protocol.agents.GroupBeat | None = None
        self._beat_at: float | None = None
        self._reading = MemoryReading({}, {}, None, gpus=False)
        self.lost: str | None = None

    @property
    def label(self) -> str:
        return self.link.label()

    # ---- the launcher --------------------------------------------------------------------------

    async def start(self, work: Work) -> bool:
        group, spec, plan = work.group, work.spec, work.plan
        assert plan is not None, "a site on another machine runs multi-node rounds only"
        self._group, self.round = group, plan["attempt"]
        agent = self.link
        files = b""
        if (group, "") not in agent.dirs:  # the agent has not served this group yet
            files = await anyio.to_thread.run_sync(pack, self._ship)
            agent.dirs[(group, "")] = self.rd.path
        agent.sites[group] = self
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
            answer = await agent.request(order, protocol.agents.Opened, files)
        except NodeLost:
            self.on_lost(agent.why or "it left", agent.last_heard_wall)
            return False
        self._launcher = answer["launcher"]
        self._launcher_alive = True
        return answer["warm"]

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

    def torch_agent(self) -> TorchAgent:
        beat = self._beat
        state = None
        if beat is not None and beat["state"]:
            state = (beat["state"][0], beat["state"][1])
        last_tick = None
        if beat is not None and beat["tick_age"] is not None and self._beat_at is not None:
            last_tick = self._beat_at - beat["tick_age"]
        # As long as the channel takes to call the machine lost: past it, a silent loop is
        # the agent's own, not the way here.
        return TorchAgent(self._launcher or 0, state, last_tick, slack=protocol.agents.LOST_AFTER_S)

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
        order = protocol.agents.NodeStacks(
            kind=protocol.agents.STACKS,
            req=0,
            group=self._group or "",
            ranks=[[r.attempt, r.rank] for r in ranks],
            wait_s=wait_s,
        )
        answer = await self._ask(order, protocol.agents.Dumps, wait_s)
        dumps = answer["dumps"] if answer else {}
        out = {}
        for r in ranks:
            d = dumps.get(str(r.rank))
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
        order = protocol.agents.Probe(
            kind=protocol.agents.PROBE,
            req=0,
            group=self._group or "",
            attempt=r.attempt,
            rank=r.rank,
            what=what,
            wait_s=wait_s,
        )
        answer = await self._ask(order, protocol.agents.ProbeAnswer, wait_s)
        return answer["record"] if answer else None

    async def _ask(
        self, order: protocol.agents.Request, answer: type[R], wait_s: float
    ) -> R | None:
        """The agent's answer to an order about this site's ranks that takes up to `wait_s`
        there; None if none came (the agent is lost, did not answer, or failed): the callers
        then do without, as for a rank that cannot be asked."""
        try:
            return await self.link.request(order, answer, timeout=wait_s + ANSWER_S)
        except (NodeLost, RuntimeError):
            return None

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
    ) -> list[protocol.records.Leftover]:
        order = protocol.agents.Leftovers(
            kind=protocol.agents.LEFTOVERS,
            req=0,
            group=self._group or "",
            grace=grace,
            stuck=stuck(),
        )
        answer = await self._ask(order, protocol.agents.LeftoverList, grace)
        left = answer["leftovers"] if answer else []
        return [
            protocol.records.Leftover(pid=p["pid"], cmd=p["cmd"], node=self.label) for p in left
        ]

    async def stop(
        self, grace: float, on_signal: Callable[[str, list[int]], None]
    ) -> list[Survivor]:
        if self.lost is not None or self._group is None:
            return []
        # Bounded: a teardown (shielded from cancellation) must end whatever the agent does.
        order = protocol.agents.NodeStop(
            kind=protocol.agents.STOP, req=0, group=self._group, grace=grace
        )
        answer = await self._ask(order, protocol.agents.Stopped, grace)
        if answer is None:
            if self.lost is None:
                log.warning("%s did not answer the stop of %s in time", self.label, self._group)
            return []
        for sent in answer["signals"]:
            on_signal(f"{sent['sig']} on {self.label}", sent["pids"])
        self._launcher_alive = False
        return [
            Survivor(pid=s["pid"], state=f"{s['state']} on {self.label}")
            for s in answer["survivors"]
        ]

    def close(self, ended: bool = True) -> None:
        group = self._group
        if group is None:
            return
        if self.link.sites.get(group) is self:
            del self.link.sites[group]
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
                protocol.agents.CellUnpacked,
                files,
            )
        except NodeLost:
            return None
        return answer["run_dir"]

    # ---- the agent's news ------------------------------------------------------------------

    def _order(self, msg: protocol.Message) -> None:
        self.link.spawn(self.link.send, msg)

    def on_beat(self, beat: protocol.agents.GroupBeat) -> None:
        self._beat, self._beat_at = beat, time.monotonic()

    def on_news(self, msg: protocol.agents.NodeNews) -> None:
        """A group's news from the agent (agent_link routes it here): by its kind's handler."""
        getattr(self, _NEWS[msg["kind"]])(msg)

    def _launcher_said(self, msg: protocol.agents.LauncherSaid) -> None:
        said = protocol.launcher.launcher_news(msg["msg"])
        protocol.launcher.hear(said, self._starts)
        # Its reader gone (the group's tasks ended by a bug of ours): nobody listens.
        with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
            self._news.send_nowait(said)

    def _launcher_exit(self, msg: protocol.agents.LauncherExit) -> None:
        self._outcome = (msg["outcome"], f"{self.label}: {msg['reason']}")
        self._launcher_alive = False
        self._news.close()
        self._exited.set()

    def _rank_gone(self, msg: protocol.agents.RankGone) -> None:
        key = (msg["attempt"], msg["rank"])
        self._seen_gone[key] = (msg["t"] + self.clock_offset, msg["code"])
        self._gone.setdefault(key, anyio.Event()).set()

    def _memory(self, msg: protocol.agents.MemoryRead) -> None:
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


# A group's news from its agent, by kind: RemoteSite's handler of each (agent_link routes only
# these kinds to a site)
_NEWS = {
    protocol.agents.LAUNCHER: "_launcher_said",
    protocol.agents.LAUNCHER_EXIT: "_launcher_exit",
    protocol.agents.RANK_GONE: "_rank_gone",
    protocol.agents.MEMORY: "_memory",
}


class _Starts(protocol.launcher.Listener):
    """A rank the agent's launcher started: its going is waited for from then on."""

    def __init__(self, gone: dict[tuple[int, int], anyio.Event]) -> None:
        self.gone = gone

    def started(self, msg: protocol.launcher.Start) -> None:
        self.gone.setdefault((msg["attempt"], msg["rank"]), anyio.Event())
