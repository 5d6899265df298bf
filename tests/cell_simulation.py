"""A deterministic simulation of a session's cell around the decision core (`decider.Decider`
with its `cell_rules.CellRules`), as tests/simulation.py is of a rank group.

A seeded world runs one cell on a session's ranks, on a virtual clock. Each rank has a fate in
it: it finishes; it raises (its answer a moment after its record); it waits in a collective
(only an interrupt gets it out, and maybe not within the grace); it sits at an input() prompt
(an interrupt ends it at once); it dies of its own SIGKILL. Around them: a stop asked, the
--timeout passing (a prompt open meanwhile), a hang alert standing, a desync found, NCCL's
watchdog ending the ranks. Events reach the core in the order they fall; what it decides is
carried out as the session would (interrupts answered as each rank can, kills, ticks at the
times asked for, a death's restart), and the invariants are checked after every step and once
the world is quiet. `CellSim(seed).run()` returns the story and the first broken invariant.
"""

from __future__ import annotations

import re
import signal
from collections.abc import Callable
from typing import Any

from elastic_nb.common.rank_state import RankState
from elastic_nb.supervisor.runs import cell_rules as c
from elastic_nb.supervisor.runs import decider as d
from elastic_nb.supervisor.runs.placement import OneMachine
from tests.simulation import Broken, World, _words

FATES = ("finishes", "raises", "waits", "prompt", "dies")
CELL = "ce11"
ANSWER_LATE_S = 0.05  # a rank's answer follows its record by up to this
SEEN_LATE_S = 0.4  # a death is seen up to this late
COLLECTIVE_TIMEOUT_S = 4.0  # when a rank that waits in a collective raises, if nothing came first


