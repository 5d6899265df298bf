"""What a rank group decides, as event sequences: the decision core (decider.Decider) fed typed
events, its actions read back. No process, no task, no clock but the events' times."""

from __future__ import annotations

import signal
from typing import Any

import pytest

from elastic_nb.common.rank_state import RankState
from elastic_nb.supervisor.runs import cell_rules as c
from elastic_nb.supervisor.runs import decider as d
from elastic_nb.supervisor.runs.placement import InRounds, OneMachine

pytestmark = pytest.mark.unit


def one_machine(max_restarts: int = 0, nproc: int = 2) -> d.Decider:
    core = d.Decider(max_restarts, OneMachine.final, OneMachine.awaited)
    core.handle(d.AttemptOpened(0.0, 0, nproc, counted=False))
    return core


def in_rounds(max_restarts: int = 0, nproc: int = 2) -> d.Decider:
    core = d.Decider(max_restarts, InRounds.final, InRounds.awaited)
    core.handle(d.AttemptOpened(0.0, 0, nproc, counted=False))
    return core


def start(core: d.Decider, attempt: int = 0, n: int = 2, t: float = 0.1) -> list[RankState]:
    ranks = [RankState(attempt, rank, pid=100 + rank, started_at=t) for rank in range(n)]
    for r in ranks:
        core.handle(d.RankStarted(t, r))
    return ranks


def raised(r: RankState, t: float, kind: str = "ValueError", message: str = "boom") -> RankState:
    r.failure = {"type": kind, "message": message, "time": t}
    return r


def died(r: RankState, t: float, code: int) -> RankState:
    r.died_at, r.exit_code = t, code
    return r


def kinds(actions: list[d.Action]) -> list[str]:
    return [type(a).__name__ for a in actions]


def of(actions: list[d.Action], kind: type[Any]) -> list[Any]:
    return [a for a in actions if isinstance(a, kind)]


def test_every_rank_finishing_the_cell_succeeds() -> None:
    core = one_machine()
    r0, r1 = start(core)
    r0.done = r1.done = {"time": 1.0}
    assert of(core.handle(d.RankExited(1.1, died(r0, 1.1, 0))), d.Decide) == []
    (decided,) = of(core.handle(d.RankExited(1.2, died(r1, 1.2, 0))), d.Decide)
    assert decided == d.Decide("succeeded", "every rank finished the cell")
    assert core.teardown_at is None  # a success ends no rank early


def test_a_rank_that_raises_in_the_last_attempt_fails_the_job_and_starts_the_teardown() -> None:
    core = one_machine()
    r0, _ = start(core)
    actions = core.handle(d.RankFailed(1.0, raised(r0, 0.9)))
    assert kinds(actions) == ["Show", "Record", "Decide"]
    assert of(actions, d.Decide)[0].reason == "rank 0 ValueError: boom"
    assert core.teardown_at == 1.0 and core.failed == {0}


def test_within_the_budget_a_failure_restarts_once_and_the_restart_is_counted_once() -> None:
    core = one_machine(max_restarts=1)
    r0, r1 = start(core)
    (restart,) = of(core.handle(d.RankFailed(1.0, raised(r0, 0.9))), d.Restart)
    assert (restart.attempt, restart.r, restart.kind) == (0, r0, "exception")
    assert of(core.handle(d.RankFailed(1.1, raised(r1, 1.0, message="peer"))), d.Restart) == []
    core.handle(d.AttemptOpened(2.0, 1, 2, counted=True))
    assert core.restarts == 1 and not core.restarts_left(1)
    (s0, _) = start(core, attempt=1, t=2.1)
    (decided,) = of(core.handle(d.RankFailed(3.0, raised(s0, 2.9))), d.Decide)
    assert decided.outcome == "failed"


def test_an_exit_0_before_the_cell_ends_is_final_where_torch_restarts() -> None:
    """torch waits forever for a rank that exited 0: on one machine no restart would come."""
    core = one_machine(max_restarts=3)
    r0, _ = start(core)
    (decided,) = of(core.handle(d.RankExited(1.0, died(r0, 1.0, 0))), d.Decide)
    assert "exited with code 0 before finishing the cell" in decided.reason
    rounds = in_rounds(max_restarts=3)
    s0, _ = start(rounds)
    assert kinds(rounds.handle(d.RankExited(1.0, died(s0, 1.0, 0))))[-1] == "Restart"


