"""What a rank group decides, apart from everything it does: a sans-I/O state machine.

`Decider.handle(event)` takes one typed event and returns the actions it decides. It owns no
task, no process, no file and no clock but the events' times (`t`, our clock): the group's shell
(`rank_group.RankGroup`, `job.Job`, the placements) turns what its sites, timers and clients
say into events, once, and carries the actions out; tests/simulation.py feeds it the orderings
the real world allows and checks what it decided after every step.

What it decides, first come first served:

* every rank of an attempt finished the cell and exited                  -> succeeded
* a rank failed on its own, in the last attempt the budget allows        -> failed
  (within the budget: `Restart`, which the placement carries out: torch restarts in place, or
  the next round across machines)
* torch's agent failed, a round failed, a launcher exited                -> failed, or a restart
* a cause from outside the ranks (a stop, --timeout, the zombie watchdog) -> its outcome

A session's running cell is decided here too (`cell_rules.CellRules`: its own events and
actions): its ranks' answers, stops and findings by its rules, and the group's judgment of a
death or its end as soon as the group decides it.

Who failed first is judged with evidence, not by arrival: a collective timeout waits for every
live rank's stack (`Diagnose`), a peer's error for the rank that went to be seen gone (across
machines, and the flight recorders), a SIGTERM elastic_nb did not send for torch's agent's
word (`Wait`). A failure that comes while a diagnosis is under way waits for it, and so does a
launcher's last word.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from typing import Any

from elastic_nb.common.rank_state import RankState
from elastic_nb.supervisor.forensics.verdict import FAILED, analyze
from elastic_nb.supervisor.runs import cell_rules
from elastic_nb.supervisor.runs.cell_rules import CellAction, CellEvent, CellRules

__all__ = [
    "AGENT_WORD_S",
    "CELL_ENDED",
    "PEER_GONE_WAIT_S",
    "Action",
    "AgentFailed",
    "AnyAction",
    "AnyEvent",
    "AttemptOpened",
    "AttemptOver",
    "Decide",
    "Decider",
    "Diagnose",
    "Diagnosed",
    "Ended",
    "Event",
    "LauncherExited",
    "LookBegan",
    "OomAlert",
    "RankExited",
    "RankFailed",
    "RankStarted",
    "Record",
    "Restart",
    "RoundEnded",
    "RoundEnding",
    "RoundFailed",
    "Show",
    "TeardownBegan",
    "Wait",
    "Waited",
    "Watchdog",
]

# For torch's agent to say it failed, when a rank died of its SIGTERM: the word is in the
# launcher's pipe before the SIGTERM is sent, but a full run on 2 cores read it over 1 s later.
# Only a SIGTERM from outside (a user's kill) waits this out.
AGENT_WORD_S = 3.0
PEER_GONE_WAIT_S = 1.0  # for the rank whose going a peer error reports to be seen gone
STOPPED_FOR_ROUND = "stopped for the next round"
CELL_ENDED = "cell"  # a Restart's kind when a session's cell ended its ranks (cell_rules.KillRanks)

# ---- events: what the shell heard, once ----------------------------------------------------


@dataclass(frozen=True)
class Event:
    t: float  # when it happened, on our clock


@dataclass(frozen=True)
class AttemptOpened(Event):
    """An attempt's ranks are about to start: how many, and whether a restart was spent."""

    attempt: int
    world_size: int
    counted: bool


@dataclass(frozen=True)
class RankStarted(Event):
    r: RankState


@dataclass(frozen=True)
class RankFailed(Event):
    """A live rank's failure record has appeared (it raised; its process may still be up)."""

    r: RankState


@dataclass(frozen=True)
class Watchdog(Event):
    """NCCL's watchdog says a collective of this rank timed out, and NCCL will end it."""

    r: RankState
    line: str


@dataclass(frozen=True)
class RankExited(Event):
    """The rank was seen gone, with its exit status where it came (or its bound passed)."""

    r: RankState


@dataclass(frozen=True)
class AgentFailed(Event):
    """torch's agent of `attempt`'s round raised at `at`, and SIGTERMs its ranks."""

    attempt: int
    why: str
    at: float


@dataclass(frozen=True)
class LauncherExited(Event):
    """The group's launcher exited with `outcome`; its end is the group's (one machine)."""

    outcome: tuple[str, str]