class CellSim(World):
    def __init__(self, seed: int, core: Callable[..., d.Decider] = d.Decider) -> None:
        super().__init__(seed)
        rng = self.rng
        self.n = rng.randint(2, 4)
        self.max_restarts = rng.randint(0, 2)
        # A session on one machine: an exit(0) restarts it (Session.restarts_from).
        self.core = core(self.max_restarts, OneMachine.final - {"exit0"})
        self.grace = rng.choice([0.3, 1.0, 2.0])
        self.timeout = rng.choice([None, None, rng.uniform(0.2, 2.5)])
        self.fates = {rank: rng.choice(FATES) for rank in range(self.n)}
        if rng.random() < 0.3:  # a cell every rank finishes
            self.fates = dict.fromkeys(range(self.n), "finishes")
        self.ranks = {
            rank: RankState(0, rank, pid=1000 + rank, started_at=0.0) for rank in range(self.n)
        }
        self.answered: dict[int, tuple[bool, str]] = {}  # rank -> (ok, own or interrupted)
        self.finished_at: dict[int, float] = {}
        self.heard: set[int] = set()  # ranks whose answer the core has heard
        self.raised_at: dict[int, float] = {}  # own raises, by record time
        self.died: set[int] = set()  # ranks dead by their own hand
        self.killed: set[int] = set()  # ranks the cell killed
        self.interrupted: dict[int, float] = {}  # rank -> when its interrupt was sent
        self.first_failure_heard: float | None = None
        self.stop_heard: float | None = None
        self.found_heard: float | None = None
        self.wake: float | None = None
        self.done: list[c.CellDone] = []
        self.done_at = 0.0
        self.first_death: float | None = None
        self.restarts: list[d.Restart] = []
        self.decided: d.Decide | None = None
        self.blamed: list[int] = []  # ranks an attempt's failure was pinned on

    # ---- the core --------------------------------------------------------------------------

    def hear(self, event: d.AnyEvent) -> None:
        self.say(f"-> {_words(event)}")
        if isinstance(event, c.Answered):
            self.heard.add(event.rank)
            if not event.ok and self.first_failure_heard is None:
                self.first_failure_heard = event.t
        elif isinstance(event, c.StopAsked) and self.stop_heard is None:
            self.stop_heard = event.t
        elif isinstance(event, c.Found) and self.found_heard is None:
            self.found_heard = event.t
        for action in self.core.handle(event):
            self.say(f"   <- {_words(action)}")
            self.check_action(action)
            _CARRY[type(action)](self, action)

    # ---- the world ---------------------------------------------------------------------------

    def begin(self) -> None:
        self.say(
            f"{self.n} ranks {self.fates}, --max-restarts {self.max_restarts}, "
            f"grace {self.grace:g} s, --timeout {self.timeout and round(self.timeout, 3)}"
        )
        rng = self.rng
        self.hear(d.AttemptOpened(self.t(), 0, self.n, counted=False))
        for r in self.ranks.values():
            self.hear(d.RankStarted(self.t(), r))
        deadline = self.timeout  # the cell was created at 0
        ranks = tuple(range(self.n))
        self.hear(c.CellBegan(self.t(), CELL, 0, ranks, deadline, self.timeout, self.grace))
        for rank, fate in self.fates.items():
            u = rng.uniform(0.01, 1.5)
            if fate == "finishes":
                self.at(u, f"rank {rank} finishes", lambda rank=rank: self.answer(rank, True))
            elif fate == "raises":
                self.at(u, f"rank {rank} raises", lambda rank=rank: self.raises(rank))
            elif fate == "dies":
                self.at(u, f"rank {rank} SIGKILLs itself", lambda rank=rank: self.dies(rank))
            elif fate == "prompt":  # the user answers it, unless an interrupt comes first
                self.at(
                    u + rng.uniform(0.5, 3),
                    f"the user answers rank {rank}'s prompt; it finishes",
                    lambda rank=rank: self.finishes_unless_interrupted(rank),
                )
            elif fate == "waits":  # its collective times out, unless an interrupt comes first
                self.at(
                    COLLECTIVE_TIMEOUT_S,
                    f"rank {rank}'s collective times out",
                    lambda rank=rank: self.raises(rank),
                )
        if rng.random() < 0.2:
            reason = rng.choice(["interrupt", "user", "panel"])
            self.at(
                rng.uniform(0, 2),
                f"the user stops the cell ({reason})",
                lambda: self.hear(c.StopAsked(self.t(), CELL, reason)),
            )
        if rng.random() < 0.2:
            self.at(
                rng.uniform(0, 2),
                "a hang alert stands",
                lambda: self.hear(c.Standing(self.t(), CELL, "no output for 1 s")),
            )
        waiting = [r for r, f in self.fates.items() if f == "waits"]
        if waiting and "finishes" in self.fates.values() and rng.random() < 0.5:
            self.at(rng.uniform(0.5, 2), "the desync watch confirms a desync", self.desync)
        if waiting and rng.random() < 0.1:
            self.at(rng.uniform(0.5, 2), "NCCL's watchdog ends the ranks", self.watchdog)

    def answer(self, rank: int, ok: bool, own: bool = True) -> None:
        """The rank answers `ran` (once: the first of its own answer and an interrupt's)."""
        if rank in self.answered or rank in self.died or rank in self.killed:
            return
        if ok:
            self.finished_at[rank] = self.now
        self.answered[rank] = (ok, "own" if own else "interrupted")
        at = self.raised_at.get(rank, self.now) if own else self.now
        words = None if ok else f"rank {rank}: {'ValueError' if own else 'KeyboardInterrupt'}"
        self.hear(c.Answered(self.t(), CELL, rank, ok, None if ok else at, words))

    def finishes_unless_interrupted(self, rank: int) -> None:
        if rank not in self.interrupted:
            self.answer(rank, True)

    def raises(self, rank: int) -> None:
        if rank in self.answered or rank in self.interrupted:
            return  # an interrupt reached it first
        self.raised_at[rank] = self.now
        late = self.rng.uniform(0, ANSWER_LATE_S)
        self.at(late, "", lambda: self.answer(rank, False))

    def dies(self, rank: int, by_cell: bool = False) -> None:
        """The rank's process ends by SIGKILL, its own or the cell's; it is seen gone a little
        later."""
        r = self.ranks[rank]
        if rank in self.died or rank in self.killed:
            return
        (self.killed if by_cell else self.died).add(rank)
        if self.first_death is None:
            self.first_death = self.now

        def seen() -> None:
            r.died_at, r.exit_code = self.now, -signal.SIGKILL
            # The session tells the core of a death of the current attempt unless that attempt
            # has already failed (Session._rank_ended).
            if 0 not in self.core.failed:
                self.hear(d.RankExited(self.t(), r))

        self.at(self.rng.uniform(0, SEEN_LATE_S), f"rank {rank} is seen gone", seen)

    def desync(self) -> None:
        self.hear(c.Found(self.t(), CELL, "a desync: a rank left the cell, another waits"))

    def watchdog(self) -> None:
        self.hear(c.Found(self.t(), CELL, "a collective timed out (NCCL's watchdog)", ends=True))

    # ---- carrying actions out ------------------------------------------------------------------

    def interrupt(self, action: c.Interrupt) -> None:
        for rank in action.ranks:
            self.interrupted[rank] = self.now
            fate = self.fates[rank]
            if fate == "waits":  # inside a collective: maybe not within the grace
                late = self.rng.uniform(0.01, 1.5 * self.grace)
            else:
                late = self.rng.uniform(0.001, 0.05)
            self.at(
                late,
                f"rank {rank} takes its interrupt",
                lambda r=rank: self.answer(r, False, own=False),
            )

    def kill(self, action: c.KillRanks) -> None:
        for rank in action.ranks:
            self.dies(rank, by_cell=True)

    def wake_at(self, action: c.WakeAt) -> None:
        self.wake = action.t

        def tick() -> None:
            if self.wake == action.t and not self.done:
                self.wake = None
                self.hear(c.Tick(self.t(), CELL))

        self.at(max(0.0, action.t - self.now), "", tick)

    def stopped(self, action: c.StopCell) -> None:
        """The deadline passed: the shell records the stop (SessionCell.request_stop)."""
        if self.stop_heard is None:
            self.stop_heard = self.t()

    def cell_done(self, action: c.CellDone) -> None:
        self.done.append(action)
        self.done_at = self.now

    def restart(self, action: d.Restart) -> None:
        self.restarts.append(action)
        if action.r is not None:
            self.blamed.append(action.r.rank)

    def decide(self, action: d.Decide) -> None:
        self.decided = action

    def record(self, action: d.Record) -> None:
        if action.name == "attempt.failed":
            self.blamed.append(action.fields["rank"])

    # ---- invariants ------------------------------------------------------------------------

    def check_action(self, action: d.AnyAction) -> None:
        if isinstance(action, c.CellAction) and self.done:
            raise Broken(f"the cell ended ({self.done[0].outcome}), then {_words(action)}")
        if isinstance(action, c.Interrupt):
            again = [r for r in action.ranks if r in self.interrupted or r in self.heard]
            if again:
                raise Broken(f"rank(s) {again} interrupted though answered or interrupted before")
            cause = self.stop_heard is not None or self.found_heard is not None
            settled = (
                self.first_failure_heard is not None
                and self.t() >= self.first_failure_heard + c.SETTLE_S
            )
            if not cause and not settled:
                raise Broken("the ranks were interrupted before the first failure settled")
        if isinstance(action, c.KillRanks) and action.note is not None:
            early = [
                r
                for r in action.ranks
                if r not in self.interrupted or self.now + 1e-6 < self.interrupted[r] + self.grace
            ]
            if early:
                raise Broken(f"rank(s) {early} killed as stuck before the grace after an interrupt")
        if isinstance(action, d.Restart) and self.restarts:
            raise Broken("attempt 0 was restarted twice")
        blamed = self.blamed + (
            [action.r.rank] if isinstance(action, d.Restart) and action.r else []
        )
        wrongly = [r for r in blamed if r in self.killed]
        if wrongly:
            raise Broken(f"rank(s) {wrongly} the cell killed were blamed for their deaths")

    def check_end(self) -> None:
        if len(self.done) != 1:
            raise Broken(f"the world is quiet and the cell ended {len(self.done)} times")
        done = self.done[0]
        self.say(f"end: {done.outcome} ({done.reason}); restarts: {done.restarts}")
        if (
            set(self.fates.values()) == {"finishes"}
            and self.found_heard is None
            and len(self.finished_at) == self.n
            and (self.stop_heard is None or self.stop_heard > max(self.finished_at.values()))
            and done.outcome != "succeeded"
        ):
            raise Broken(f"every rank finished the cell before anything else; it {done.outcome}")
        if done.outcome == "succeeded" and len(self.finished_at) < self.n:
            raise Broken("the cell succeeded though a rank did not finish it")
        if done.outcome in ("interrupted", "stopped") and self.stop_heard is None:
            raise Broken(f"the cell was {done.outcome} though nobody stopped it")
        if done.outcome == "timeout" and self.timeout is None:
            raise Broken("the cell timed out without a --timeout")
        quiet = [self.stop_heard, self.found_heard, self.first_failure_heard, self.first_death]
        if (
            self.timeout is not None
            and self.done_at > self.timeout
            and all(x is None or x > self.timeout for x in quiet)
            and done.outcome not in ("timeout", "succeeded")  # finished before its interrupt
        ):
            raise Broken(f"the --timeout passed while the cell ran, and it {done.outcome}")
        named = [int(x) for x in re.findall(r"^rank (\d+)[: ]", done.reason)]
        if named and named[0] in self.killed | (
            set(self.interrupted) - set(self.raised_at) - self.died
        ):
            raise Broken(f"the cell's words name rank {named[0]}, which elastic_nb ended")
        own = sorted(self.raised_at, key=lambda r: (self.raised_at[r], r))
        if named and own and named[0] in self.raised_at and named[0] != own[0]:
            raise Broken(f"the cell names rank {named[0]}; rank {own[0]} raised first")
        if done.restarts and not (self.died or self.killed):
            raise Broken("the cell says the session restarts, though no rank of it went")
        if self.killed and not done.restarts and self.decided is None:
            raise Broken(f"the cell killed rank(s) {sorted(self.killed)}, and says no restart")


_CARRY: dict[type[Any], Callable[[CellSim, Any], None]] = {
    c.Interrupt: CellSim.interrupt,
    c.KillRanks: CellSim.kill,
    c.TellOom: lambda sim, action: None,
    c.StopCell: CellSim.stopped,
    c.WakeAt: CellSim.wake_at,
    c.CellDone: CellSim.cell_done,
    d.Decide: CellSim.decide,
    d.Show: lambda sim, action: None,
    d.OomAlert: lambda sim, action: None,
    d.Wait: lambda sim, action: sim.at(
        action.seconds, "", lambda: sim.hear(d.Waited(sim.t(), action.attempt, action.what))
    ),
    d.Restart: CellSim.restart,
    d.Record: CellSim.record,
}
