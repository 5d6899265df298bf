"""When a session's cell is done, and what that takes: the decision core's rules for one cell
(`decider.Decider` holds the running cell's and feeds it what the group decides).

Sans-I/O, as the core: each event returns actions, and the only clock is the events' times.
The shell (`sessions.session_cell.SessionCell.decide`) turns what it hears into events once (a
rank's answer, with its failure record's time and words; a stop asked; a finding; a hang alert
standing; a deadline passed: `Tick` at the `WakeAt` asked for) and carries the actions out.

First come first served:

* every rank finished the cell                                  -> succeeded
* every rank answered and one raised                            -> failed, the session stays
* a rank raised while others still run it                       -> after SETTLE_S the others are
                                                                   interrupted; failed
* a desync found (a rank finished, another waits in a collective) -> the waiting ones are
                                                                   interrupted; failed
* NCCL's watchdog ends the ranks (--async-error-handling 1, 3)  -> failed; the session restarts
* the cell's attempt failed (the core's judgment of a death)    -> failed; the session restarts
* the session ended                                             -> failed; it does not restart
* a stop (interrupt, %elastic stop), the --timeout passed       -> the ranks are interrupted;
                                                                   interrupted / stopped / timeout

A rank that does not answer within the grace after its interrupt (stuck inside a collective,
where no Python runs) is killed: torch then restarts the group and the session replays.
"""

from __future__ import annotations

from dataclasses import dataclass

from elastic_nb.supervisor.runs.summary import STOPS

__all__ = [
    "ACTIONS",
    "SETTLE_S",
    "Answered",
    "CellAction",
    "CellBegan",
    "CellDone",
    "CellEvent",
    "CellRules",
    "Found",
    "Interrupt",
    "KillRanks",
    "Standing",
    "StopAsked",
    "StopCell",
    "TellOom",
    "Tick",
    "WakeAt",
    "stop_words",
]

# After the first failure, how long the other ranks' own answers may take before they are
# interrupted: a cell that raises on every rank (a typo) fails on each of them within
# milliseconds, and each should be reported with its own error, not as interrupted.
SETTLE_S = 0.1


def stop_words(reason: str, timeout: float | None) -> tuple[str, str]:
    """The outcome and the words a stop request gives: interrupted, stopped or timeout."""
    if reason == "timeout":
        return "timeout", f"the --timeout of {timeout or 0:g} s passed"
    return STOPS.get(reason, ("stopped", reason))


# ---- events ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class CellEvent:
    t: float
    cell: str


@dataclass(frozen=True)
class CellBegan(CellEvent):
    """The cell was sent to `ranks` of `attempt`; `deadline` (our clock) is its --timeout's."""

    attempt: int
    ranks: tuple[int, ...]
    deadline: float | None = None
    timeout: float | None = None
    grace: float = 3.0  # for an interrupted rank to answer (--stop-grace)


@dataclass(frozen=True)
class Answered(CellEvent):
    """A rank ran the cell: finished it (`ok`) or raised, with its failure record's time and
    words (None: no record)."""

    rank: int
    ok: bool
    raised_at: float | None = None
    words: str | None = None


@dataclass(frozen=True)
class StopAsked(CellEvent):
    reason: str  # a key of STOPS, or "timeout"


@dataclass(frozen=True)
class Found(CellEvent):
    """A finding about the cell's ranks: a desync (the ranks that wait are interrupted), or a
    collective timeout whose NCCL ends the ranks (`ends`: they are killed, the session
    restarts)."""

    title: str
    ends: bool = False


@dataclass(frozen=True)
class Standing(CellEvent):
    """A hang alert stands: a stop from now on says where the ranks stood."""

    title: str


@dataclass(frozen=True)
class Tick(CellEvent):
    """Time passed: a `WakeAt` came due."""


# ---- actions -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class CellAction:
    cell: str


@dataclass(frozen=True)
class Interrupt(CellAction):
    """KeyboardInterrupt in these ranks' cell."""

    ranks: tuple[int, ...]


@dataclass(frozen=True)
class KillRanks(CellAction):
    """SIGKILL these ranks (those still alive); `note`: the alert that says why, if any."""

    ranks: tuple[int, ...]
    note: str | None = None


@dataclass(frozen=True)
class TellOom(CellAction):
    """These ranks raised: each one that ran out of CUDA memory gets its alert now, not after
    the restart and replay it brings."""

    ranks: tuple[int, ...]


@dataclass(frozen=True)
class StopCell(CellAction):
    """The cell is stopped for `reason` (the --timeout passed)."""

    reason: str


@dataclass(frozen=True)
class WakeAt(CellAction):
    """Send a Tick at `t` unless something comes first."""

    t: float


@dataclass(frozen=True)
class CellDone(CellAction):
    outcome: str
    reason: str
    interrupted_at: float | None  # when interrupting its ranks began
    restarts: bool  # the session restarts its ranks


ACTIONS = (Interrupt, KillRanks, TellOom, StopCell, WakeAt, CellDone)

# ---- the rules ---------------------------------------------------------------------------------