@dataclass(frozen=True)
class RoundFailed(Event):
    """`attempt`'s round ended with no rank to blame (a node left before its ranks started,
    its launcher died)."""

    attempt: int
    why: str


@dataclass(frozen=True)
class AttemptOver(Event):
    """torch restarted the group's ranks before their deaths were judged (its monitor can see
    a death first): `attempt` is over, failed."""

    attempt: int


@dataclass(frozen=True)
class RoundEnding(Event):
    """A new round replaces `attempt`: what its ranks do from now on is no failure of theirs."""

    attempt: int


@dataclass(frozen=True)
class RoundEnded(Event):
    """The stop of `attempt`'s round, begun at `t`, has returned: every process of it is gone."""

    attempt: int


@dataclass(frozen=True)
class LookBegan(Event):
    """The desync watch takes a full look at `attempt` (answered by Diagnosed, what="look")."""

    attempt: int


@dataclass(frozen=True)
class Diagnosed(Event):
    """A `Diagnose` or a look ended: `culprit` the rank a confirmed desync names, with
    `reason` its words (None: no desync)."""

    attempt: int
    what: str  # "timeout" | "peer" | "look"
    r: RankState | None = None
    culprit: RankState | None = None
    reason: str | None = None


@dataclass(frozen=True)
class Waited(Event):
    """A `Wait` ran out."""

    attempt: int
    what: str


@dataclass(frozen=True)
class Ended(Event):
    """A cause from outside the ranks ends the group: a stop, --timeout, the zombie watchdog,
    nodes that did not come, the supervisor's shutdown."""

    outcome: str
    reason: str


@dataclass(frozen=True)
class TeardownBegan(Event):
    """Ending the ranks has begun (a decision's teardown, when the decision set no clock)."""


# ---- actions: what the shell carries out -----------------------------------------------------


@dataclass(frozen=True)
class Action:
    pass


@dataclass(frozen=True)
class Decide(Action):
    outcome: str
    reason: str


@dataclass(frozen=True)
class Show(Action):
    """The rank's chip, as it stands (`ended`: its attempt ended under it with these words)."""

    r: RankState
    ended: str | None = None


@dataclass(frozen=True)
class OomAlert(Action):
    r: RankState


@dataclass(frozen=True)
class Diagnose(Action):
    """Take the evidence while the ranks live, then answer Diagnosed: "timeout" (every stack,
    then release the held ranks) or "peer" (did the rank that went leave the cell early?)."""

    what: str
    r: RankState


@dataclass(frozen=True)
class Wait(Action):
    """Answer Waited(attempt, what) after `seconds`, unless the word waited for comes first:
    "agent" (torch's agent's), "peer" (the rank that went seen gone, then Diagnose), "gone" (the
    same, on one machine: no diagnosis)."""

    attempt: int
    what: str
    seconds: float


@dataclass(frozen=True)
class Restart(Action):
    """The attempt failed within the budget: the placement restarts (in place, or the next
    round). `r`, `kind`: the rank that failed and how (None: the round itself)."""

    attempt: int
    why: str
    r: RankState | None = None
    kind: str | None = None


@dataclass(frozen=True)
class Record(Action):
    """An entry of the run's event log."""

    name: str
    fields: dict[str, Any] = field(default_factory=dict)


# What the core hears and decides: a group's, and its running cell's (cell_rules)
AnyEvent = Event | CellEvent
AnyAction = Action | CellAction

# ---- the decider -------------------------------------------------------------------------------


