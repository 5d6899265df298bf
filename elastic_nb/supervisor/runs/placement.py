"""Where a rank group's ranks run, and what that changes in its life: the two lifecycles of
`rank_group.RankGroup`, behind the one small interface the group calls (`Placement`).

* `OneMachine`: this machine's node for the group's whole life; torch restarts the ranks in
  place, and every new attempt is a restart; the launcher's end is the group's.
* `InRounds`: machines a round at a time (`rounds.Rounds`): a round ends when a node joins or
  leaves or a rank fails, the next begins with the nodes there are (a failure or a departure
  spends a restart, an arrival does not); a launcher's end is its round's, not the group's.
"""

from __future__ import annotations

import time
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, Protocol

import anyio
from anyio.abc import TaskGroup

from elastic_nb import protocol
from elastic_nb.common.rundir import RunDir
from elastic_nb.common.spec import JobSpec
from elastic_nb.supervisor.nodes.agent_link import JoinAgentLink
from elastic_nb.supervisor.nodes.files import INPUTS
from elastic_nb.supervisor.nodes.remote_node import RemoteNode
from elastic_nb.supervisor.processes.node import Node, Survivor
from elastic_nb.supervisor.ranks.checkpoint_log import CheckpointLog, cost_words
from elastic_nb.supervisor.ranks.rank_book import RankBook
from elastic_nb.supervisor.ranks.rank_state import RankState
from elastic_nb.supervisor.runs.reporter import Reporter
from elastic_nb.supervisor.runs.rounds import Machines, Rounds

__all__ = ["Group", "InRounds", "OneMachine", "Placement"]


class Group(Protocol):
    """What a placement uses of its group (rank_group.RankGroup): its mechanics, its state
    and its own hooks (the underscored ones)."""

    id: str
    spec: JobSpec
    rd: RunDir
    attempt: int
    nodes: list[Node]
    book: RankBook
    report: Reporter
    checkpoints: CheckpointLog
    restarts: int
    restarts_at: dict[int, int]
    replaced: set[int]
    nodes_missing: bool
    teardown_at: float | None
    last_failure: tuple[float, str, bool] | None

    @property
    def decided(self) -> bool: ...
    @property
    def task_group(self) -> TaskGroup: ...
    def restarts_left(self, attempt: int) -> bool: ...
    def attempt_failed(self, attempt: int) -> bool: ...
    def alert(self, kind: str, severity: str, title: str, **about: Any) -> None: ...
    def poll_checkpoints(self) -> None: ...
    async def start_nodes(
        self, nodes: list[Node], plan: protocol.launcher.LaunchRound | None
    ) -> None: ...
    async def stop_nodes(self, ended: bool) -> list[Survivor]: ...
    def _decide(self, outcome: str, reason: str) -> None: ...
    async def _flush(self) -> None: ...
    async def _launcher_ended(self, outcome: tuple[str, str]) -> tuple[str, str]: ...
    async def _relayed_rank(self, stream: Any, peer: int | None, node: Node) -> None: ...


class Placement(ABC):
    """What the group asks of where its ranks run. The group's other half: it acts through the
    group's own mechanics (its nodes, its report, its decision)."""

    multi_node: bool

    def __init__(self, group: Group) -> None:
        self.g = group

    @abstractmethod
    def world_size(self, attempt: int) -> int:
        """Ranks in `attempt`."""

    @abstractmethod
    async def begin(self, tg: TaskGroup) -> None:
        """The first launcher(s)."""

    def node_label(self, node: Node) -> str | None:
        """How the group's events and errors name a node (None: one machine, no need)."""
        return node.label if self.multi_node else None

    @abstractmethod
    def rendezvous(self, attempt: int, seconds: float) -> None:
        """A launcher's rendezvous of `attempt` took `seconds`."""

    @abstractmethod
    def attempt_began(self, attempt: int) -> None:
        """A new attempt's first rank started."""

    @abstractmethod
    def rank_started(self, node: Node, r: RankState) -> None:
        """A rank of the current attempt started on `node`."""

    @abstractmethod
    async def launcher_ended(self, node: Node, outcome: tuple[str, str]) -> None:
        """`node`'s launcher exited, saying (or not) how: `outcome`."""

    @abstractmethod
    def agent_failed(self, node: Node, why: str, at: float) -> None:
        """torch's agent on `node` raised at `at` (our clock)."""

    @abstractmethod
    def close(self) -> None:
        """After the group's end."""

    def _stopped_since(self, at: float) -> None:
        """torch's agent failed at `at` and then SIGTERMed its ranks: once that ends the group,
        ranks that died since were stopped, not failed (a loaded machine may see their deaths
        before the agent's word)."""
        if self.g.decided and self.g.teardown_at is not None:
            self.g.teardown_at = min(self.g.teardown_at, at)


class OneMachine(Placement):
    multi_node = False

    def __init__(self, group: Group, node: Node) -> None:
        super().__init__(group)
        self.node = node

    def world_size(self, attempt: int) -> int:
        return self.g.spec.nproc

    async def begin(self, tg: TaskGroup) -> None:
        await self.g.start_nodes([self.node], None)

    def rendezvous(self, attempt: int, seconds: float) -> None:
        pass  # the launcher's event says it; a round's timeline is a multi-node group's

    def attempt_began(self, attempt: int) -> None:
        self.g.restarts = self.g.restarts_at[attempt] = attempt  # torch restarted the group

    def rank_started(self, node: Node, r: RankState) -> None:
        pass  # every rank here: nothing to place

    def close(self) -> None:
        pass  # the node closes with the group

    async def launcher_ended(self, node: Node, outcome: tuple[str, str]) -> None:
        self.g._decide(*await self.g._launcher_ended(outcome))

    def agent_failed(self, node: Node, why: str, at: float) -> None:
        self.g._decide("failed", why)
        self._stopped_since(at)


