"""This machine's site (processes.site.Site): its launcher taken from the supervisor's pool (a
warm fork of the zygote), its ranks watched by pidfd, signalled, asked for their stacks and flight
recorders through their probe FIFOs, its memory read from /proc, cgroups and NVML, and its
process tree ended by the teardown's steps.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import select
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio
import psutil

from elastic_nb import protocol
from elastic_nb.common import host_memory, nvml, procs
from elastic_nb.common.rank_state import RankState
from elastic_nb.common.rundir import RunDir, read_json
from elastic_nb.common.spec import JobSpec
from elastic_nb.supervisor.forensics.watchdogs import TorchAgent
from elastic_nb.supervisor.processes.launcher_pool import LauncherPool
from elastic_nb.supervisor.processes.launcher_process import Launcher
from elastic_nb.supervisor.processes.process_tree import ProcessTree
from elastic_nb.supervisor.processes.site import MemoryReading, Site, StackDump, Survivor, Work

__all__ = ["LocalSite"]

POLL_S = 0.05  # how often a rank without a pidfd is looked at
STACK_POLL_S = 0.02
STACKS_BY_THREAD_S = (
    0.5  # a rank's probe thread begins a stack dump within this, or it is signalled
)
PROBE_POLL_S = (0.001, 0.01)  # a probe's answer is looked for after 1 ms, 2, 4, then every 10
_TAIL = 1024  # bytes: enough for a dump's last line


class LocalSite(Site):
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
        # Ranks seen gone whose exit status may still be on its way (a forked rank's comes from
        # its launcher): not alive, though not yet dead in the book.
        self._exited: set[tuple[int, int]] = set()
        self._probe_numbers = itertools.count(1)
        self._probe_locks: dict[tuple[int, int], anyio.Lock] = {}

    # ---- the launcher --------------------------------------------------------------------------

    async def start(self, work: Work) -> bool:
        self.oom_base = self.oom_kills()
        launcher = await self._pool.take(work.spec, work.env)
        line = launcher.assign(work, str(self.rd))  # before any await: ours now
        self._launcher, self._spec = launcher, work.spec
        self._tree = ProcessTree(work.group, launcher.proc, self._orphans)
        await anyio.to_thread.run_sync(launcher.write_assignment, line)
        return launcher.ready

    async def messages(self) -> AsyncIterator[protocol.launcher.LauncherNews]:
        launcher = self._started()
        heard = _SignOfLife(launcher)
        async for msg in launcher.messages:
            protocol.launcher.hear(msg, heard)
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

    def torch_agent(self) -> TorchAgent:
        launcher = self._started()
        return TorchAgent(launcher.pid, procs.proc_state(launcher.pid), launcher.last_tick)

    def ranks_up(self, spec: JobSpec) -> None:
        self._pool.job_running(spec)

    def _started(self) -> Launcher:
        assert self._launcher is not None, "the site has no launcher yet"
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
        self._exited.add((r.attempt, r.rank))
        if r.exit_code is None:
            r.exit_code = procs.zombie_exit_code(r.pid)
        return gone

    def alive(self, r: RankState) -> bool:
        if r.died_at is not None or (r.attempt, r.rank) in self._exited:
            return False
        fd = self._pidfds.get((r.attempt, r.rank))
        return fd is None or not select.select([fd], [], [], 0)[0]

    def signal(self, r: RankState, sig: int) -> bool:
        if r.pid is None or not self.alive(r):
            return False  # gone: its pid may be another process's by now
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
    ) -> list[protocol.records.Leftover]:
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
        return [
            Survivor(pid=pid, state=st[1] if (st := procs.proc_state(pid)) else "gone")
            for pid in pids
        ]

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


class _SignOfLife(protocol.launcher.Listener):
    """A rank's start is a sign of its launcher's life, as a tick is (the zombie watchdog)."""

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher

    def started(self, msg: protocol.launcher.Start) -> None:
        self.launcher.last_tick = time.monotonic()
