"""A session's state machine and its replay, without a process: the moves the table allows (and the
one place that makes them refusing the others), and how a replay of the journal goes, cell by cell,
fed a fake run of each cell."""

from __future__ import annotations

import dataclasses
import itertools
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from elastic_nb.common.rundir import RunDir, write_json
from elastic_nb.kernel.flags import job_spec
from elastic_nb.supervisor.sessions.journal import Journal
from elastic_nb.supervisor.sessions.replay import RunCell, replay
from elastic_nb.supervisor.sessions.session import Session
from elastic_nb.supervisor.sessions.session_cell import SessionCell
from elastic_nb.supervisor.sessions.session_state import LIVE, MOVES, REPLAYED, State, move
from tests.fake_site import FakeSite

pytestmark = pytest.mark.unit

SESSION = "5e551011"


async def _nothing(msg: Any) -> None:
    return None


# ---- the table ------------------------------------------------------------------------------


def _into(state: State) -> set[State]:
    return {s for s, moves in MOVES.items() if state in moves}


def test_every_state_has_its_moves_and_the_end_is_the_only_way_out() -> None:
    assert set(MOVES) == set(State)
    assert {State.STARTING, State.REPLAYING, State.READY, State.RUNNING, State.RESTARTING} == LIVE
    for s in LIVE:  # a live session can always be ended, and never goes back to starting
        assert State.ENDING in MOVES[s] and State.STARTING not in MOVES[s]
    assert MOVES[State.ENDING] == {State.ENDED}
    assert MOVES[State.ENDED] == frozenset()


def test_cells_run_only_on_ranks_that_have_the_journal() -> None:
    """A cell only after the replay (READY comes from REPLAYING or a cell's end), and the replay
    only once every rank of an attempt is up (from STARTING or RESTARTING)."""
    assert _into(State.RUNNING) == {State.READY}
    assert _into(State.READY) == {State.REPLAYING, State.RUNNING}
    assert _into(State.REPLAYING) == {State.STARTING, State.RESTARTING}
    assert _into(State.RESTARTING) == LIVE  # a rank may die whatever the session does
    assert {State.READY, State.RUNNING} == REPLAYED


def test_the_words_are_the_ones_the_kernel_waits_for() -> None:
    # kernel/session_handle.py: %elastic up returns once the session says "ready"
    assert State.READY.value == "ready"
    assert [s.value for s in State] == [
        "starting", "replaying", "ready", "running", "restarting", "ending", "ended",
    ]  # fmt: skip


# ---- the one place that moves ----------------------------------------------------------------


def _session(tmp_path: Path) -> Session:
    spec = job_spec({"nproc": "2", "log_dir": str(tmp_path)}, cwd=str(tmp_path))
    site = FakeSite(RunDir.of(spec.log_dir, SESSION))
    return Session(SESSION, spec, {}, site, _nothing, tmp_path)


def test_a_move_the_table_does_not_allow_is_refused_naming_both_states() -> None:
    path = [State.STARTING, State.REPLAYING, State.READY, State.RUNNING, State.READY]
    path += [State.RESTARTING, State.RESTARTING, State.REPLAYING, State.ENDING, State.ENDED]
    for now, to in itertools.pairwise(path):
        assert move(now, to, "session x") is to
    for now, to in [(State.STARTING, State.RUNNING), (State.ENDING, State.READY)]:
        with pytest.raises(AssertionError, match=f"session x: {now.name} -> {to.name}"):
            move(now, to, "session x")


def test_a_session_moves_as_its_life_goes_and_the_kernel_hears_each_move(tmp_path: Path) -> None:
    """A new session starts; a stop decides its outcome (ending), whatever comes after; its
    state, once ended, is the outcome, which says more than "ended"."""

    async def main() -> None:
        s = _session(tmp_path)
        s.prepare()
        assert s.state == s.report.state == "starting" and not s.ready()
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(s.run)
                await anyio.lowlevel.checkpoint()  # its run has begun
                assert s.state == "starting"
                s.request_stop("interrupt")  # its outcome decided
                assert s.state == s.report.state == "ending"
                s.down()  # a second decision changes nothing
                assert s.state == "ending"
        assert s.state == s.report.state == "interrupted"  # ended: the outcome says more

    anyio.run(main)


# ---- the replay -------------------------------------------------------------------------------


@dataclasses.dataclass
class _Cell:
    """What a replay reads of a journal's cell (a `SessionCell`'s)."""

    no: int
    first_line: str
    rd: RunDir
    spec: SimpleNamespace  # its replay: False for a --no-replay cell
    answers: dict[int, bool] = dataclasses.field(default_factory=dict)


