"""A group (a job or a session) that the notebook's supervisor runs on a join agent's machine:
its run directory and per-job working directory there, its relayed listeners, each round's
`LocalSite` (the launcher it starts, the ranks it watches), and what it tells the supervisor of
them. The join agent (join_agent.py) holds the groups and serves the supervisor's orders about
them; what every group shares of the agent is its `Hands`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import SocketListener, TaskGroup

from elastic_nb import protocol
from elastic_nb.common import machine
from elastic_nb.common.rank_state import RankState
from elastic_nb.common.rundir import CHECKPOINTS, RunDir
from elastic_nb.common.spec import JobSpec
from elastic_nb.join_agent.relay import Relay
from elastic_nb.supervisor.nodes.files import Mirror, owner, unpack
from elastic_nb.supervisor.processes.launcher_pool import LauncherPool
from elastic_nb.supervisor.processes.local_site import LocalSite
from elastic_nb.supervisor.processes.site import Work

__all__ = ["STOP_GRACE_S", "Hands", "ServedGroup"]

STOP_GRACE_S = 1.0  # ranks' SIGTERM -> SIGKILL when the agent ends a round itself


@dataclass(frozen=True)
class Hands:
    """What the groups on an agent's machine share: its channel to the supervisor, its task
    group, its launchers, its relay and mirror, its working directory."""

    send: Callable[[protocol.Message, bytes | None], Awaitable[None]]
    tg: TaskGroup
    pool: LauncherPool
    relay: Relay
    mirror: Mirror
    workdir: Path
    orphans: Callable[[], list[Any]]  # processes inherited here that no group's launcher owns
    reap: Callable[[], None]


class ServedGroup:
    def __init__(self, group_id: str, session: bool, hands: Hands) -> None:
        self.id = group_id
        self.rd = RunDir(hands.workdir / "runs" / group_id)
        self.cwd = hands.workdir / "jobs" / group_id
        self.session = session
        self.spec: JobSpec | None = None
        self.site: LocalSite | None = None  # the current round's
        self.attempt = 0  # the current (or last) round's: its news names it
        self.ranks: dict[tuple[int, int], RankState] = {}
        # (attempt, rank) the supervisor has been told the launcher started: their files may go
        # (files.NodeFiles refuses a rank's file it has not heard of).
        self.told: set[tuple[int, int]] = set()
        self.store: SocketListener | None = None  # launchers' connections to the rendezvous
        self.store_port = 0
        self.sessions: SocketListener | None = None  # session ranks' connections
        self.socket_path: Path | None = None
        self.oom_base: int | None = None
        self._hands = hands

    @classmethod
    async def create(
        cls, msg: protocol.agents.Open, files: bytes, node_dir: str, hands: Hands
    ) -> ServedGroup:
        """A group the supervisor opens here for the first time: its directories (the files it
        sent unpacked into them), its listeners, its mirror to the notebook's machine."""
        g = cls(msg["group"], msg["session"], hands)
        g.rd.path.mkdir(mode=0o700, exist_ok=True)
        g.cwd.mkdir(mode=0o700, exist_ok=True)
        await anyio.to_thread.run_sync(unpack, files, {"run": g.rd.path, "cwd": g.cwd})
        g.spec = g._rewrite_spec(g.rd, JobSpec.from_dict(msg["spec"]))
        hands.mirror.roots[g.rd.path] = (g.id, "")
        hands.mirror.renames["launcher.log"] = f"nodes/{node_dir}/launcher.log"
        g.store, g.store_port = await hands.relay.store(
            g.id, lambda: g.site.launcher_pid if g.site is not None else None, hands.tg
        )
        if g.session:
            g.socket_path = hands.workdir / "sockets" / f"session-{g.id}.sock"
            g.sessions = await hands.relay.sessions(g.id, g.socket_path, hands.tg)
        return g

    # ---- a round ---------------------------------------------------------------------------

    def round(self) -> LocalSite:
        """The round's site here (an order about ranks needs one)."""
        if self.site is None:
            raise RuntimeError(f"group {self.id} has no round running here")
        return self.site

    async def open_round(self, msg: protocol.agents.Open, addr: str) -> protocol.agents.Opened:
        """Start the round's launcher (`addr`: where the other nodes reach this machine)."""
        assert self.spec is not None
        if self.site is not None:
            raise RuntimeError(f"group {self.id}'s last round here has not been closed")
        plan = msg["round"]
        launch = protocol.launcher.LaunchRound(
            attempt=int(plan["attempt"]),
            nnodes=int(plan["nnodes"]),
            run_id=str(plan["run_id"]),
            endpoint=f"127.0.0.1:{self.store_port}",
            addr=addr,
            ifname=machine.interface_holding(addr),
            key=str(plan["key"]),
        )
        hands = self._hands
        site = self.site = LocalSite(self.rd, hands.pool, hands.orphans, hands.reap)
        self.attempt = launch["attempt"]
        self.oom_base = site.oom_kills()
        env = dict(os.environ)
        if self.socket_path is not None:
            env[protocol.sessions.SESSION_SOCKET_ENV] = str(self.socket_path)
        env.update(msg["env"])
        warm = await site.start(Work(self.id, self.spec, env, launch))
        hands.tg.start_soon(self._read_launcher, site, self.attempt)
        return protocol.agents.Opened(warm=warm, launcher=site.launcher_pid)

    async def close_round(self) -> None:
        if self.site is not None:
            # Closed with its launcher still running (the supervisor's teardown came first):
            # stopped now. Only the launcher counts: the group's processes are found by its
            # marker, which on a machine shared with other nodes of the job marks theirs too.
            if self.site.running(leftovers_too=False):
                await self.site.stop(STOP_GRACE_S, lambda sig, pids: None)
            self.site.close()  # its launcher's log into the run directory, the pool warmed
            self.site = None
        await self._hands.mirror.sweep(self.id)

    async def cell(self, cell_id: str, files: bytes) -> protocol.agents.CellUnpacked:
        """A session cell's run directory here, its files unpacked into it."""
        cell = self._hands.workdir / "runs" / cell_id
        cell.mkdir(mode=0o700, exist_ok=True)
        await anyio.to_thread.run_sync(unpack, files, {"run": cell, "cwd": self.cwd})
        self._rewrite_spec(RunDir(cell))
        self._hands.mirror.roots[cell] = (self.id, cell_id)
        return protocol.agents.CellUnpacked(run_dir=str(cell))

    def _rewrite_spec(self, rd: RunDir, spec: JobSpec | None = None) -> JobSpec:
        """The spec as this machine runs it: the job's working directory here (the notebook's
        modules in it, first on sys.path), its run directories under the agent's."""
        spec = dataclasses.replace(
            spec or JobSpec.from_json(rd.spec.read_text()),
            cwd=str(self.cwd),
            sys_path=(str(self.cwd),),
            log_dir=str(self._hands.workdir / "runs"),
        )
        rd.spec.write_text(spec.to_json())
        return spec

    async def _read_launcher(self, site: LocalSite, round_: int) -> None:
        """The round's launcher: what it says, to the supervisor; a watcher per rank it starts."""
        send = self._hands.send
        starts = _RankStarts()
        async for msg in site.messages():
            protocol.launcher.hear(msg, starts)
            for r in starts.ranks:
                self.ranks[(r.attempt, r.rank)] = r
                self._hands.tg.start_soon(self._watch_rank, site, r)
            said = protocol.agents.LauncherSaid(
                kind=protocol.agents.LAUNCHER, group=self.id, round=round_, msg=dict(msg)
            )
            await send(said, None)
            self.told.update((r.attempt, r.rank) for r in starts.ranks)  # its start said first
            starts.ranks.clear()
        await site.launcher_exited()
        outcome, reason = site.launcher_outcome(self.rd.launcher_log)
        await self._hands.mirror.sweep(self.id)
        exited = protocol.agents.LauncherExit(
            kind=protocol.agents.LAUNCHER_EXIT,
            group=self.id,
            round=round_,
            outcome=outcome,
            reason=reason,
        )
        await send(exited, None)

    async def _watch_rank(self, site: LocalSite, r: RankState) -> None:
        seen, _ = await site.wait_gone(r)
        r.died_at = seen
        # What it left (its last lines, its record), before the supervisor hears it went.
        prefix = f"rank-{r.rank}."
        await self._hands.mirror.sweep(self.id, only=lambda p: p.name.startswith(prefix))
        gone = protocol.agents.RankGone(
            kind=protocol.agents.RANK_GONE,
            group=self.id,
            round=r.attempt,  # a round's launcher runs one attempt, the round's
            attempt=r.attempt,
            rank=r.rank,
            t=seen,
            code=r.exit_code,
        )
        await self._hands.send(gone, None)

    # ---- what the supervisor hears of it ---------------------------------------------------

    def beat(self) -> protocol.agents.GroupBeat:
        """The round's state, for the agent's heartbeat (the zombie watchdog's evidence)."""
        site = self.round()
        agent = site.torch_agent() if site.launcher_pid else None
        kills = site.oom_kills()
        return protocol.agents.GroupBeat(
            round=self.attempt,
            launcher=site.launcher_pid,
            launcher_alive=site.launcher_alive(),
            state=list(agent.state) if agent and agent.state else None,
            tick_age=time.monotonic() - agent.last_tick if agent and agent.last_tick else None,
            running=site.running(),
            zombies=[[r.attempt, r.rank] for r in self.ranks.values() if site.unreaped(r)],
            oom_kills=None if kills is None or self.oom_base is None else kills - self.oom_base,
        )

    def memory(self) -> protocol.agents.MemoryRead | None:
        """Its live ranks' memory now; None while none runs."""
        live = [r for r in self.ranks.values() if r.died_at is None and r.pid is not None]
        if self.site is None or not live:
            return None
        reading = self.site.read_memory(live)
        return protocol.agents.MemoryRead(
            kind=protocol.agents.MEMORY,
            group=self.id,
            round=self.attempt,
            rss={str(k): v for k, v in reading.rss.items()},
            gpu={str(k): v for k, v in reading.gpu.items()},
            limit=None if reading.limit is None else vars(reading.limit),
            gpus=reading.gpus,
        )

    def may_send(self, rel: str) -> bool:
        """A rank's file once the supervisor knows its launcher started it (files.NodeFiles)."""
        if rel == CHECKPOINTS:
            return any(r == 0 for _, r in self.told)  # rank 0 keeps them
        rank = owner(rel)
        return rank is None or rank in self.told

    # ---- the end ---------------------------------------------------------------------------

    async def forget(self) -> None:
        """It has ended here: its listeners and streams closed, its files removed (the
        notebook's run directory has them all)."""
        hands = self._hands
        hands.relay.close(self.id)
        for listener in (self.store, self.sessions):
            if listener is not None:
                with contextlib.suppress(Exception):
                    await listener.aclose()
        cells = [
            top for top, (group, root) in hands.mirror.roots.items() if group == self.id and root
        ]
        hands.mirror.drop(self.id)
        if self.socket_path is not None:
            with contextlib.suppress(OSError):
                self.socket_path.unlink()
        for path in (self.rd.path, self.cwd, *cells):
            shutil.rmtree(path, ignore_errors=True)


class _RankStarts(protocol.launcher.Listener):
    """The ranks a launcher's message says started, each to be watched."""

    def __init__(self) -> None:
        self.ranks: list[RankState] = []

    def started(self, msg: protocol.launcher.Start) -> None:
        self.ranks.append(
            RankState(msg["attempt"], msg["rank"], pid=msg["pid"], started_at=time.time())
        )
