"""A deterministic simulation of a rank group around its decision core (`decider.Decider`).

A seeded world plays what real ranks, torch's agent, the launchers and the sites do, on a
virtual clock: each attempt has a story (every rank finishes; a rank raises, runs out of CUDA
memory, exits 0 early, SIGKILLs itself, hangs while the others time out in a collective; torch's
agent fails; a machine is lost; the user stops the job), and the world's reactions to it come at
the delays the real world allows (a death seen late on a loaded machine, a peer's error before the
death it reports, torch's agent's word a second or two after its SIGTERMs, a closed round's news
arriving after the next round opened, an exit status told after its round's stop). The core
gets the events in the order they fall; what it decides is carried out as the group's shell
would (a teardown, a restart in place or a new round, evidence taken, waits run out), and the
invariants are checked after every step and at the end. `Sim(seed).run()` returns the story, a
line per event, and the first broken invariant; the same seed replays it exactly.
"""

from __future__ import annotations

import heapq
import itertools
import random
import signal
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_nb.common.rank_state import RankState
from elastic_nb.common.rundir import RunDir
from elastic_nb.supervisor.forensics.verdict import analyze
from elastic_nb.supervisor.ranks.rank_book import RankBook
from elastic_nb.supervisor.runs import decider as d
from elastic_nb.supervisor.runs.placement import InRounds, OneMachine

KILL_WINDOW_S = 0.5  # RankBook's kill_window for the default --stop-grace (2 s): min(2, 1) / 2
SEEN_LATE_S = 0.4  # a loaded machine's site sees a death up to this late (within the kill window)
AGENT_WORD_LATE_S = 2.5  # torch's agent's word comes up to this late (within AGENT_WORD_S)
STORIES = (
    "succeeds", "raises", "oom", "exit0", "own_kill", "hang", "agent", "lost", "stop", "outside",
)  # fmt: skip


class Broken(AssertionError):
    """An invariant the group's decisions broke."""


@dataclass
class Truth:
    """What happened in one attempt, as the world knows it."""

    story: str
    culprits: set[int] = field(default_factory=set)  # who failed on its own (any of them)