def test_a_collective_timeout_waits_for_the_evidence_and_so_does_what_comes_meanwhile() -> None:
    """The first timeout asks for every stack; a second rank's failure and the launcher's exit
    that come while it is taken are decided after it, in that order."""
    core = one_machine()
    r0, r1 = start(core)
    timed_out = raised(r0, 1.0, "RuntimeError", "Timed out waiting 3000ms for recv")
    assert of(core.handle(d.RankFailed(1.0, timed_out)), d.Diagnose) == [d.Diagnose("timeout", r0)]
    assert kinds(core.handle(d.RankFailed(1.1, raised(r1, 1.05)))) == ["Show"]
    assert core.handle(d.LauncherExited(1.2, ("failed", "torchelastic gave up"))) == []
    actions = core.handle(d.Diagnosed(1.5, 0, "timeout", r0))
    assert of(actions, d.Record)[0].fields == {
        "attempt": 0,
        "rank": 0,
        "kind": "collective_timeout",
    }
    assert of(actions, d.Decide) == [d.Decide("failed", f"rank 0 {timed_out.failure_summary()}")]


def test_a_sigterm_nobody_here_sent_waits_for_torchs_agent_to_say_it_failed() -> None:
    core = one_machine()
    r0, _ = start(core)
    (wait,) = of(core.handle(d.RankExited(1.0, died(r0, 1.0, -signal.SIGTERM))), d.Wait)
    assert (wait.what, wait.seconds) == ("agent", d.AGENT_WORD_S)
    actions = core.handle(d.AgentFailed(2.5, 0, "torchelastic's agent failed: boom", at=0.99))
    assert of(actions, d.Decide) == [d.Decide("failed", "torchelastic's agent failed: boom")]
    assert core.teardown_at == 0.99  # its SIGTERMs from then on: rank 0 was stopped
    assert r0.kind(core.teardown_at) == "terminated"
    assert core.handle(d.Waited(4.0, 0, "agent")) == []  # the word came first


def test_without_the_agents_word_the_sigterm_is_the_ranks_own_failure() -> None:
    core = one_machine()
    r0, _ = start(core)
    core.handle(d.RankExited(1.0, died(r0, 1.0, -signal.SIGTERM)))
    (decided,) = of(core.handle(d.Waited(4.0, 0, "agent")), d.Decide)
    assert decided.reason == "rank 0 killed by SIGTERM"


def test_across_machines_a_peer_error_waits_for_the_rank_that_went_then_for_the_evidence() -> None:
    core = in_rounds()
    r0, r1 = start(core)
    peer = raised(r0, 1.0, "RuntimeError", "Connection closed by peer")
    assert of(core.handle(d.RankFailed(1.0, peer)), d.Wait) == [
        d.Wait(0, "peer", d.PEER_GONE_WAIT_S)
    ]
    r1.done = {"time": 0.8}
    actions = core.handle(d.RankExited(1.1, died(r1, 1.1, 0)))
    assert of(actions, d.Diagnose) == [d.Diagnose("peer", r0)]
    assert core.handle(d.Waited(2.0, 0, "peer")) == []  # answered already
    found = core.handle(d.Diagnosed(1.3, 0, "peer", r0, r1, "rank 1 left the cell early"))
    assert of(found, d.Decide) == [d.Decide("failed", "rank 1 left the cell early")]


def test_a_closed_rounds_late_news_changes_nothing_of_the_next_round() -> None:
    core = in_rounds(max_restarts=2)
    r0, _ = start(core)
    assert of(core.handle(d.RankFailed(1.0, raised(r0, 0.9))), d.Restart)
    core.handle(d.RoundEnding(1.1, 0))
    core.handle(d.RoundEnded(1.1, 0))
    core.handle(d.AttemptOpened(1.3, 1, 2, counted=True))
    start(core, attempt=1, t=1.4)
    assert core.handle(d.RoundFailed(1.5, 0, "node 1: the launcher exited")) == []
    assert core.handle(d.AgentFailed(1.6, 0, "torchelastic's agent failed", at=1.0)) == []
    assert core.restarts == 1 and 1 not in core.failed and not core.decided


