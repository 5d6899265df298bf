"""Where a rank group's ranks run, and what that changes in its life: the two lifecycles of
`rank_group.RankGroup`, behind the one small interface the group calls (`Placement`).

* `OneMachine`: this machine's site for the group's whole life; torch restarts the ranks in
  place, and every new attempt is a restart; the launcher's end is the group's.
* `InRounds`: machines a round at a time (`rounds.Rounds`): a round ends when a node joins or
  leaves or a rank fails, the next begins with the nodes there are (a failure or a departure
  spends a restart, an arrival does not); a launcher's end is its round's, not the group's.

What differs for the decision core (`decider.Decider`) is what a placement supplies: the
failures no restart follows (`final`), those judged only with evidence (`awaited`), whether a
site's news is of the current round (`hears`), and how a restart is carried out (`restart`).
"""

from __future__ import annotations

import signal
import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Protocol

import anyio
from anyio.abc import TaskGroup

from elastic_nb import protocol
from elastic_nb.common.rank_state import RankState
from elastic_nb.common.rundir import RunDir
from elastic_nb.common.spec import JobSpec
from elastic_nb.supervisor.nodes.agent_link import JoinAgentLink
from elastic_nb.supervisor.nodes.files import INPUTS
from elastic_nb.supervisor.nodes.remote_site import RemoteSite
from elastic_nb.supervisor.processes.site import Site, Survivor
from elastic_nb.supervisor.ranks.checkpoint_log import CheckpointLog, cost_words
from elastic_nb.supervisor.ranks.rank_book import RankBook
from elastic_nb.supervisor.runs import decider
from elastic_nb.supervisor.runs.reporter import Reporter
from elastic_nb.supervisor.runs.rounds import Machines, Rounds

__all__ = ["Group", "InRounds", "OneMachine", "Placement"]


class Group(Protocol):
    """What a placement uses of its group (rank_group.RankGroup): its mechanics, its state
    and its own hooks (the underscored ones)."""

    id: str
    spec: JobSpec
    rd: RunDir
    sites: list[Site]
    book: RankBook
    report: Reporter
    checkpoints: CheckpointLog
    nodes_missing: bool

    @property
    def attempt(self) -> int: ...
    @property
    def decided(self) -> bool: ...
    @property
    def restarts(self) -> int: ...
    @property
    def last_failure(self) -> tuple[float, str, bool] | None: ...
    @property
    def task_group(self) -> TaskGroup: ...
    def attempt_failed(self, attempt: int) -> bool: ...
    def hear(self, event: decider.Event) -> None: ...
    def signal(self, ranks: list[RankState], sig: int) -> None: ...
    def alert(self, kind: str, severity: str, title: str, **about: Any) -> None: ...
    def poll_checkpoints(self) -> None: ...
    async def start_sites(
        self, sites: list[Site], plan: protocol.launcher.LaunchRound | None
    ) -> None: ...
    async def stop_sites(self, ended: bool) -> list[Survivor]: ...
    def _decide(self, outcome: str, reason: str) -> None: ...
    async def _flush(self) -> None: ...
    async def _launcher_ended(self, outcome: tuple[str, str]) -> tuple[str, str]: ...
    async def _relayed_rank(self, stream: Any, peer: int | None, site: Site) -> None: ...


class Placement(ABC):
    """What the group asks of where its ranks run. The group's other half: it acts through the
    group's own mechanics (its sites, its report, its decision)."""

    multi_node: bool
    final: frozenset[str]  # failures no restart follows here (decider.Decider)
    awaited: frozenset[str]  # failures judged only with evidence here, besides timeouts

    def __init__(self, group: Group) -> None:
        self.g = group

    @abstractmethod
    def world_size(self, attempt: int) -> int:
        """Ranks in `attempt`."""

    @abstractmethod
    async def begin(self, tg: TaskGroup) -> None:
        """The first launcher(s)."""

    def node_label(self, site: Site) -> str | None:
        """How the group's events and errors name a site's machine (None: one machine, no need)."""
        return site.label if self.multi_node else None

    @abstractmethod
    def rendezvous(self, attempt: int, seconds: float) -> None:
        """A launcher's rendezvous of `attempt` took `seconds`."""

    @abstractmethod
    def attempt_began(self, attempt: int) -> None:
        """A new attempt's first rank started."""

    @abstractmethod
    def rank_started(self, site: Site, r: RankState) -> None:
        """A rank of the current attempt started at `site`."""

    @abstractmethod
    async def launcher_ended(self, site: Site, outcome: tuple[str, str]) -> None:
        """`site`'s launcher exited, saying (or not) how: `outcome`."""

    @abstractmethod
    def round_of(self, site: Site) -> int:
        """The attempt `site`'s news is of (a closed round's news comes late)."""

    @abstractmethod
    def restart(self, action: decider.Restart) -> None:
        """An attempt failed within the budget: the next attempt, as this placement makes it."""

    @abstractmethod
    def close(self) -> None:
        """After the group's end."""