class InRounds(Placement):
    multi_node = True

    def __init__(self, group: Group, machines: Machines) -> None:
        super().__init__(group)
        self.rounds = Rounds(group.spec, machines)
        self._lock = anyio.Lock()
        self._changing = False  # a round is ending or starting

    def world_size(self, attempt: int) -> int:
        return self.rounds.world_size(attempt)

    async def begin(self, tg: TaskGroup) -> None:
        tg.start_soon(self._follow_members)

    def rendezvous(self, attempt: int, seconds: float) -> None:
        self.rounds.rendezvous(attempt, seconds)
        self.g.report.rounds(self.rounds.timeline)

    def attempt_began(self, attempt: int) -> None:
        pass  # its round began it: the restarts it spent were counted as the round began

    def rank_started(self, node: Node, r: RankState) -> None:
        r.where = node.label
        if self.rounds.running(r.attempt, len(self.g.book.of(r.attempt))):
            self.g.report.rounds(self.rounds.timeline)
            entry = self.rounds.entry(r.attempt)
            assert entry is not None
            self.g.report.event("round.running", attempt=r.attempt, s=entry["running_s"])

    def agent_failed(self, node: Node, why: str, at: float) -> None:
        if node in self.g.nodes and not self.g.decided and not self._changing:
            self.round_failed(why)
            self._stopped_since(at)

    def close(self) -> None:
        self.rounds.close()

    def remote_node(self, agent: JoinAgentLink, store_port: int) -> RemoteNode:
        """A joined machine's node for the next round."""
        return RemoteNode(self.g.rd, agent, store_port, self.g._relayed_rank, self._shipped_files())

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
        self.g.report.event("round.failed", why=why)
        if not self.g.restarts_left(self.g.attempt):
            m = self.g.spec.max_restarts
            self.g._decide("failed", f"{why}; no restarts are left ({m}/{m})")
            return
        self.new_round(why, counted=True)

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
            current = self.g.nodes
            lost = [n for n in current if isinstance(n, RemoteNode) and n.lost]
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
                newcomers = rounds.newcomers(self.g.nodes)
                if not newcomers or len(self.g.nodes) >= self.g.spec.nnodes_max:
                    return
                why = ", ".join(a.label() for a in newcomers) + " joined"
            self._changing = True
            try:
                started, stop_s = time.time(), None
                if self.g.nodes:
                    ending = rounds.next_attempt - 1
                    self.g.replaced.add(ending)
                    self.g.report.set_state("restarting")
                    await self.g.stop_nodes(ended=False)
                    stop_s = time.time() - started
                    await self._round_ended(ending, started)

                def waiting(words: str) -> None:
                    self.g.report.set_state("waiting")
                    self.g.alert("nodes", "info", words)

                nodes = await rounds.gather(
                    started, waiting, lambda agent: self.remote_node(agent, rounds.store_port)
                )
                if isinstance(nodes, str):
                    self.g.report.event("round.failed", why=nodes)
                    self.g.nodes_missing = not self.g.decided
                    self.g._decide("failed", nodes)
                    return
                if counted:
                    self.g.restarts += 1
                entry = rounds.record(nodes, why, counted, self.g.restarts, started, stop_s)
                self.g.restarts_at[entry["attempt"]] = self.g.restarts
                self.g.report.rounds(rounds.timeline)
                self.g.report.event("round", **entry)
                if entry["attempt"] > 0:
                    self._round_alert(entry)
                plan = rounds.plan(entry["attempt"], len(nodes), self.g.id)
            finally:
                self._changing = False
            await self.g.start_nodes(nodes, plan)

    async def _round_ended(self, attempt: int, at: float) -> None:
        """The ended round's ranks as its end left them, for the timeline: a rank stopped for the
        next round says so (it stayed "running" there); one that failed or was lost keeps its
        word. Sent before the next round's chips take their ranks' places (an update holds one
        chip a rank), so a rank the book still counts running is gone all the same: the stop
        ended every process of the round, and its node saw it go; its exit status (a forked
        rank's, from the launcher the round's end took too) may come seconds later or never. A lost
        node's ranks are not among them: its loss tells their ends at once (RemoteNode.on_lost)."""
        for r in self.g.book.of(attempt):
            chip = self.g.book.chip(r, at)
            if r.kind(at) == "terminated" or chip["state"] == "running":
                chip["state"], chip["label"] = "stopped", "stopped for the next round"
            self.g.report.chip(r.rank, chip)
        await self.g._flush()

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

    async def launcher_ended(self, node: Node, outcome: tuple[str, str]) -> None:
        """A node's launcher exited. Past its round, or a success (its exit barrier: every
        node's ranks finished), that says nothing; otherwise the node failed under the round,
        unless its ranks' ends explain it (judged first, 2 s at most)."""
        if node not in self.g.nodes or self._changing or outcome[0] == "succeeded":
            return
        with anyio.move_on_after(2.0):
            while not self.g.decided and node in self.g.nodes and not self._changing:
                if self.g.attempt_failed(self.g.attempt):
                    return
                await anyio.sleep(0.05)
        if node in self.g.nodes and not self.g.decided and not self._changing:
            self.round_failed(outcome[1])