def _journal(tmp_path: Path, *lines: str, no_replay: tuple[int, ...] = ()) -> Journal:
    journal = Journal()
    for no, line in enumerate(lines, 1):
        rd = RunDir.of(str(tmp_path), f"ce11{no:04d}")
        journal.add(_Cell(no, line, rd, SimpleNamespace(replay=no not in no_replay)))
    return journal


class _Alerts:
    def __init__(self) -> None:
        self.said: list[tuple[str, str, str, dict[str, Any]]] = []

    def __call__(self, kind: str, severity: str, title: str, **about: Any) -> None:
        self.said.append((kind, severity, title, about))

    def titles(self) -> list[str]:
        return [title for _, _, title, _ in self.said]


def _runs(answers: dict[int, dict[int, bool]], ran: list[int]) -> RunCell:
    """Each cell's ranks' answers by its number; a cell with none: its attempt ended first."""

    async def run(cell: SessionCell) -> bool:
        assert cell.no is not None
        ran.append(cell.no)
        if cell.no not in answers:
            return False
        cell.answers = dict(answers[cell.no])
        return True

    return run


def test_a_replay_runs_the_journal_in_order_in_one_alert_that_grows(tmp_path: Path) -> None:
    journal = _journal(tmp_path, "import torch", "x = 1", "y = x + 1", no_replay=(2,))
    alerts, ran = _Alerts(), []
    ok = {0: True, 1: True}
    anyio.run(replay, journal, 1, _runs({1: ok, 3: ok}, ran), alerts)
    assert ran == [1, 3]  # --no-replay's cell 2 left out
    titles = alerts.titles()
    assert titles[0] == "attempt 1: replaying 2 cells (1 left out: --no-replay)"
    assert titles[1].startswith(
        f"{titles[0]}: 1 done, the last: replayed cell 1 (import torch) in "
    )
    assert titles[2].startswith(f"{titles[0]}: 2 done, the last: replayed cell 3 (y = x + 1) in ")
    assert titles[3].startswith("the session's state is back: 2 cells replayed in ")
    assert len(titles) == 4
    assert {(k, sev, str(about)) for k, sev, _, about in alerts.said} == {
        ("replay", "info", "{'key': 'replay-1'}")
    }
    [record] = journal.replays
    assert record["attempt"] == 1 and record["cells"] == 2 and not record["failed"]
    assert journal.words(1) == f"replayed 2 cells in {record['seconds']:.2f} s"


def test_a_cell_that_fails_stops_the_replay(tmp_path: Path) -> None:
    journal = _journal(tmp_path, "a = 1", "b = a / 0", "c = b")
    cell = journal.cells[1]
    cell.rd.failure(2, 1).parent.mkdir(parents=True)
    write_json(
        cell.rd.failure(2, 1),
        {"time": 1.0, "type": "ZeroDivisionError", "message": "division by zero", "cell_line": 1},
    )
    alerts, ran = _Alerts(), []
    answers = {1: {0: True, 1: True}, 2: {0: True, 1: False}, 3: {0: True, 1: True}}
    anyio.run(replay, journal, 2, _runs(answers, ran), alerts)
    assert ran == [1, 2]  # the cells after it would run on a state it did not build
    kind, severity, title, about = alerts.said[-1]
    assert (kind, severity, about) == ("replay", "error", {"rank": 1, "key": "replay-2"})
    assert title == (
        "attempt 2: replaying 3 cells: the replay stopped: cell 2 (b = a / 0) failed on rank 1: "
        "ZeroDivisionError: division by zero (cell line 1); the cells after it did not run"
    )
    [record] = journal.replays
    assert record["failed"] and record["cells"] == 1
    assert journal.words(2) == "its replay failed"


def test_a_replay_cut_by_the_attempts_end_says_nothing_more(tmp_path: Path) -> None:
    journal = _journal(tmp_path, "a = 1", "b = 2")
    alerts, ran = _Alerts(), []
    anyio.run(replay, journal, 1, _runs({1: {0: True, 1: True}}, ran), alerts)
    assert ran == [1, 2]
    assert len(alerts.said) == 2  # the head and cell 1: the next attempt replays again
    [record] = journal.replays
    assert record["cells"] == 1 and not record["failed"] and record["seconds"] == 0.0


def test_attempt_0_has_nothing_to_replay(tmp_path: Path) -> None:
    journal, alerts, ran = Journal(), _Alerts(), []
    anyio.run(replay, journal, 0, _runs({}, ran), alerts)
    assert ran == [] and alerts.said == [] and journal.replays == []
    assert journal.words(0) is None
