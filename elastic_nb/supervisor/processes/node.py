"""Nodes: where a rank group's ranks run, and every operation on them there.

A rank group (a one-off job, a session) runs its ranks on nodes. Everything the supervisor does to
a rank or to its launcher goes through the node it runs on: give a launcher the group's work, hear
what its agent says, see a rank go and read how it ended, signal it, ask it for its stacks or its
flight recorder, count the OOM killer's kills, end the process tree. Jobs, sessions and every
diagnosis are written once, against `Node`.

The seam follows jupyter_client's kernel provisioner (provisioning/provisioner_base.py: launch,
poll, wait, send_signal, kill, cleanup; one instance per kernel, the manager calling only it): one
`Node` per rank group and machine, holding that group's processes there. `LocalNode` is this
machine. A join agent on another machine, reached over an authenticated channel, is a second
implementation of the same interface, not a second path through the job.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import socket
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import psutil

from elastic_nb import protocol
from elastic_nb.common import host_memory, nvml, procs
from elastic_nb.common.host_memory import MemoryLimit
from elastic_nb.common.rundir import RunDir, read_json
from elastic_nb.common.spec import JobSpec
from elastic_nb.supervisor.forensics.watchdogs import Agent
from elastic_nb.supervisor.processes.launcher_pool import LauncherPool
from elastic_nb.supervisor.processes.launcher_process import Launcher
from elastic_nb.supervisor.processes.process_tree import ProcessTree
from elastic_nb.supervisor.ranks.rank_state import RankState

__all__ = ["LocalNode", "MemoryReading", "Node", "StackDump", "Survivor", "stacks_of"]

POLL_S = 0.05  # how often a rank without a pidfd is looked at
STACK_POLL_S = 0.02
STACKS_BY_THREAD_S = (
    0.5  # a rank's probe thread begins a stack dump within this, or it is signalled
)
PROBE_POLL_S = (0.001, 0.01)  # a probe's answer is looked for after 1 ms, 2, 4, then every 10
_TAIL = 1024  # bytes: enough for a dump's last line


@dataclass
class StackDump:
    """A live rank's answer to a stack request (faulthandler's dump of every thread)."""

    text: str  # what the rank wrote ('' if it did not answer in time)
    path: str  # the file that keeps every dump of the rank
    state: tuple[str, str] | None  # its process state when asked (letter, words); None: gone
    asked: bool  # False: it could not be asked (not running our bootstrap yet, or gone)


@dataclass(frozen=True)
class MemoryReading:
    """What a node reads of its ranks' memory without asking them."""

    rss: dict[int, int]  # rank -> resident bytes
    gpu: dict[int, protocol.records.GpuShare]  # rank -> NVML's figures, for ranks it sees on a GPU
    limit: MemoryLimit | None  # what bounds the host memory of the node's ranks
    gpus: bool  # the node has GPUs NVML can see: its ranks may hold CUDA memory

    def of(self, ranks: list[RankState]) -> MemoryReading:
        """The same reading, for these ranks alone."""
        wanted = {r.rank for r in ranks}
        return MemoryReading(
            {k: v for k, v in self.rss.items() if k in wanted},
            {k: v for k, v in self.gpu.items() if k in wanted},
            self.limit,
            self.gpus,
        )


@dataclass(frozen=True)
class Survivor:
    """A process of the group still alive after SIGKILL (in D state, most often)."""

    pid: int
    state: str  # what its state means, or "gone"


