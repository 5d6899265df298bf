"""Sites: one machine's part in one rank group, and every operation on its ranks there.

A rank group (a one-off job, a session) runs its ranks on machines (nodes); its part on each is a
site. Everything the supervisor does to a rank or to its launcher goes through the site it runs
at: give a launcher the group's work, hear what its agent says, see a rank go and read how it
ended, signal it, ask it for its stacks or its flight recorder, count the OOM killer's kills, end
the process tree. Jobs, sessions and every diagnosis are written once, against `Site`.

The seam follows jupyter_client's kernel provisioner (provisioning/provisioner_base.py: launch,
poll, wait, send_signal, kill, cleanup; one instance per kernel, the manager calling only it): one
`Site` per rank group and machine (for a round, or on one machine for the group's life), holding
that group's processes there. `LocalSite` is this machine's (local_site.py). A join agent on
another machine, reached over an authenticated channel, is a second implementation of the same
interface (nodes/remote_site.py), not a second path through the job.
"""

from __future__ import annotations

import socket
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio

from elastic_nb import protocol
from elastic_nb.common.host_memory import MemoryLimit
from elastic_nb.common.rank_state import RankState
from elastic_nb.common.rundir import RunDir
from elastic_nb.common.spec import JobSpec
from elastic_nb.protocol.records import Survivor
from elastic_nb.supervisor.forensics.watchdogs import TorchAgent

__all__ = ["MemoryReading", "Site", "StackDump", "Survivor", "Work", "stacks_of"]


@dataclass
class StackDump:
    """A live rank's answer to a stack request (faulthandler's dump of every thread)."""

    text: str  # what the rank wrote ('' if it did not answer in time)
    path: str  # the file that keeps every dump of the rank
    state: tuple[str, str] | None  # its process state when asked (letter, words); None: gone
    asked: bool  # False: it could not be asked (not running our bootstrap yet, or gone)


@dataclass(frozen=True)
class MemoryReading:
    """What a site reads of its ranks' memory without asking them."""

    rss: dict[int, int]  # rank -> resident bytes
    gpu: dict[int, protocol.records.GpuShare]  # rank -> NVML's figures, for ranks it sees on a GPU
    limit: MemoryLimit | None  # what bounds the host memory of the site's ranks
    gpus: bool  # its machine has GPUs NVML can see: its ranks may hold CUDA memory

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
class Work:
    """What a site's launcher is given for a group (a job or a session)."""

    group: str  # the group's id: its processes' marker
    spec: JobSpec
    env: dict[str, str]  # the ranks' environment
    # A multi-node group's round (the site fills in its own endpoint, address and interface).
    plan: protocol.launcher.LaunchRound | None = None


class Site(ABC):
    """One machine's part of a rank group: its launcher, its ranks, the end of its processes.
    `rd` is the group's run directory, where the site keeps what its ranks leave."""

    name = "this machine"

    def __init__(self, rd: RunDir, number: int = 0, host: str | None = None) -> None:
        self.rd = rd
        self.number = number  # 0: the notebook's machine; a join agent's, in join order
        self.host = host or socket.gethostname()
        self.oom_base: int | None = None  # the OOM killer's count when the group started here
        self.clock_offset = 0.0  # add to its machine's wall clock for ours (0: it is ours)

    @property
    def label(self) -> str:
        """How messages name it, by its machine: 'node 1 (gpu-b)'."""
        return f"node {self.number} ({self.host})"

    # ---- the launcher --------------------------------------------------------------------------

    @abstractmethod
    async def start(self, work: Work) -> bool:
        """Give a launcher the group's work (the run directory is the site's); True if the
        launcher was started ahead of it (warm)."""

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
        """Until the launcher has exited, within a bound of the site's (a process in D state may
        take its time)."""

    @abstractmethod
    def launcher_outcome(self, log: Path) -> tuple[str, str]:
        """How the group ends by the launcher's account, once it has exited: (outcome, reason)."""

    @abstractmethod
    def torch_agent(self) -> TorchAgent:
        """torchelastic's agent now, for the zombie watchdog."""

    def ranks_up(self, spec: JobSpec) -> None:  # noqa: B027 - a hint a site may ignore
        """Every rank of the first attempt runs: a moment for the site to get ready for the next
        group (a warm launcher)."""

    async def cell_dir(self, cell_id: str, rd: RunDir) -> str | None:
        """A session cell's run directory as this site's ranks reach it (on this machine, the
        cell's own; another machine's site sends the cell's files there first); None when its
        machine has gone."""
        return str(rd.path)

    # ---- ranks -----------------------------------------------------------------------------

    @abstractmethod
    async def wait_gone(self, r: RankState) -> tuple[float, float]:
        """Until the rank's process has ended; returns when it was seen gone (time.time(),
        time.monotonic()). Sets `r.exit_code` when the site can read it at once."""

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
    ) -> list[protocol.records.Leftover]:
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
        run directory, what the site holds for it freed."""


async def stacks_of(
    ranks: list[RankState], site_of: Callable[[RankState], Site], wait_s: float
) -> dict[int, StackDump]:
    """Every given live rank's stack, each asked through its site, all sites at once."""
    out: dict[int, StackDump] = {}
    sites = {id(site_of(r)): site_of(r) for r in ranks}

    async def ask(site: Site) -> None:
        out.update(await site.stacks([r for r in ranks if site_of(r) is site], wait_s))

    async with anyio.create_task_group() as tg:
        for site in sites.values():
            tg.start_soon(ask, site)
    return out