class OneMachine(Placement):
    multi_node = False
    # An exit(0) without finishing leaves torchelastic waiting forever for a return value
    # (multiprocessing/api.py, _poll), and torch's agent that failed restarts nothing.
    final = frozenset({"exit0", "agent"})
    awaited: frozenset[str] = frozenset()

    def __init__(self, group: Group, site: Site) -> None:
        super().__init__(group)
        self.site = site

    def world_size(self, attempt: int) -> int:
        return self.g.spec.nproc

    async def begin(self, tg: TaskGroup) -> None:
        self.g.hear(decider.AttemptOpened(time.time(), 0, self.g.spec.nproc, counted=False))
        await self.g.start_sites([self.site], None)

    def rendezvous(self, attempt: int, seconds: float) -> None:
        pass  # the launcher's event says it; a round's timeline is a multi-node group's

    def attempt_began(self, attempt: int) -> None:
        # torch restarted the group
        self.g.hear(decider.AttemptOpened(time.time(), attempt, self.g.spec.nproc, counted=True))

    def rank_started(self, site: Site, r: RankState) -> None:
        pass  # every rank here: nothing to place

    def close(self) -> None:
        pass  # the site closes with the group

    async def launcher_ended(self, site: Site, outcome: tuple[str, str]) -> None:
        outcome = await self.g._launcher_ended(outcome)
        self.g.hear(decider.LauncherExited(time.time(), outcome))

    def round_of(self, site: Site) -> int:
        return self.g.attempt

    def restart(self, action: decider.Restart) -> None:
        live = [x for x in self.g.book.of(action.attempt) if x.died_at is None]
        if action.kind == "exit0":
            # torchelastic waits forever for the return value of a rank that exited 0
            # (multiprocessing/api.py, _poll): the others' deaths make it restart the group.
            self.g.signal(live, signal.SIGKILL)
        elif action.kind == "desync":
            # In torch's eyes nothing has failed: the waiting ranks would sit in their
            # collective until its timeout. Ending them makes the agent restart the group now.
            self.g.signal([x for x in live if x.done is None], signal.SIGTERM)