class Node(ABC):
    """One machine's part of a rank group: its launcher, its ranks, the end of its processes.
    `rd` is the group's run directory, where the node keeps what its ranks leave."""

    name = "this machine"

    def __init__(self, rd: RunDir, number: int = 0, host: str | None = None) -> None:
        self.rd = rd
        self.number = number  # 0: the notebook's machine; a join agent's, in join order
        self.host = host or socket.gethostname()
        self.oom_base: int | None = None  # the OOM killer's count when the group started here
        self.clock_offset = 0.0  # add to this node's wall clock for ours (0: it is ours)

    @property
    def label(self) -> str:
        """How messages name it: 'node 1 (gpu-b)'."""
        return f"node {self.number} ({self.host})"

    # ---- the launcher --------------------------------------------------------------------------

    @abstractmethod
    async def start(
        self,
        group: str,
        spec: JobSpec,
        env: dict[str, str],
        plan: protocol.launcher.LaunchRound | None = None,
    ) -> bool:
        """Give a launcher the group's work (its spec and the ranks' environment; the run
        directory is the node's), and for a multi-node job the round it is part of (`plan`:
        the node fills in its own endpoint, address and interface); True if the launcher was
        started ahead of it (warm)."""

    @abstractmethod
    def messages(self) -> AsyncIterator[protocol.launcher.LauncherNews]:
        """What the launcher says (protocol: READY, RENDEZVOUS, START, EXIT, EXITS, RESULT), until
        it exits."""

    @property
    @abstractmethod
    def launcher_pid(self) -> int | None: ...

    @abstractmethod
    def launcher_alive(self) -> bool: ...

    @abstractmethod
    async def launcher_exited(self) -> None:
        """Until the launcher has exited, within a bound of the node's (a process in D state may
        take its time)."""

    @abstractmethod
    def launcher_outcome(self, log: Path) -> tuple[str, str]:
        """How the group ends by the launcher's account, once it has exited: (outcome, reason)."""

    @abstractmethod
    def agent(self) -> Agent:
        """torchelastic's agent now, for the zombie watchdog."""

    def ranks_up(self, spec: JobSpec) -> None:  # noqa: B027 - a hint a node may ignore
        """Every rank of the first attempt runs: a moment for the node to get ready for the next
        group (a warm launcher)."""

    async def cell_dir(self, cell_id: str, rd: RunDir) -> str | None:
        """A session cell's run directory as this node's ranks reach it (on this machine, the
        cell's own; another machine's node sends the cell's files there first); None when the
        node has gone."""
        return str(rd.path)

    # ---- ranks -----------------------------------------------------------------------------

    @abstractmethod
    async def wait_gone(self, r: RankState) -> tuple[float, float]:
        """Until the rank's process has ended; returns when it was seen gone (time.time(),
        time.monotonic()). Sets `r.exit_code` when the node can read it at once."""

    @abstractmethod
    def alive(self, r: RankState) -> bool:
        """Not dead, even if its watcher has not run yet."""

    @abstractmethod
    def signal(self, r: RankState, sig: int) -> bool:
        """Signal the rank's process, never another that reused its pid; False if it is gone."""

    @abstractmethod
    def unreaped(self, r: RankState) -> bool:
        """The rank has died and its parent has not reaped it (a zombie)."""

    @abstractmethod
    def armed(self, r: RankState) -> bool:
        """The rank runs our bootstrap and answers stack requests."""

    @abstractmethod
    async def stacks(self, ranks: list[RankState], wait_s: float) -> dict[int, StackDump]:
        """Every given live rank's stack, asked all at once, answers awaited together (`wait_s`
        at most)."""

    @abstractmethod
    async def probe(self, r: RankState, what: str, wait_s: float) -> dict[str, Any] | None:
        """Ask a live rank (protocol.rank_probes.PROBE_*: its flight recorder, its CUDA memory); its
        answer, or None if it did not answer within `wait_s`. One probe of a rank at a time:
        each answer carries the number of the probe it answers."""

    @abstractmethod
    def oom_kills(self) -> int | None:
        """How many processes the OOM killer has ended where the ranks run (None: unknown)."""

    @abstractmethod
    def read_memory(self, ranks: list[RankState]) -> MemoryReading:
        """The live ranks' memory now, read without asking them (a few file reads, NVML's
        figures where it is there)."""

    # ---- the end ---------------------------------------------------------------------------

    @abstractmethod
    def running(self, leftovers_too: bool = True) -> bool:
        """The launcher lives, or (`leftovers_too`) some process of the group does."""

    @abstractmethod
    async def wait_stopped(self, timeout: float, leftovers_too: bool = True) -> None: ...

    @abstractmethod
    async def leftovers_after_success(
        self, grace: float, stuck: Callable[[], bool]
    ) -> list[dict[str, Any]]:
        """After a success: what the cell left running (pid, cmd), once the launcher has gone
        (unless the agent is `stuck`)."""

    @abstractmethod
    async def stop(
        self, grace: float, on_signal: Callable[[str, list[int]], None]
    ) -> list[Survivor]:
        """SIGTERM, `grace`, SIGKILL to everything of the group here; what survived it all."""

    @abstractmethod
    def close(self, ended: bool = True) -> None:
        """The group's round has ended here (`ended`: the group itself): its logs kept in its
        run directory, what the node holds for it freed."""