def test_a_round_that_fails_before_its_ranks_start_spends_its_own_attempts_budget() -> None:
    """Round 1 opened with the last restart; its node leaves before any rank of it starts: no
    restart is left (judged by round 0's budget, it spent one more than the job has)."""
    core = in_rounds(max_restarts=1)
    r0, _ = start(core)
    core.handle(d.RankFailed(1.0, raised(r0, 0.9)))
    core.handle(d.RoundEnding(1.1, 0))
    core.handle(d.AttemptOpened(1.3, 1, 2, counted=True))
    (decided,) = of(core.handle(d.RoundFailed(1.4, 1, "node 1 left: connection lost")), d.Decide)
    assert decided.reason == "node 1 left: connection lost; no restarts are left (1/1)"
    assert core.restarts == 1


def test_a_rounds_end_shows_its_ranks_stopped_though_a_status_is_untold() -> None:
    core = in_rounds(max_restarts=1)
    r0, r1 = start(core)
    core.handle(d.RoundEnding(1.0, 0))
    died(r0, 1.05, -signal.SIGTERM)  # r1's exit status is still on its way: alive in the book
    shown = of(core.handle(d.RoundEnded(1.0, 0)), d.Show)
    assert [(s.r.rank, s.ended) for s in shown] == [
        (0, d.STOPPED_FOR_ROUND),
        (1, d.STOPPED_FOR_ROUND),
    ]
    assert core.handle(d.RankExited(1.5, died(r1, 1.5, -signal.SIGTERM))) == []


def test_a_stop_from_outside_is_first_come_first_served() -> None:
    core = one_machine()
    start(core)
    assert core.handle(d.Ended(1.0, "interrupted", "interrupted from the kernel")) == [
        d.Decide("interrupted", "interrupted from the kernel")
    ]
    assert core.handle(d.Ended(1.1, "timeout", "the --timeout of 1 s passed")) == []
    assert (
        core.outcome == ("interrupted", "interrupted from the kernel") and core.teardown_at == 1.0
    )


def test_a_session_starts_no_teardown_clock_at_its_decision() -> None:
    core = d.Decider(0, OneMachine.final, OneMachine.awaited, stops_ranks=frozenset())
    core.handle(d.Ended(1.0, "failed", "no restarts left"))
    assert core.teardown_at is None
    core.handle(d.TeardownBegan(1.4))
    core.handle(d.TeardownBegan(1.6))
    assert core.teardown_at == 1.4


def test_a_peers_error_read_before_its_machines_loss_pins_the_failure_on_the_lost_rank() -> None:
    """Across machines a survivor's gloo error can be read before the lost machine's loss is
    told: once the evidence is in, the attempt fails as the lost rank's, not the survivor's."""
    core = in_rounds(max_restarts=1)
    r0, r1 = start(core)
    core.handle(d.RankFailed(1.0, raised(r0, 1.0, "RuntimeError", "Connection closed by peer")))
    r1.lost = "node 1 (b) left: connection lost"
    assert of(core.handle(d.RankExited(1.1, died(r1, 0.99, -signal.SIGKILL))), d.Diagnose)
    actions = core.handle(d.Diagnosed(1.3, 0, "peer", r0))
    assert of(actions, d.Record)[0].fields == {"attempt": 0, "rank": 1, "kind": "lost"}
    (restart,) = of(actions, d.Restart)
    assert restart.r is r1 and "left: connection lost" in restart.why


# ---- a session's cell (cell_rules) --------------------------------------------------------


def session(max_restarts: int = 1, nproc: int = 2) -> d.Decider:
    core = d.Decider(max_restarts, OneMachine.final - {"exit0"})
    core.handle(d.AttemptOpened(0.0, 0, nproc, counted=False))
    return core


def cell_began(core: d.Decider, t: float = 0.2, **options: Any) -> list[Any]:
    return core.handle(c.CellBegan(t, "ce11", 0, (0, 1), **options))