class World:
    """A seeded world on a virtual clock: what happens is queued at its time, run in order
    until nothing is left (`run`); `begin` starts it, `check_end` judges it once it is quiet."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.rng = random.Random(seed)
        self.now = 0.0
        self._queue: list[tuple[float, int, str, Callable[[], None]]] = []
        self._seq = itertools.count()
        self.story: list[str] = []

    def begin(self) -> None:
        raise NotImplementedError

    def check_end(self) -> None:
        raise NotImplementedError

    def at(self, delay: float, what: str, do: Callable[[], None]) -> None:
        heapq.heappush(self._queue, (self.now + delay, next(self._seq), what, do))

    def run(self, limit: int = 2000) -> tuple[list[str], str | None]:
        """Until the world is quiet; returns the story and the first broken invariant."""
        try:
            self.begin()
            for _ in range(limit):
                if not self._queue:
                    break
                self.now, _, what, do = heapq.heappop(self._queue)
                if what:
                    self.say(what)
                do()
            else:
                raise Broken("the world never went quiet")
            self.check_end()
        except Broken as e:
            return self.story, str(e)
        return self.story, None

    def t(self) -> float:
        """When the shell hears what happens now: a moment later (a decision made on a
        rank's death is never at the very instant its site saw it)."""
        return self.now + 1e-6

    def say(self, line: str) -> None:
        self.story.append(f"{self.now:7.3f}  {line}")


class Sim(World):
    def __init__(self, seed: int, core: Callable[..., d.Decider] = d.Decider) -> None:
        super().__init__(seed)
        rng = self.rng
        self.rounds = rng.random() < 0.4
        self.n = rng.randint(2, 4)
        self.max_restarts = rng.randint(0, 2)
        where = InRounds if self.rounds else OneMachine
        self.core = core(self.max_restarts, where.final, where.awaited)
        self.book = RankBook(RunDir(Path("/nonexistent")), kill_window=KILL_WINDOW_S)
        self.truths: dict[int, Truth] = {}
        self.behind: dict[int, list[int]] = {}  # attempt -> ranks a desync finding blamed
        self.chips: dict[tuple[int, int], str] = {}  # the last chip state shown, per rank
        self.restarted: list[int] = []  # attempts a Restart was asked for
        self.torch_restarts = 0  # torch's own count, on one machine
        self.attempt = -1  # the world's newest attempt
        self.gone: set[tuple[int, int]] = set()  # ranks whose process has ended
        self.hung: dict[int, int] = {}  # attempt -> the rank that sleeps while others time out
        self.outside: dict[int, int] = {}  # attempt -> the rank a peer outside the job died under
        self.torch_ended: set[int] = set()  # attempts torch's agent has ended
        self.ended_rounds: set[int] = set()  # attempts a new round replaces
        self.closed: set[int] = set()  # attempts whose RoundEnded the core has heard
        self.last_seen = 0.0  # when the site saw its latest death
        self.pinned: dict[int, tuple[int, str]] = {}  # attempt -> the rank its failure names

    def begin(self) -> None:
        self.say(
            f"{'rounds' if self.rounds else 'one machine'}, {self.n} ranks, "
            f"--max-restarts {self.max_restarts}"
        )
        self.open_attempt(counted=False)

    # ---- the core --------------------------------------------------------------------------

    def hear(self, event: d.Event) -> None:
        self.say(f"-> {_words(event)}")
        if isinstance(event, d.RoundEnded):
            self.closed.add(event.attempt)
        for action in self.core.handle(event):
            self.say(f"   <- {_words(action)}")
            _CARRY[type(action)](self, action)
        self.check_step()

    def deliver(self, delay: float, make: Callable[[], d.Event], what: str = "") -> None:
        """An event the shell will hear after `delay` (made when it is heard)."""
        self.at(delay, what, lambda: self.hear(make()))

    # ---- the world ---------------------------------------------------------------------------

    def open_attempt(self, counted: bool) -> None:
        self.attempt += 1
        a = self.attempt
        story = self.rng.choice([s for s in STORIES if self.rounds or s != "lost"])
        truth = self.truths[a] = Truth(story)
        self.say(f"attempt {a} opens: story '{story}'")
        self.hear(d.AttemptOpened(self.t(), a, self.n, counted))
        ranks = [
            RankState(a, rank, pid=1000 * (a + 1) + rank, started_at=self.now)
            for rank in range(self.n)
        ]
        for r in ranks:
            self.book.ranks[(a, r.rank)] = r
            r.kill_window = KILL_WINDOW_S
            self.deliver(self.rng.uniform(0, 0.05), lambda r=r: d.RankStarted(self.t(), r))
        self.play(a, truth, ranks)

    def play(self, a: int, truth: Truth, ranks: list[RankState]) -> None:
        rng, T = self.rng, self.rng.uniform(0.2, 1.0)
        k = rng.randrange(self.n)
        others = [r for r in ranks if r.rank != k]
        if truth.story == "succeeds":
            for r in ranks:
                self.at(
                    T + rng.uniform(0, 0.3), f"rank {r.rank} finishes", lambda r=r: self.finish(r)
                )
            return
        if truth.story == "stop":
            self.at(
                T, "the user stops", lambda: self.hear(d.Ended(self.t(), "interrupted", "stop"))
            )
            return
        if truth.story == "agent":
            self.at(T, "torch's agent fails", lambda: self.agent_fails(a, ranks))
            return
        if truth.story == "outside":
            # A process outside the job (a helper the cell started) dies under rank k: its peer
            # error, its exit; torch's agent then stops the others (SIGTERM).
            self.outside[a] = k
            self.at(
                T, f"a peer outside the job dies under rank {k}", lambda: self.peer_error(ranks[k])
            )
            return
        truth.culprits = {k}
        if truth.story in ("raises", "oom"):
            kind = "torch.OutOfMemoryError" if truth.story == "oom" else "ValueError"
            self.at(T, f"rank {k} raises {kind}", lambda: self.raises(ranks[k], kind, "boom"))
            self.at(T + rng.uniform(0.01, 0.3), f"rank {k} exits 1", lambda: self.dies(ranks[k], 1))
            self.peers_see(others, T + rng.uniform(0.0, 0.05))
        elif truth.story == "exit0":
            self.at(T, f"rank {k} exits 0 early", lambda: self.dies(ranks[k], 0))
            self.peers_see(others, T + 0.005)
        elif truth.story == "own_kill":
            self.at(T, f"rank {k} SIGKILLs itself", lambda: self.dies(ranks[k], -signal.SIGKILL))
            self.peers_see(others, T + rng.uniform(0.005, 0.1))
        elif truth.story == "hang":
            # Rank k sleeps; the others time out in their collective and hold their exit for
            # the evidence (released once it is taken).
            for r in others:
                self.at(
                    T + rng.uniform(0, 0.2),
                    f"rank {r.rank} times out",
                    lambda r=r: self.times_out(r, k),
                )
        elif truth.story == "lost":
            lost = {k} | {r.rank for r in others if rng.random() < 0.3}
            truth.culprits = lost
            self.at(
                T,
                f"the machine of ranks {sorted(lost)} is lost",
                lambda: self.lose(a, [ranks[x] for x in sorted(lost)]),
            )
            # Its peers' errors may be read before the loss is known (the agent's channel
            # closes at once, or a heartbeat later).
            self.peers_see([r for r in ranks if r.rank not in lost], T + rng.uniform(0.0, 0.1))

    def alive(self, r: RankState) -> bool:
        return (r.attempt, r.rank) not in self.gone

    def finish(self, r: RankState) -> None:
        if not self.alive(r):
            return
        r.done = {"time": self.now}
        self.dies(r, 0)

    def raises(self, r: RankState, kind: str, message: str) -> None:
        if not self.alive(r) or r.failure is not None:
            return
        r.failure = {"type": kind, "message": message, "time": self.now}
        self.deliver(self.rng.uniform(0, 0.05), lambda: d.RankFailed(self.t(), r))  # the poll

    def dies(self, r: RankState, code: int, told: bool = True) -> None:
        """The rank's process ends now; its site sees it go a little later (a loaded one up to
        SEEN_LATE_S), with its status (`told`) or before it."""
        if not self.alive(r):
            return
        self.gone.add((r.attempt, r.rank))
        self.say(f"rank {r.rank} (attempt {r.attempt}) ends: {code}")
        self.torch_sees(r, code)

        def seen() -> d.Event:
            r.died_at, r.exit_code = self.now, (code if told else None)
            return d.RankExited(self.t(), r)

        # One site sees its ranks go in the order they went (its pidfds' readiness comes in
        # one loop turn, in order), each up to SEEN_LATE_S late.
        self.last_seen = max(self.now + self.rng.uniform(0, SEEN_LATE_S), self.last_seen + 1e-4)
        self.deliver(self.last_seen - self.now, seen)

    def peers_see(self, peers: list[RankState], t: float) -> None:
        """Ranks waiting in a collective with the one that went: a peer's error for some, the
        others go on waiting (until someone ends them)."""
        for r in peers:
            if self.rng.random() < 0.6:
                at = t + self.rng.uniform(0, 0.1)
                self.at(at, f"rank {r.rank} sees its peer go", lambda r=r: self.peer_error(r))

    def peer_error(self, r: RankState) -> None:
        if self.alive(r) and r.failure is None:
            self.raises(r, "RuntimeError", "Connection closed by peer [127.0.0.1]:4000")
            self.at(self.rng.uniform(0.01, 0.2), "", lambda: self.dies(r, 1))

    def times_out(self, r: RankState, hung: int) -> None:
        if self.alive(r) and r.failure is None:
            self.hung[r.attempt] = hung
            self.raises(
                r, "RuntimeError", "Timed out waiting 3000ms for recv operation to complete"
            )

    def agent_fails(self, a: int, ranks: list[RankState]) -> None:
        """torch's agent raises: it SIGTERMs its ranks at once, its word comes up to
        AGENT_WORD_LATE_S later (read late under load), its launcher exits after it."""
        at = self.now
        self.torch_ended.add(a)
        for r in ranks:
            self.at(0.001, "", lambda r=r: self.dies(r, -signal.SIGTERM))
        late = self.rng.uniform(0, AGENT_WORD_LATE_S)
        self.deliver(
            late, lambda: d.AgentFailed(self.t(), a, "torchelastic's agent failed: boom", at)
        )
        if self.rounds:
            self.at(late + 0.01, "its launcher exits", lambda: self.launcher_gone(a))
        else:
            self.deliver(
                late + 0.01, lambda: d.LauncherExited(self.t(), ("failed", "the agent failed"))
            )

    def lose(self, a: int, ranks: list[RankState]) -> None:
        for r in ranks:
            if self.alive(r):
                r.lost, r.died_at = "node 1 left: connection lost", self.now
                self.gone.add((r.attempt, r.rank))
                self.deliver(self.rng.uniform(0, 0.3), lambda r=r: d.RankExited(self.t(), r))

    # ---- torch's agent, where it restarts in place (one machine) or ends its round ----------

    def torch_sees(self, r: RankState, code: int) -> None:
        """torch's agent sees a rank go at its next monitor tick: a failure ends the attempt
        (its other ranks SIGTERMed); on one machine it restarts within the budget or gives up,
        in a round its launcher exits (the round's end is the supervisor's)."""
        a = r.attempt
        if code == 0 or a in self.torch_ended or a != self.attempt:
            return  # torch waits forever on an exit(0): the supervisor must end it
        self.torch_ended.add(a)

        def tick() -> None:
            if self.core.decided or a in self.ended_rounds:
                return
            for x in self.book.of(a):
                if self.alive(x):
                    self.dies(x, -signal.SIGTERM)
            if self.rounds:
                self.at(0.01, f"round {a}'s launcher exits", lambda: self.launcher_gone(a))
            elif self.torch_restarts < self.max_restarts:
                self.torch_restarts += 1

                def restart() -> None:
                    if not self.core.decided:  # else the teardown has ended torch's agent
                        self.open_attempt(counted=True)

                self.at(self.rng.uniform(0.05, 0.3), "torch restarts", restart)
            else:
                self.deliver(
                    0.01, lambda: d.LauncherExited(self.t(), ("failed", "torchelastic gave up"))
                )

        self.at(self.rng.uniform(0.05, 0.3), "torch's monitor ticks", tick)

    def launcher_gone(self, a: int) -> None:
        """InRounds.launcher_ended: its round failed, unless its ranks' ends explain it (2 s)."""

        def judged() -> None:
            if not self.core.decided and a not in self.core.failed:
                self.hear(d.RoundFailed(self.t(), a, f"round {a}'s launcher exited"))

        self.at(2.0, "", judged)

    # ---- carrying the core's actions out ------------------------------------------------------

    def decide(self, action: d.Decide) -> None:
        """The teardown: every live rank SIGTERMed now, gone within moments; across machines
        a machine may be lost meanwhile (a node lost mid-stop)."""
        self.lost_mid_stop(self.core.attempt)
        for r in list(self.book.ranks.values()):
            if self.alive(r):
                self.at(
                    self.rng.uniform(0.001, 0.05), "", lambda r=r: self.dies(r, -signal.SIGTERM)
                )

    def lost_mid_stop(self, a: int) -> None:
        """Across machines, sometimes: one of `a`'s live ranks is on a machine lost while its
        round stops (its loss told at once, before the stop's SIGTERM reaches it)."""
        live = [r for r in self.book.of(a) if self.alive(r)]
        if self.rounds and live and self.rng.random() < 0.3:
            r = self.rng.choice(live)
            self.at(0.0005, f"rank {r.rank}'s machine is lost mid-stop", lambda: self.lose(a, [r]))

    def show(self, action: d.Show) -> None:
        chip = self.book.chip(action.r, self.core.teardown_at)
        state = "stopped" if action.ended is not None else chip["state"]
        self.chips[(action.r.attempt, action.r.rank)] = state

    def diagnose(self, action: d.Diagnose) -> None:
        r, a = action.r, action.r.attempt

        def found() -> d.Event:
            culprit = None
            if action.what == "timeout":
                if a in self.hung:
                    self.behind[a] = [self.hung[a]]
                # The evidence is taken: the held ranks go.
                for x in self.book.ranks.values():
                    if x.attempt == a and x.failure is not None and self.alive(x):
                        self.at(self.rng.uniform(0.001, 0.1), "", lambda x=x: self.dies(x, 1))
            return d.Diagnosed(self.t(), a, action.what, r, culprit, None)

        self.deliver(self.rng.uniform(0.01, 0.5), found, "evidence taken")

    def record(self, action: d.Record) -> None:
        if action.name == "attempt.failed":
            self.pinned[action.fields["attempt"]] = (action.fields["rank"], action.fields["kind"])

    def wait(self, action: d.Wait) -> None:
        self.deliver(action.seconds, lambda: d.Waited(self.t(), action.attempt, action.what))

    def restart(self, action: d.Restart) -> None:
        if action.attempt in self.restarted:
            raise Broken(f"attempt {action.attempt} was restarted twice")
        self.restarted.append(action.attempt)
        if not self.rounds:
            return  # torch restarts in place, on its own clock
        # The next round: the ending one's ranks stopped (a status may come late, or never),
        # then its chips, then the next round's ranks.
        a, started = action.attempt, self.now
        self.ended_rounds.add(a)
        self.hear(d.RoundEnding(self.t(), a))
        self.lost_mid_stop(a)
        for r in list(self.book.ranks.values()):
            if r.attempt == a and self.alive(r):
                self.dies(r, -signal.SIGTERM, told=self.rng.random() < 0.7)
        if self.rng.random() < 0.3:  # the closed round's launcher says so after the next opened
            self.at(
                0.3,
                "a closed round's late news",
                lambda: self.hear(d.RoundFailed(self.t(), a, "late")),
            )

        def next_round() -> None:
            self.hear(d.RoundEnded(started, a))
            if not self.core.decided:
                self.open_attempt(counted=True)

        self.at(self.rng.uniform(0.05, 0.2), "the stop returns", next_round)

    # ---- invariants ------------------------------------------------------------------------

    def check_step(self) -> None:
        core = self.core
        for a, (rank, kind) in self.pinned.items():
            # A peer's error waits for the rank that went (across machines, for the evidence):
            # the attempt's failure (the restart's words, the round's "why", the job's reason)
            # names who failed on its own once it is known.
            culprits = self.truths[a].culprits
            if culprits and kind == "peer" and rank not in culprits:
                raise Broken(
                    f"attempt {a} failed as rank {rank}'s peer error; rank(s) {sorted(culprits)}"
                    " failed on their own"
                )
        if core.restarts > self.max_restarts:
            raise Broken(f"{core.restarts} restarts spent, the budget is {self.max_restarts}")
        for a in self.restarted:
            if not self.truths[a].culprits and self.truths[a].story not in ("agent", "outside"):
                raise Broken(
                    f"attempt {a} ('{self.truths[a].story}') was restarted: no rank of it failed"
                )
        for a in self.closed:
            running = [k for (x, k), s in self.chips.items() if x == a and s == "running"]
            if running:
                raise Broken(f"attempt {a} ended, its rank(s) {running} still shown running")

    def check_end(self) -> None:
        core = self.core
        if not core.decided:
            raise Broken("the world is quiet and the job never ended")
        assert core.outcome is not None
        final = core.attempt
        truth = self.truths[final]
        ranks = core.of(final)
        verdict = analyze(ranks, core.teardown_at, self.behind.get(final), self.n)
        outcome = core.outcome[0]
        root = verdict.root.rank if verdict.root is not None else None
        self.say(
            f"end: {outcome} ({core.outcome[1]}); attempt {final}'s verdict: rank {root}, {verdict.cause}"
        )
        if truth.story == "succeeds" and outcome != "succeeded":
            raise Broken(f"every rank of attempt {final} finished, the job {outcome}")
        if truth.story == "stop" and outcome != "interrupted":
            raise Broken(f"the user stopped attempt {final}, the job {outcome}")
        if truth.culprits:
            if outcome != "failed":
                raise Broken(
                    f"rank(s) {sorted(truth.culprits)} failed in attempt {final}, the job {outcome}"
                )
            if root not in truth.culprits:
                raise Broken(
                    f"the verdict names rank {root} ({verdict.cause}); rank(s) {sorted(truth.culprits)} failed on their own"
                )
        elif truth.story == "agent" and "agent" not in core.outcome[1] and outcome == "failed":
            raise Broken(
                f"torch's agent failed in attempt {final}; the job says: {core.outcome[1]}"
            )
        elif truth.story == "outside" and root is not None and root != self.outside[final]:
            raise Broken(
                f"a peer outside the job died under rank {self.outside[final]} in attempt {final};"
                f" the verdict names rank {root} ({verdict.cause})"
            )
        elif truth.story in ("agent", "stop") and root is not None:
            raise Broken(
                f"no rank failed on its own in attempt {final}; the verdict names rank {root} ({verdict.cause})"
            )


_CARRY: dict[type[d.Action], Callable[[Sim, Any], None]] = {
    d.Decide: Sim.decide,
    d.Show: Sim.show,
    d.OomAlert: lambda sim, action: None,
    d.Diagnose: Sim.diagnose,
    d.Wait: Sim.wait,
    d.Restart: Sim.restart,
    d.Record: Sim.record,
}


def _words(x: Any) -> str:
    """An event or action in a line: its kind and fields, a rank by attempt and number."""
    fields = []
    for name, value in vars(x).items():
        if name == "t":
            continue
        if isinstance(value, RankState):
            value = f"rank {value.rank}@{value.attempt}"
        fields.append(f"{name}={value}")
    return f"{type(x).__name__}({', '.join(fields)})"