class Decider:
    def __init__(
        self,
        max_restarts: int,
        final: frozenset[str] = frozenset(),
        awaited: frozenset[str] = frozenset(),
        stops_ranks: frozenset[str] = frozenset({"failed", "timeout", "interrupted", "stopped"}),
    ) -> None:
        """What the placement and the kind of group supply: `final`, the failures no restart
        follows where the ranks run ("exit0" and "agent" on one machine, where torch restarts);
        `awaited`, the failures judged only with evidence besides the collective timeouts
        ("peer" across machines); `stops_ranks`, the outcomes whose decision is the moment the
        group begins to end its ranks (what dies from then on was stopped; a session's ranks
        are ended later, by its teardown: TeardownBegan)."""
        self.max_restarts = max_restarts
        self.final, self.awaited, self.stops_ranks = final, awaited, stops_ranks
        self.ranks: dict[tuple[int, int], RankState] = {}
        self.world: dict[int, int] = {}  # attempt -> ranks in it
        self.attempt = 0  # the latest attempt a rank of which started
        self.opened = 0  # the latest attempt opened (a round's, before its ranks start)
        self.restarts = 0  # spent
        self.restarts_at: dict[int, int] = {0: 0}  # attempt -> restarts spent when it began
        self.failed: set[int] = set()  # attempts a failure ended
        self.pinned: dict[int, RankState] = {}  # attempt -> the rank its failure is pinned on
        self.replaced: set[int] = set()  # attempts a new round ended (no failure of theirs)
        self.agent_failed_in: set[int] = set()  # attempts whose torch agent failed
        self.under_way: set[int] = set()  # attempts being diagnosed
        self.outcome: tuple[str, str] | None = None
        self.teardown_at: float | None = None  # when ending the ranks began
        # The latest failure that ended an attempt (when, who, lost with its machine).
        self.last_failure: tuple[float, str, bool] | None = None
        self._deferred: list[tuple[RankState, str]] = []  # failures that came mid-diagnosis
        self._waits: dict[tuple[int, str], RankState] = {}  # open Waits, with their rank
        self._launcher: tuple[str, str] | None = None  # a launcher's end, held for a diagnosis
        self.cell: CellRules | None = None  # a session's running cell
        self._out: list[AnyAction] = []

    # ---- reading ---------------------------------------------------------------------------

    @property
    def decided(self) -> bool:
        return self.outcome is not None

    def of(self, attempt: int) -> list[RankState]:
        return [r for (a, _), r in sorted(self.ranks.items()) if a == attempt]

    def world_size(self, attempt: int) -> int:
        return self.world.get(attempt, 0)

    @property
    def current(self) -> int:
        """The attempt news must be of to count: a closed round's comes late."""
        return max(self.attempt, self.opened)

    def restarts_left(self, attempt: int) -> bool:
        """A failure in `attempt` can still be restarted from."""
        return self.restarts_at.get(attempt, self.restarts) < self.max_restarts

    # ---- the one entry ---------------------------------------------------------------------

    def handle(self, event: AnyEvent) -> list[AnyAction]:
        self._out = []
        getattr(self, _HANDLERS[type(event)])(event)
        return self._out

    # ---- events ----------------------------------------------------------------------------

    def _opened(self, e: AttemptOpened) -> None:
        if e.counted:
            self.restarts += 1
        self.restarts_at[e.attempt] = self.restarts
        self.world[e.attempt] = e.world_size
        self.opened = max(self.opened, e.attempt)

    def _started(self, e: RankStarted) -> None:
        r = e.r
        self.ranks[(r.attempt, r.rank)] = r
        self.attempt = max(self.attempt, r.attempt)
        self._show(r)

    def _failed(self, e: RankFailed) -> None:
        self._judge(e.t, e.r)

    def _watchdog(self, e: Watchdog) -> None:
        if e.r.watchdog is None and e.r.failure is None:
            e.r.watchdog = {"time": e.t, "line": e.line}
            self._judge(e.t, e.r)

    def _exited(self, e: RankExited) -> None:
        r = e.r
        peer = self._waits.get((r.attempt, "peer"))
        if peer is not None and peer is not r:
            del self._waits[(r.attempt, "peer")]
            self._out.append(Diagnose("peer", peer))  # the rank that went is seen gone
        peer = self._waits.get((r.attempt, "gone"))
        if peer is not None and peer is not r:
            del self._waits[(r.attempt, "gone")]
            self._peer_failed(e.t, peer)  # the rank that went is seen gone
            self._diagnosis_ended(e.t, r.attempt)
        self._judge(e.t, r)

    def _agent_failed(self, e: AgentFailed) -> None:
        attempt = e.attempt
        self.agent_failed_in.add(attempt)
        if self._of_now(attempt):
            if not self.decided:
                self._round_failed(e.t, "agent", e.why)
            self._stopped_since(e.at)
        if self._waits.pop((attempt, "agent"), None) is not None:
            self._diagnosis_ended(e.t, attempt)  # the SIGTERM it waited about is explained

    def _stopped_since(self, at: float) -> None:
        """torch's agent SIGTERMed its ranks from `at` on: once that ends the group, ranks that
        died since were stopped, not failed (a loaded machine may see their deaths before its
        word)."""
        if self.decided and self.teardown_at is not None:
            self.teardown_at = min(self.teardown_at, at)

    def _launcher_exited(self, e: LauncherExited) -> None:
        # torchelastic gives up the moment a rank fails; a diagnosis under way (stacks taken
        # while the others were still alive) decides first, or its verdict would be lost.
        if self.under_way:
            self._launcher = e.outcome
        else:
            self._decide(e.t, *e.outcome)

    def _round_failed_event(self, e: RoundFailed) -> None:
        if self._of_now(e.attempt):
            self._out.append(Record("round.failed", {"why": e.why}))
            self._round_failed(e.t, "round", e.why)

    def _attempt_over(self, e: AttemptOver) -> None:
        if e.attempt not in self.failed:
            self.failed.add(e.attempt)
            self._end_cell(e.t, e.attempt, "torchelastic restarted its ranks")

    def _round_ending(self, e: RoundEnding) -> None:
        self.replaced.add(e.attempt)

    def _round_ended(self, e: RoundEnded) -> None:
        """Its ranks as its end left them, for the timeline: a rank stopped for the next round
        says so (it stayed "running" there); one that failed or was lost keeps its word. Said
        before the next round's chips take their ranks' places (an update holds one chip a
        rank), so a rank still counted running is gone all the same: the stop ended every
        process of the round, and its exit status (a forked rank's, from the launcher the
        round's end took too) may come seconds later, or never. A lost node's ranks are not
        among them: its loss tells their ends at once (RemoteSite.on_lost)."""
        self.replaced.add(e.attempt)
        for r in self.of(e.attempt):
            kind = r.kind(e.t)
            running = kind == "running" or (kind == "done" and r.died_at is None)
            self._out.append(
                Show(r, STOPPED_FOR_ROUND if running or kind == "terminated" else None)
            )

    def _look_began(self, e: LookBegan) -> None:
        self.under_way.add(e.attempt)

    def _diagnosed(self, e: Diagnosed) -> None:
        self.under_way.discard(e.attempt)
        if e.culprit is not None:
            self._fail_attempt(e.t, e.culprit, "desync", e.reason)
        elif e.what == "timeout" and e.r is not None:
            self._fail_attempt(e.t, e.r, "collective_timeout")
        elif e.what == "peer" and e.r is not None:
            self._peer_failed(e.t, e.r)  # no desync
        self._after_diagnosis(e.t)

    def _waited(self, e: Waited) -> None:
        r = self._waits.pop((e.attempt, e.what), None)
        if r is None:
            return  # its word came first
        if e.what == "peer":
            self._out.append(Diagnose("peer", r))
        elif e.what == "gone":
            self._peer_failed(e.t, r)  # the rank that went was not seen go: the peer's word
            self._diagnosis_ended(e.t, e.attempt)
        elif e.what == "agent":
            if not self.decided:
                self._fail_attempt(e.t, r, "signal")
            self._diagnosis_ended(e.t, e.attempt)

    def _ended(self, e: Ended) -> None:
        self._decide(e.t, e.outcome, e.reason)

    def _teardown_began(self, e: TeardownBegan) -> None:
        if self.teardown_at is None:
            self.teardown_at = e.t

    def _cell_began(self, e: cell_rules.CellBegan) -> None:
        """A session's cell runs on `e.attempt`: decided by its rules from now on, and at once
        if the group has already ended or failed that attempt."""
        self.cell = CellRules(e)
        if self.outcome is not None:
            self._out += self.cell.end(e.t, f"the session ended: {self.outcome[1]}", False)
        elif e.attempt in self.failed:
            r = self.pinned.get(e.attempt)
            self._end_cell(e.t, e.attempt, _cell_words(r) if r else None)
        else:
            self._cell_decides(e)

    def _cell_event(self, e: CellEvent) -> None:
        if self.cell is not None and self.cell.id == e.cell:
            self._cell_decides(e)

    def _cell_decides(self, e: CellEvent) -> None:
        """The cell's rules on `e`; a kill of its ranks (stuck after an interrupt, or NCCL's
        watchdog ending them) ends its attempt as elastic_nb's doing: the ranks it ends are
        not blamed for their deaths."""
        assert self.cell is not None
        actions = self.cell.handle(e)
        self._out += actions
        done = self.cell.done
        if done is not None and any(isinstance(a, cell_rules.KillRanks) for a in actions):
            attempt = self.cell.attempt
            if attempt not in self.failed and not self.decided:
                self.failed.add(attempt)
                if self.restarts_left(attempt):
                    self._out.append(Restart(attempt, done.reason, None, CELL_ENDED))
                else:
                    self._decide(e.t, "failed", self._spent(done.reason))

    # ---- deciding --------------------------------------------------------------------------

    def _show(self, r: RankState) -> None:
        if r.attempt == self.attempt:
            self._out.append(Show(r))

    def _judge(self, t: float, r: RankState) -> None:
        if r.attempt in self.replaced:
            return  # a new round ended it: no failure of its own
        self._show(r)
        kind = r.kind(self.teardown_at)
        if kind in FAILED:
            if kind == "oom" and r.failure is not None:
                self._out.append(OomAlert(r))
            self._rank_failed(t, r, kind)
        elif kind == "done":
            ranks = self.of(r.attempt)
            if len(ranks) == self.world_size(r.attempt) and all(
                x.done and x.died_at for x in ranks
            ):
                self._decide(t, "succeeded", "every rank finished the cell")

    def _rank_failed(self, t: float, r: RankState, kind: str) -> None:
        attempt = r.attempt
        if attempt in self.failed:
            return
        if attempt in self.under_way:
            self._deferred.append((r, kind))  # decided once the diagnosis under way has ended
            return
        current = attempt == self.attempt
        if kind == "collective_timeout" and current:
            # Hold the attempt's decision until every live rank's stack is on disk (the
            # teardown would destroy the evidence of where the others were).
            self.under_way.add(attempt)
            self._out.append(Diagnose("timeout", r))
        elif kind == "peer" and kind in self.awaited and current:
            # Across machines a node whose ranks all finished the cell ends them (its agent's
            # exit barrier), and their peers see the connection close at once: before the
            # desync watch has looked. The ranks' records say whether the one that went had
            # left the cell early, once it is seen gone.
            self.under_way.add(attempt)
            if any(x.died_at is not None for x in self.of(attempt) if x is not r):
                self._out.append(Diagnose("peer", r))
            else:
                self._waits[(attempt, "peer")] = r
                self._out.append(Wait(attempt, "peer", PEER_GONE_WAIT_S))
        elif kind == "peer" and current:
            self._await_gone(t, r)
        elif kind == "signal" and r.exit_code == -signal.SIGTERM and current:
            # torch's agent ends its ranks with SIGTERM when it fails itself, and says so first:
            # its word may still be on its way through the launcher's pipe.
            if attempt not in self.agent_failed_in and not self.decided:
                self.under_way.add(attempt)
                self._waits[(attempt, "agent")] = r
                self._out.append(Wait(attempt, "agent", AGENT_WORD_S))
        else:
            self._fail_attempt(t, r, kind)

    def _fail_attempt(self, t: float, r: RankState, kind: str, reason: str | None = None) -> None:
        attempt = r.attempt
        if attempt in self.failed:
            return
        self.failed.add(attempt)
        if self.decided:
            return  # the group is ending: its teardown's consequences restart nothing
        self.pinned[attempt] = r
        self.last_failure = (r.failed_at or t, r.name, r.lost is not None)
        self._out.append(
            Record("attempt.failed", {"attempt": attempt, "rank": r.rank, "kind": kind})
        )
        why = reason or f"{r.name} {r.failure_summary()}"
        # An exit(0) without finishing leaves torchelastic waiting forever for a return value
        # (multiprocessing/api.py, _poll): where torch restarts, no restart would come (unless
        # another rank's failure made it restart already: the attempt is no longer current).
        if kind in self.final and attempt == self.current:
            self._decide(t, "failed", why)
        elif not self.restarts_left(attempt):
            self._decide(t, "failed", self._spent(why))
        else:
            self._out.append(Restart(attempt, why, r, kind))
            self._end_cell(t, attempt, _cell_words(r))

    def _await_gone(self, t: float, r: RankState) -> None:
        """A peer's error read before the death it reports was seen (the poll found its record
        first): the attempt fails as the rank that went, once it is seen gone."""
        if any(x.died_at is not None for x in self.of(r.attempt) if x is not r):
            self._peer_failed(t, r)
        else:
            self.under_way.add(r.attempt)
            self._waits[(r.attempt, "gone")] = r
            self._out.append(Wait(r.attempt, "gone", PEER_GONE_WAIT_S))

    def _peer_failed(self, t: float, r: RankState) -> None:
        """`r`'s peer error ends its attempt: as the first failure of its own the ranks show by
        now (the rank that went, once seen gone; a lost machine's ranks, told while the evidence
        was taken), not as the peer's error that was read first."""
        root = analyze(self.of(r.attempt), self.teardown_at).root
        kind = root.kind(self.teardown_at) if root is not None else None
        if root is not None and kind in FAILED and kind not in ("peer", "collective_timeout"):
            self._fail_attempt(t, root, kind)
        else:
            self._fail_attempt(t, r, "peer")

    def _of_now(self, attempt: int) -> bool:
        """News of `attempt` is of the attempt that runs now, not of a closed round."""
        return attempt == self.current and attempt not in self.replaced

    def _round_failed(self, t: float, kind: str, why: str) -> None:
        """The current attempt failed with no rank to blame: torch's agent, or the round."""
        attempt = self.current
        if kind in self.final:
            self._decide(t, "failed", why)
        elif attempt in self.failed:
            return  # its restart is under way: one restart an attempt
        elif not self.restarts_left(attempt):
            self._decide(t, "failed", self._spent(why))
        else:
            self.failed.add(attempt)
            self._out.append(Restart(attempt, why))
            self._end_cell(t, attempt, why)

    def _spent(self, why: str) -> str:
        """A failure's words when the budget is why it ends the group."""
        m = self.max_restarts
        return f"{why}; no restarts are left ({m}/{m})" if m else why

    def _diagnosis_ended(self, t: float, attempt: int) -> None:
        self.under_way.discard(attempt)
        self._after_diagnosis(t)

    def _after_diagnosis(self, t: float) -> None:
        deferred, self._deferred = self._deferred, []
        for r, kind in deferred:
            self._rank_failed(t, r, kind)
        if self._launcher is not None and not self.under_way:
            outcome, self._launcher = self._launcher, None
            self._decide(t, *outcome)

    def _decide(self, t: float, outcome: str, reason: str) -> None:
        if self.outcome is not None:
            return
        self.outcome = (outcome, reason)
        if outcome in self.stops_ranks and self.teardown_at is None:
            self.teardown_at = t
        self._out.append(Decide(outcome, reason))
        if self.cell is not None:
            self._out += self.cell.end(t, f"the session ended: {reason}", False)

    def _end_cell(self, t: float, attempt: int, why: str | None) -> None:
        """The attempt the running cell runs on failed: the cell with it (the session
        restarts)."""
        if self.cell is not None and self.cell.attempt == attempt:
            self._out += self.cell.end(t, why or "its attempt failed", True)


def _cell_words(r: RankState) -> str:
    """A cell's words for the rank its attempt's failure is pinned on."""
    return f"rank {r.rank} {r.failure_summary()}"


# Each event's handler, by name (a test may stand in for one: tests/test_simulation.py)
_HANDLERS: dict[type[AnyEvent], str] = {
    AttemptOpened: "_opened",
    RankStarted: "_started",
    RankFailed: "_failed",
    Watchdog: "_watchdog",
    RankExited: "_exited",
    AgentFailed: "_agent_failed",
    LauncherExited: "_launcher_exited",
    RoundFailed: "_round_failed_event",
    AttemptOver: "_attempt_over",
    RoundEnding: "_round_ending",
    RoundEnded: "_round_ended",
    LookBegan: "_look_began",
    Diagnosed: "_diagnosed",
    Waited: "_waited",
    Ended: "_ended",
    TeardownBegan: "_teardown_began",
    cell_rules.CellBegan: "_cell_began",
    cell_rules.Answered: "_cell_event",
    cell_rules.StopAsked: "_cell_event",
    cell_rules.Found: "_cell_event",
    cell_rules.Standing: "_cell_event",
    cell_rules.Tick: "_cell_event",
}