def test_a_cells_raise_settles_then_its_first_raise_is_named_though_its_answer_came_second() -> (
    None
):
    """Rank 1 raised at 1.00 and rank 0 at 1.02; rank 0's answer comes first. The others get
    SETTLE_S to answer with their own errors before anyone is interrupted, and the words name
    the rank that raised first, whatever order the answers came in."""
    core = session(nproc=3)
    start(core, n=3)
    core.handle(c.CellBegan(0.2, "ce11", 0, (0, 1, 2)))
    first = core.handle(c.Answered(1.03, "ce11", 0, False, 1.02, "rank 0: ValueError: late"))
    assert of(first, c.Interrupt) == []
    assert [w.t for w in of(first, c.WakeAt)] == [pytest.approx(1.03 + c.SETTLE_S)]
    assert of(first, c.TellOom) == [c.TellOom("ce11", (0,))]
    second = core.handle(c.Answered(1.05, "ce11", 1, False, 1.00, "rank 1: ValueError: first"))
    assert of(second, c.Interrupt) == []
    settled = core.handle(c.Tick(1.03 + c.SETTLE_S, "ce11"))
    assert of(settled, c.Interrupt) == [c.Interrupt("ce11", (2,))]
    (done,) = of(core.handle(c.Answered(1.2, "ce11", 2, False, 1.19, "rank 2: Keyb")), c.CellDone)
    assert done == c.CellDone(
        "ce11",
        "failed",
        "rank 1: ValueError: first; the session keeps its ranks and state",
        1.03 + c.SETTLE_S,
        False,
    )


def test_a_rank_stuck_after_its_interrupt_is_killed_and_the_attempt_fails_as_the_cells_doing() -> (
    None
):
    """A stop interrupts both ranks; rank 1 sits inside a collective and does not answer within
    the grace: it is killed, the cell ends with the stop's outcome, and the attempt restarts as
    the cell's doing (no rank blamed: its death, seen later, changes nothing)."""
    core = session()
    _, r1 = start(core)
    cell_began(core, grace=2.0)
    stop = core.handle(c.StopAsked(1.0, "ce11", "interrupt"))
    assert of(stop, c.Interrupt) == [c.Interrupt("ce11", (0, 1))]
    core.handle(c.Answered(1.01, "ce11", 0, False, 1.01, "rank 0: KeyboardInterrupt"))
    assert of(core.handle(c.Tick(2.9, "ce11")), c.KillRanks) == []  # within the grace
    ended = core.handle(c.Tick(3.0, "ce11"))
    (kill,) = of(ended, c.KillRanks)
    assert kill.ranks == (1,) and "rank 1 could not be interrupted within 2 s" in (kill.note or "")
    (done,) = of(ended, c.CellDone)
    assert done.outcome == "interrupted" and done.restarts
    assert done.reason.startswith("interrupted from the kernel; rank 1 could not be interrupted")
    (restart,) = of(ended, d.Restart)
    assert restart.r is None and restart.kind == d.CELL_ENDED
    seen = core.handle(d.RankExited(3.1, died(r1, 3.1, -signal.SIGKILL)))
    assert of(seen, d.Restart) == [] and of(seen, d.Record) == [] and 0 not in core.pinned


def test_a_death_the_group_judges_ends_the_cell_and_a_stop_before_it_keeps_its_outcome() -> None:
    """The cell ends as the core judges rank 1's death (a restart, its words). Where a stop
    had come first, the stop's outcome stands and the death is said after it; where the budget
    is spent, the session ends and so does the cell."""
    core = session()
    _, r1 = start(core)
    cell_began(core)
    ended = core.handle(d.RankExited(1.0, died(r1, 1.0, -signal.SIGKILL)))
    (done,) = of(ended, c.CellDone)
    assert (done.outcome, done.reason, done.restarts) == (
        "failed",
        "rank 1 killed by SIGKILL",
        True,
    )

    core = session(max_restarts=0)
    _, r1 = start(core)
    cell_began(core, deadline=0.5, timeout=0.3)
    assert of(core.handle(c.Tick(0.5, "ce11")), c.StopCell) == [c.StopCell("ce11", "timeout")]
    (done,) = of(core.handle(d.RankExited(0.6, died(r1, 0.6, -signal.SIGKILL))), c.CellDone)
    assert done.outcome == "timeout" and not done.restarts
    assert done.reason == (
        "the --timeout of 0.3 s passed; then the session ended: rank 1 killed by SIGKILL"
    )


def test_a_cell_begun_on_an_attempt_already_failed_ends_at_once() -> None:
    """A rank died between the cell's sending and its rules' start: the cell does not wait
    for answers that will not come."""
    core = session()
    _, r1 = start(core)
    core.handle(d.RankExited(0.15, died(r1, 0.15, -signal.SIGKILL)))
    (done,) = of(cell_began(core), c.CellDone)
    assert done.reason == "rank 1 killed by SIGKILL" and done.restarts