class CellRules:
    """One cell's state, from CellBegan to CellDone."""

    def __init__(self, began: CellBegan) -> None:
        self.id, self.attempt, self.ranks = began.cell, began.attempt, began.ranks
        self.deadline, self.timeout, self.grace = began.deadline, began.timeout, began.grace
        self.answers: dict[int, Answered] = {}
        self.stop: str | None = None
        self.standing: str | None = None
        self.finding: str | None = None
        self.first_failure: float | None = None
        self.interrupted: float | None = None
        self.told: set[int] = set()  # failed ranks told to the OOM alert
        self.done: CellDone | None = None
        self._out: list[CellAction] = []

    @property
    def watching(self) -> bool:
        """The desync watch has something to look for: the cell runs, nothing failed or
        stopped, nothing is interrupted."""
        return (
            self.done is None
            and self.interrupted is None
            and self.stop is None
            and self.finding is None
            and not self.failed
            and len(self.answers) < len(self.ranks)
        )

    @property
    def failed(self) -> list[int]:
        return sorted(rank for rank, a in self.answers.items() if not a.ok)

    def handle(self, e: CellEvent) -> list[CellAction]:
        self._out = []
        if self.done is None:
            if isinstance(e, Answered) and e.rank in self.ranks:
                self.answers.setdefault(e.rank, e)
            elif isinstance(e, StopAsked):
                self.stop = self.stop or e.reason
            elif isinstance(e, Standing):
                self.standing = e.title
            elif isinstance(e, Found):
                if e.ends:  # NCCL ends them anyway: now, while the session can restart
                    self.finding = e.title
                    self._kill(e.t, self.ranks, None)
                else:
                    self.finding = self.finding or e.title
            self._step(e.t)
        return self._out

    def end(self, t: float, reason: str, restarts: bool) -> list[CellAction]:
        """The group decided for it: its attempt failed (`restarts`), or the session ended."""
        self._out = []
        if self.done is None:
            interrupted = self.interrupted or (t if restarts else None)
            if self.stop is not None:  # the stop came first: its outcome
                outcome, said = self._stopped()
                self._end(outcome, f"{said}; then {reason}", interrupted, restarts)
            else:
                self._end("failed", reason, interrupted, restarts)
        return self._out

    def _step(self, t: float) -> None:
        if self.done is not None:
            return
        failed = self.failed
        missing = tuple(rank for rank in self.ranks if rank not in self.answers)
        if not missing:
            if not failed:
                self._end("succeeded", "every rank finished the cell", None, False)
            elif self.stop is not None:
                self._end(*self._stopped(), self.interrupted, False)
            else:
                self._end(
                    "failed",
                    f"{self._failure()}; the session keeps its ranks and state",
                    self.interrupted,
                    False,
                )
            return
        if self.deadline is not None and t >= self.deadline and self.stop is None:
            self.stop = "timeout"
            self._out.append(StopCell(self.id, "timeout"))
        if failed and self.first_failure is None:
            self.first_failure = t
        new = tuple(rank for rank in failed if rank not in self.told)
        if new:
            self.told.update(new)
            self._out.append(TellOom(self.id, new))
        wakes = [self.deadline] if self.deadline is not None and self.stop is None else []
        if self.interrupted is None and (self.stop or failed or self.finding):
            assert self.first_failure is not None or self.stop or self.finding
            settles = self.first_failure + SETTLE_S if self.first_failure is not None else t
            if self.stop or self.finding or t >= settles:
                self.interrupted = t
                self._out.append(Interrupt(self.id, missing))
                wakes.append(t + self.grace)
            else:
                wakes.append(settles)
        elif self.interrupted is not None:
            if t >= self.interrupted + self.grace:
                self._stuck(t, missing)
                return
            wakes.append(self.interrupted + self.grace)
        if wakes:
            self._out.append(WakeAt(self.id, min(wakes)))

    def _stuck(self, t: float, missing: tuple[int, ...]) -> None:
        """Ranks that did not come back from an interrupt: end them; torch restarts."""
        many = len(missing) > 1
        note = (
            f"rank{'s' if many else ''} {', '.join(map(str, missing))} could not be interrupted "
            f"within {self.grace:g} s (inside a collective?) and {'were' if many else 'was'} "
            "ended"
        )
        self._kill(t, missing, note)

    def _kill(self, t: float, ranks: tuple[int, ...], note: str | None) -> None:
        """End `ranks` (`note`: the alert that says why): the cell ends as its first cause
        says (a stop, a finding, a rank's error), and the session restarts."""
        self._out.append(KillRanks(self.id, ranks, note))
        if self.stop:
            outcome, reason = self._stopped()
            words = [reason, self.finding]
        else:
            outcome, words = "failed", [self._failure()]
        words.append(note)
        self._end(outcome, "; ".join(x for x in words if x), self.interrupted or t, True)

    def _stopped(self) -> tuple[str, str]:
        assert self.stop is not None
        outcome, said = stop_words(self.stop, self.timeout)
        if self.standing is not None:
            said += f"; before that: {self.standing}"
        return outcome, said

    def _failure(self) -> str:
        """A desync's words, else the first of the ranks that raised in the cell: its error
        and its line."""
        if self.finding:
            return self.finding
        raised = [a for a in self.answers.values() if not a.ok and a.raised_at is not None]
        if not raised:
            return f"rank {self.failed[0]}"
        first = min(raised, key=lambda a: (a.raised_at, a.rank))
        return first.words or f"rank {first.rank}"

    def _end(self, outcome: str, reason: str, interrupted: float | None, restarts: bool) -> None:
        self.done = CellDone(self.id, outcome, reason, interrupted, restarts)
        self._out.append(self.done)
