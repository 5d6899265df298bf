"""A site with no processes, for unit tests of what a rank group decides: the test plays the
launcher (what it says) and the ranks (when each goes, how it ended, what its stack and flight
recorder show), waits until the group has taken in what the launcher said (`heard`), and reads
what the group did to them (signals, the teardown)."""

from __future__ import annotations

import math
import signal
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import anyio

from elastic_nb import protocol
from elastic_nb.common.rank_state import RankState
from elastic_nb.common.rundir import RunDir
from elastic_nb.supervisor.forensics.watchdogs import TorchAgent
from elastic_nb.supervisor.processes.site import MemoryReading, Site, StackDump, Survivor, Work

LAUNCHER_PID = 4242


class FakeSite(Site):
    name = "a fake machine"

    def __init__(self, rd: RunDir) -> None:
        super().__init__(rd)
        self._say, self._heard = anyio.create_memory_object_stream[Any](math.inf)
        self._said = 0  # messages the launcher said
        self._taken = 0  # ... and the group took in
        self._took = anyio.Event()  # set (and replaced) as the group takes one in
        self._launcher_exited = anyio.Event()
        self._gone: dict[tuple[int, int], anyio.Event] = {}
        self._codes: dict[tuple[int, int], int] = {}
        self.result: tuple[str, str] = ("failed", "torchelastic gave up: ranks failed")
        self.signals: list[tuple[int, int]] = []  # (rank, signal) the group sent
        self.dumps: dict[int, str] = {}  # rank -> what its stack dump says
        self.recorders: dict[int, dict[str, Any]] = {}  # rank -> its flight recorder's answer
        self.probe_gate: anyio.Event | None = None  # set: probes answer; unset: they wait
        self.probing = anyio.Event()  # set once a probe waits at the gate (a look has begun)
        self.memory = MemoryReading({}, {}, None, gpus=False)  # what read_memory finds
        self.cuda: dict[int, protocol.records.CudaMemory] = {}  # rank -> its allocator's answer
        self.kills: int | None = None  # the OOM killer's count where the ranks run
        self.stopped = False
        self.closed = False
        # Ranks the stop ends seen gone with their exit status untold (a loaded machine's launcher,
        # which tells a forked rank's, went before it did)
        self.untold_at_stop: set[int] = set()
        self.asked: list[
            tuple[int, str]
        ] = []  # (rank, what) of each stack dump and probe, in order

    # ---- the test's side ----------------------------------------------------------------------

    def say(self, kind: str, **fields: Any) -> None:
        """The launcher says something."""
        self._said += 1
        self._say.send_nowait({"kind": kind, **fields})

    async def heard(self) -> None:
        """Until the group has taken in everything the launcher said so far (a rank's start:
        the rank is in its book, its watcher started)."""
        said = self._said
        while self._taken < said:
            await self._took.wait()

    def start_ranks(self, attempt: int, pids: dict[int, int]) -> None:
        self.say(protocol.launcher.RENDEZVOUS, attempt=attempt, seconds=0.01)
        for rank, pid in pids.items():
            self.say(protocol.launcher.START, attempt=attempt, rank=rank, pid=pid)

    def rank_dies(self, attempt: int, rank: int, code: int) -> None:
        self._codes[(attempt, rank)] = code
        self._event(attempt, rank).set()

    def rank_died_unseen(self, attempt: int, rank: int, code: int) -> None:
        """The rank has ended (`code`), but its site sees it only at the teardown (a loaded
        machine reaps late): the teardown's signal finds it gone."""
        self._codes[(attempt, rank)] = code

    def _event(self, attempt: int, rank: int) -> anyio.Event:
        return self._gone.setdefault((attempt, rank), anyio.Event())

    # ---- the launcher -------------------------------------------------------------------------

    async def start(self, work: Work) -> bool:
        self.oom_base = self.kills
        return True

    async def messages(self) -> AsyncIterator[protocol.launcher.LauncherNews]:
        async for msg in self._heard:
            yield msg
            # The group's reader asks for the next message once it has taken this one in.
            self._taken += 1
            self._took.set()
            self._took = anyio.Event()

    @property
    def launcher_pid(self) -> int | None:
        return LAUNCHER_PID

    def launcher_alive(self) -> bool:
        return not self._launcher_exited.is_set()

    async def launcher_exited(self) -> None:
        await self._launcher_exited.wait()

    def launcher_outcome(self, log: Path) -> tuple[str, str]:
        return self.result

    def torch_agent(self) -> TorchAgent:
        return TorchAgent(LAUNCHER_PID, ("S", "sleeping"), time.monotonic())

    # ---- ranks --------------------------------------------------------------------------------

    async def wait_gone(self, r: RankState) -> tuple[float, float]:
        await self._event(r.attempt, r.rank).wait()
        r.exit_code = self._codes.get((r.attempt, r.rank))
        return time.time(), time.monotonic()

    def alive(self, r: RankState) -> bool:
        return not self._event(r.attempt, r.rank).is_set()

    def signal(self, r: RankState, sig: int) -> bool:
        if not self.alive(r):
            return False
        self.signals.append((r.rank, sig))
        if sig in (signal.SIGTERM, signal.SIGKILL):
            self.rank_dies(r.attempt, r.rank, -sig)  # a rank that obeys
        return True

    def unreaped(self, r: RankState) -> bool:
        return False

    def armed(self, r: RankState) -> bool:
        return True

    async def stacks(self, ranks: list[RankState], wait_s: float) -> dict[int, StackDump]:
        self.asked += [(r.rank, "stacks") for r in ranks]
        return {
            r.rank: StackDump(
                self.dumps.get(r.rank, ""),
                str(self.rd.stacks(r.attempt, r.rank)),
                ("S", "sleeping"),
                True,
            )
            for r in ranks
        }

    async def probe(self, r: RankState, what: str, wait_s: float) -> dict[str, Any] | None:
        self.asked.append((r.rank, what))
        if what == protocol.rank_probes.PROBE_RELEASE:
            return {"released": True}
        if what == protocol.rank_probes.PROBE_MEMORY:
            return {"cuda": self.cuda.get(r.rank)}
        if self.probe_gate is not None:
            self.probing.set()
            await self.probe_gate.wait()  # a rank slow to answer: the look takes its time
        record = self.recorders.get(r.rank)
        return dict(record) if record is not None else None

    def oom_kills(self) -> int | None:
        return self.kills

    def read_memory(self, ranks: list[RankState]) -> MemoryReading:
        return self.memory.of(ranks)

    # ---- the end ------------------------------------------------------------------------------

    def running(self, leftovers_too: bool = True) -> bool:
        return self.launcher_alive() or any(not e.is_set() for e in self._gone.values())

    async def wait_stopped(self, timeout: float, leftovers_too: bool = True) -> None:
        with anyio.move_on_after(timeout):
            await self._launcher_exited.wait()

    async def leftovers_after_success(
        self, grace: float, stuck: Callable[[], bool]
    ) -> list[dict[str, Any]]:
        return []

    async def stop(
        self, grace: float, on_signal: Callable[[str, list[int]], None]
    ) -> list[Survivor]:
        """Every rank obeys SIGTERM; the launcher goes with its last word said."""
        self.stopped = True
        on_signal("SIGTERM", [])
        for (attempt, rank), gone in list(self._gone.items()):
            if gone.is_set():
                continue
            if rank in self.untold_at_stop:
                gone.set()
            else:
                self.rank_dies(attempt, rank, self._codes.get((attempt, rank), -signal.SIGTERM))
        self._say.close()
        self._launcher_exited.set()
        return []

    def close(self, ended: bool = True) -> None:
        self.closed = True