class InRounds(Placement):
    multi_node = True
    final: frozenset[str] = frozenset()
    awaited = frozenset({"peer"})

    def __init__(self, group: Group, machines: Machines) -> None:
        super().__init__(group)
        self.rounds = Rounds(group.spec, machines)
        self._lock = anyio.Lock()
        self._changing = False  # a round is ending or starting
        self._rounds_of: dict[Site, int] = {}  # each site's round's attempt

    def world_size(self, attempt: int) -> int:
        return self.rounds.world_size(attempt)

    async def begin(self, tg: TaskGroup) -> None:
        tg.start_soon(self._follow_members)

    def rendezvous(self, attempt: int, seconds: float) -> None:
        self.rounds.rendezvous(attempt, seconds)
        self.g.report.rounds(self.rounds.timeline)

    def attempt_began(self, attempt: int) -> None:
        pass  # its round began it: the restarts it spent were counted as the round began

    def rank_started(self, site: Site, r: RankState) -> None:
        r.where = site.label
        if self.rounds.running(r.attempt, len(self.g.book.of(r.attempt))):
            self.g.report.rounds(self.rounds.timeline)
            entry = self.rounds.entry(r.attempt)
            assert entry is not None
            self.g.report.event("round.running", attempt=r.attempt, s=entry["running_s"])

    def round_of(self, site: Site) -> int:
        return self._rounds_of.get(site, -1)

    def restart(self, action: decider.Restart) -> None:
        # The next round, with the nodes there are (its own ranks' failure or departure
        # spends a restart); the others of this round are ended with it.
        self.new_round(action.why, counted=True)

    def close(self) -> None:
        self.rounds.close()

    def remote_site(self, agent: JoinAgentLink, store_port: int) -> RemoteSite:
        """A joined machine's site for the next round."""
        return RemoteSite(self.g.rd, agent, store_port, self.g._relayed_rank, self._shipped_files())

    def _shipped_files(self) -> dict[str, Path]:
        """What another machine's ranks read: the run directory's inputs, and the notebook's
        own modules the cell imports (into the job's working directory there)."""
        files = {f"run/{name}": self.g.rd.path / name for name in INPUTS}
        for path in self.g.spec.ship:
            files[f"cwd/{Path(path).name}"] = Path(path)
        return files

    def round_failed(self, why: str) -> None:
        """A multi-node round ended with no rank to blame (a node left before its ranks started,
        its launcher died): as a failure, within the budget."""
        self.g.hear(decider.RoundFailed(time.time(), self.rounds.next_attempt - 1, why))

    def new_round(self, why: str, counted: bool) -> None:
        """A multi-node group's next round, after the current one's end (a failure or a
        departure spends a restart). Asked twice for one round (a failure and its node's loss
        told apart), it happens once."""
        self.g.task_group.start_soon(self._next_round, why, counted, self.rounds.next_attempt - 1)

    async def _follow_members(self) -> None:
        """The group's store, its first round, then what changes of members bring: a node that
        joins while below MAX is a round of its own (no restart spent); one that left before its
        round's ranks started is a failure with nothing else to say so."""
        rounds = self.rounds
        await rounds.open_store()
        await self._next_round("first round", False)
        while not self.g.decided:
            await rounds.cluster.changed.wait()
            if self.g.decided or self._changing:
                continue
            current = self.g.sites
            lost = [s for s in current if isinstance(s, RemoteSite) and s.lost]
            if lost and not self.g.book.of(rounds.next_attempt - 1):
                self.round_failed(f"{lost[0].label} left: {lost[0].lost}")
                continue
            if rounds.newcomers(current) and len(current) < self.g.spec.nnodes_max:
                await self._next_round(None, False, rounds.next_attempt - 1)

    async def _next_round(self, why: str | None, counted: bool, ending: int | None = None) -> None:
        """End the round there is and start the next with the nodes there are now. `ending`:
        the round's attempt this change is for (None: the first round), skipped if another
        change has come first; `why` None: an arrival's, said once the lock is ours."""
        rounds = self.rounds
        async with self._lock:
            if self.g.decided or (ending is not None and ending != rounds.next_attempt - 1):
                return
            if why is None:
                newcomers = rounds.newcomers(self.g.sites)
                if not newcomers or len(self.g.sites) >= self.g.spec.nnodes_max:
                    return
                why = ", ".join(a.label() for a in newcomers) + " joined"
            self._changing = True
            try:
                started, stop_s = time.time(), None
                if self.g.sites:
                    ending = rounds.next_attempt - 1
                    self.g.hear(decider.RoundEnding(time.time(), ending))
                    self.g.report.set_state("restarting")
                    await self.g.stop_sites(ended=False)
                    stop_s = time.time() - started
                    self.g.hear(decider.RoundEnded(started, ending))
                    await self.g._flush()

                def waiting(words: str) -> None:
                    self.g.report.set_state("waiting")
                    self.g.alert("nodes", "info", words)

                sites = await rounds.gather(
                    started, waiting, lambda agent: self.remote_site(agent, rounds.store_port)
                )
                if isinstance(sites, str):
                    self.g.report.event("round.failed", why=sites)
                    self.g.nodes_missing = not self.g.decided
                    self.g._decide("failed", sites)
                    return
                spent = self.g.restarts + counted
                entry = rounds.record(sites, why, counted, spent, started, stop_s)
                self.g.hear(
                    decider.AttemptOpened(
                        time.time(), entry["attempt"], entry["world_size"], counted
                    )
                )
                self.g.report.rounds(rounds.timeline)
                self.g.report.event("round", **entry)
                if entry["attempt"] > 0:
                    self._round_alert(entry)
                plan = rounds.plan(entry["attempt"], len(sites), self.g.id)
                self._rounds_of.update((site, entry["attempt"]) for site in sites)
            finally:
                self._changing = False
            await self.g.start_sites(sites, plan)

    def _round_alert(self, entry: protocol.records.Round) -> None:
        counted = entry["counted"]
        spent = (
            f"restart {entry['restarts']}/{self.g.spec.max_restarts}"
            if counted
            else "no restart spent"
        )
        title = (
            f"attempt {entry['attempt']}: {entry['why']}; {len(entry['nodes'])} nodes, "
            f"world size {entry['world_size']} ({spent})"
        )
        if counted and self.g.last_failure is not None:
            self.g.poll_checkpoints()  # a save committed just before the failure counts
            cost = cost_words(self.g.checkpoints, *self.g.last_failure)
            title += f"; {cost}" if cost else ""
        self.g.alert("restart" if counted else "round", "warning" if counted else "info", title)

    async def launcher_ended(self, site: Site, outcome: tuple[str, str]) -> None:
        """A site's launcher exited. Past its round, or a success (its exit barrier: every
        site's ranks finished), that says nothing; otherwise the site failed under the round,
        unless its ranks' ends explain it (judged first, 2 s at most)."""
        if site not in self.g.sites or self._changing or outcome[0] == "succeeded":
            return
        with anyio.move_on_after(2.0):
            while not self.g.decided and site in self.g.sites and not self._changing:
                if self.g.attempt_failed(self.g.attempt):
                    return
                await anyio.sleep(0.05)
        if site in self.g.sites and not self.g.decided and not self._changing:
            self.round_failed(outcome[1])