class LocalNode(Node):
    """This machine: a launcher from the supervisor's pool, the ranks it starts, found by what they
    are (pids through pidfds, the job's marker, the launcher's process group)."""

    def __init__(
        self,
        rd: RunDir,
        pool: LauncherPool,
        orphans: Callable[[], list[psutil.Process]],
        reap: Callable[[], None],
    ) -> None:
        super().__init__(rd, 0)
        self._pool, self._orphans, self._reap = pool, orphans, reap
        self._launcher: Launcher | None = None
        self._tree: ProcessTree | None = None
        self._spec: JobSpec | None = None
        self._pidfds: dict[tuple[int, int], int] = {}  # open while a rank is watched
        self._probe_numbers = itertools.count(1)
        self._probe_locks: dict[tuple[int, int], anyio.Lock] = {}

    # ---- the launcher --------------------------------------------------------------------------

    async def start(
        self,
        group: str,
        spec: JobSpec,
        env: dict[str, str],
        plan: protocol.launcher.LaunchRound | None = None,
    ) -> bool:
        self.oom_base = self.oom_kills()
        launcher = await self._pool.take(spec, env)
        line = launcher.assign(group, str(self.rd), env, plan)  # before any await: ours now
        self._launcher, self._spec = launcher, spec
        self._tree = ProcessTree(group, launcher.proc, self._orphans)
        await anyio.to_thread.run_sync(launcher.write_assignment, line)
        return launcher.ready

    async def messages(self) -> AsyncIterator[protocol.launcher.LauncherNews]:
        launcher = self._started()
        async for msg in launcher.messages:
            if msg["kind"] == protocol.launcher.START:
                launcher.last_tick = time.monotonic()  # a start is a sign of life
            yield msg

    @property
    def launcher_pid(self) -> int | None:
        return self._launcher.pid if self._launcher else None

    def launcher_alive(self) -> bool:
        return self._launcher is not None and self._launcher.alive

    async def launcher_exited(self) -> None:
        with anyio.move_on_after(procs.KILL_WAIT_S):
            await self._started().exited()

    def launcher_outcome(self, log: Path) -> tuple[str, str]:
        return self._started().outcome(log)

    def agent(self) -> Agent:
        launcher = self._started()
        return Agent(launcher.pid, procs.proc_state(launcher.pid), launcher.last_tick)

    def ranks_up(self, spec: JobSpec) -> None:
        self._pool.job_running(spec)

    def _started(self) -> Launcher:
        assert self._launcher is not None, "the node has no launcher yet"
        return self._launcher

    # ---- ranks -----------------------------------------------------------------------------

    async def wait_gone(self, r: RankState) -> tuple[float, float]:
        # A spawned rank is the agent's child: its status is read the moment it dies, before
        # torchelastic reaps it at its next monitor tick. A forked one is its fork server's,
        # reaped at once: the launcher says how it ended (the rank book waits for that word).
        assert r.pid is not None
        fd = procs.pidfd_open(r.pid)
        if fd is None:  # no pidfd (old kernel) or already gone
            while procs.zombie_exit_code(r.pid) is None and psutil.pid_exists(r.pid):
                await anyio.sleep(POLL_S)
        else:
            self._pidfds[(r.attempt, r.rank)] = fd
            try:
                await anyio.wait_readable(fd)
            finally:
                del self._pidfds[(r.attempt, r.rank)]
                os.close(fd)
        gone = time.time(), time.monotonic()
        if r.exit_code is None:
            r.exit_code = procs.zombie_exit_code(r.pid)
        return gone

    def alive(self, r: RankState) -> bool:
        if r.died_at is not None:
            return False
        fd = self._pidfds.get((r.attempt, r.rank))
        return fd is None or not select.select([fd], [], [], 0)[0]

    def signal(self, r: RankState, sig: int) -> bool:
        if r.pid is None:
            return False
        return procs.send_signal(r.pid, self._pidfds.get((r.attempt, r.rank)), sig)

    def unreaped(self, r: RankState) -> bool:
        return r.pid is not None and procs.zombie_exit_code(r.pid) is not None

    def armed(self, r: RankState) -> bool:
        return self.rd.stacks(r.attempt, r.rank).exists()

    async def stacks(self, ranks: list[RankState], wait_s: float) -> dict[int, StackDump]:
        rd = self.rd
        out: dict[int, StackDump] = {}
        asked: dict[int, tuple[Path, int, tuple[str, str]]] = {}
        unreachable: set[int] = set()
        async with anyio.create_task_group() as tg:
            for r in ranks:
                path = rd.stacks(r.attempt, r.rank)
                state = procs.proc_state(r.pid) if r.pid is not None else None
                if state is None or not path.exists():
                    out[r.rank] = StackDump("", str(path), state, asked=False)
                    continue
                size = path.stat().st_size  # before asking: the answer may come at once
                asked[r.rank] = (path, size, state)
                tg.start_soon(self._ask_stacks, r, path, size, unreachable)
            await self._read_stacks(asked, unreachable, out, wait_s)
        return out

    async def _ask_stacks(self, r: RankState, path: Path, size: int, unreachable: set[int]) -> None:
        """Through the rank's probe thread, once it is free (see protocol.rank_probes.STACK_SIGNAL); by the
        signal where its dump has not begun within STACKS_BY_THREAD_S."""
        deadline = time.time() + STACKS_BY_THREAD_S  # the rank compares its own clock with it
        with anyio.move_on_after(STACKS_BY_THREAD_S):
            async with self._probe_locks.setdefault((r.attempt, r.rank), anyio.Lock()):
                request = f"{next(self._probe_numbers)} {protocol.rank_probes.PROBE_STACKS} {deadline:.3f}"
                while not self._send_probe(r, request):
                    await anyio.sleep(STACK_POLL_S)  # its thread answers another probe
                while os.stat(path).st_size == size:
                    await anyio.sleep(STACK_POLL_S)
                return
        if os.stat(path).st_size == size and not self.signal(r, protocol.rank_probes.STACK_SIGNAL):
            unreachable.add(r.rank)

    async def _read_stacks(
        self,
        asked: dict[int, tuple[Path, int, tuple[str, str]]],
        unreachable: set[int],
        out: dict[int, StackDump],
        wait_s: float,
    ) -> None:
        ends = {rank: _dump_end(path) for rank, (path, _, _) in asked.items()}
        last: dict[int, int] = {}
        answered: set[int] = set()
        with anyio.move_on_after(wait_s):
            while len(answered | unreachable) < len(asked):
                await anyio.sleep(STACK_POLL_S)
                for rank, (path, size, _) in asked.items():
                    now = os.stat(path).st_size
                    if rank not in answered and now > size:
                        # Whole once it ends as every dump of the rank ends (a rank descheduled
                        # mid-dump holds still too). Where that line is unknown, or the dump is
                        # cut ("...": a stack deeper than faulthandler writes): once it held
                        # still for a poll.
                        tail = _read_from(path, max(size, now - _TAIL)).rstrip("\n")
                        end = ends[rank]
                        if end and not tail.endswith("..."):
                            whole = tail.endswith(end)
                        else:
                            whole = last.get(rank) == now
                        if whole:
                            answered.add(rank)
                    last[rank] = now
        for rank, (path, size, state) in asked.items():
            if rank in unreachable:
                out[rank] = StackDump("", str(path), None, asked=False)
            else:
                out[rank] = StackDump(_read_from(path, size), str(path), state, asked=True)

    async def probe(self, r: RankState, what: str, wait_s: float) -> dict[str, Any] | None:
        async with self._probe_locks.setdefault((r.attempt, r.rank), anyio.Lock()):
            return await self._probe(r, next(self._probe_numbers), what, wait_s)

    def _send_probe(self, r: RankState, request: str) -> bool:
        """False where no probe thread listens: not armed yet, busy answering, or gone."""
        try:
            fd = os.open(self.rd.probe(r.attempt, r.rank), os.O_WRONLY | os.O_NONBLOCK)
        except OSError:
            return False
        try:
            os.write(fd, f"{request}\n".encode())
            return True
        except OSError:
            return False
        finally:
            os.close(fd)

    async def _probe(self, r: RankState, n: int, what: str, wait_s: float) -> dict[str, Any] | None:
        if not self._send_probe(r, f"{n} {what}"):
            return None
        answer = self.rd.probe_answer(r.attempt, r.rank)
        delay = PROBE_POLL_S[0]  # a rank answers within a millisecond or two, most often
        with anyio.move_on_after(wait_s):
            while True:
                record = _read_record(answer)
                if record is not None and record.get("req") == n:
                    return record
                await anyio.sleep(delay)
                delay = min(2 * delay, PROBE_POLL_S[1])
        return None

    def oom_kills(self) -> int | None:
        return host_memory.oom_kills()

    def read_memory(self, ranks: list[RankState]) -> MemoryReading:
        rss = {r.rank: v for r in ranks if r.pid and (v := host_memory.rss(r.pid)) is not None}
        gpu: dict[int, protocol.records.GpuShare] = {}
        seen = nvml.memory()
        for r in ranks:
            if seen is not None and r.pid is not None and r.pid in seen.by_pid:
                index, held = seen.by_pid[r.pid]
                gpu[r.rank] = protocol.records.GpuShare(
                    index=index,
                    process=held,
                    used=seen.used.get(index, 0),
                    total=seen.total.get(index, 0),
                )
        limit = host_memory.memory_limit(self.launcher_pid or "self")  # its ranks' cgroup
        return MemoryReading(rss, gpu, limit, gpus=bool(seen and seen.total))

    # ---- the end ---------------------------------------------------------------------------

    def running(self, leftovers_too: bool = True) -> bool:
        return self._tree is not None and self._tree.alive(leftovers_too)

    async def wait_stopped(self, timeout: float, leftovers_too: bool = True) -> None:
        if self._tree is not None:
            await self._tree.wait_gone(timeout, leftovers_too)

    async def leftovers_after_success(
        self, grace: float, stuck: Callable[[], bool]
    ) -> list[dict[str, Any]]:
        if self._tree is None:
            return []
        return await self._tree.leftovers_after_success(grace, stuck)

    async def stop(
        self, grace: float, on_signal: Callable[[str, list[int]], None]
    ) -> list[Survivor]:
        if self._tree is None:
            return []
        pids = await self._tree.stop(grace, on_signal)
        self._reap()
        return [Survivor(pid, st[1] if (st := procs.proc_state(pid)) else "gone") for pid in pids]

    def close(self, ended: bool = True) -> None:
        launcher = self._launcher
        if launcher is None or self._spec is None:
            return
        # A launcher that died before it took the job left its log where it was started.
        with contextlib.suppress(OSError):
            text = launcher.log_path.read_bytes()
            with open(self.rd.launcher_log, "ab") as f:
                f.write(text)
            launcher.log_path.unlink()
        self._pool.job_ended(self._spec, started=launcher.ready)


async def stacks_of(
    ranks: list[RankState], node_of: Callable[[RankState], Node], wait_s: float
) -> dict[int, StackDump]:
    """Every given live rank's stack, each asked through its node, all nodes at once."""
    out: dict[int, StackDump] = {}
    nodes = {id(node_of(r)): node_of(r) for r in ranks}

    async def ask(node: Node) -> None:
        out.update(await node.stacks([r for r in ranks if node_of(r) is node], wait_s))

    async with anyio.create_task_group() as tg:
        for node in nodes.values():
            tg.start_soon(ask, node)
    return out


def _dump_end(path: Path) -> str | None:
    """How every dump of this .stacks file ends (its first line says, protocol.rank_probes.STACKS_END_MARK)."""
    with contextlib.suppress(OSError), open(path, encoding="utf-8", errors="replace") as f:
        first = f.readline().rstrip("\n")
        if first.startswith(protocol.rank_probes.STACKS_END_MARK):
            return first[len(protocol.rank_probes.STACKS_END_MARK) :]
    return None


def _read_from(path: Path, offset: int) -> str:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")


def _read_record(path: Path) -> dict[str, Any] | None:
    record = read_json(path)
    return record if isinstance(record, dict) else None
