"""What decides a session's cell, without a process: the ranks' answers, fed to
`SessionCell.decide` on a fake site (tests/fake_site.py) while the desync watch looks."""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from elastic_nb.common.rundir import RunDir
from elastic_nb.common.submission import Submission
from elastic_nb.kernel.flags import job_spec
from elastic_nb.supervisor.ranks.rank_links import Link
from elastic_nb.supervisor.runs import cell_rules, decider
from elastic_nb.supervisor.runs.rank_group import RankGroup
from elastic_nb.supervisor.sessions.session_cell import SessionCell
from tests.fake_site import FakeSite

pytestmark = pytest.mark.unit


class _Stream:
    """A rank's connection that takes whatever it is sent."""

    def __init__(self) -> None:
        self.sent: list[bytes] = []

    async def send(self, data: bytes) -> None:
        self.sent.append(data)


async def _nothing(msg: Any) -> None:
    return None


class _Group(RankGroup):
    """The session's part the cell needs: what the decision core decides for the cell reaches
    it (Session._cell_act)."""

    cell: SessionCell

    def _cell_act(self, action: cell_rules.CellAction) -> None:
        self.cell.act(action)


@pytest.mark.alone
def test_an_answer_that_lands_while_the_watch_looks_ends_the_cell_at_once(tmp_path: Path) -> None:
    """The last rank answers while the desync watch's look waits for a slow probe (the test
    answers once a probe waits at the gate): the cell is decided as soon as the look returns,
    not at the next look (a lost wake-up held about one trivial cell in six for 0.25-1 s)."""
    spec = job_spec({"nproc": "2", "log_dir": str(tmp_path)}, cwd=str(tmp_path))
    site = FakeSite(RunDir.of(spec.log_dir, "5e5510a1"))
    group = _Group("5e5510a1", spec, site, _nothing)
    ranks = [
        group.book.add(0, rank, pid=100 + rank, started_at=time.time(), site=site)
        for rank in (0, 1)
    ]
    links = [Link(r, _Stream()) for r in ranks]  # type: ignore[arg-type]
    cell = SessionCell(Submission("ce11ce11", spec, "a = a + 1\n", {}, None, "5e5510a1"), _nothing)
    group.cell = cell
    cell.rd.attempt(0).mkdir(parents=True)
    site.probe_gate = anyio.Event()

    async def main() -> tuple[Any, float]:
        decided: list[Any] = []

        async def decide() -> None:
            decided.append(await cell.decide(links, group))
            decided.append(time.monotonic())

        with anyio.fail_after(15):
            async with anyio.create_task_group() as tg:
                tg.start_soon(decide)
                # Inside the watch's look: its first is due a second after the watch starts
                # (diagnosis.DesyncWatch), and decide waits on its event until then.
                await site.probing.wait()
                cell.answer(0, True)
                cell.answer(1, True)
                opened = time.monotonic()
                site.probe_gate.set()
            # the task group waits for decide's end
        return decided[0], decided[1] - opened

    decision, took = anyio.run(main)
    assert decision[0] == "succeeded"
    assert took < 0.2, f"decided {took:.2f} s after the look ended"


def test_a_rank_death_ends_the_cell_as_the_groups_decision_core_judges_it(tmp_path: Path) -> None:
    """Rank 1 dies of a SIGTERM nobody here sent, mid-cell: the core waits for torch's agent to
    say it failed (decider.AGENT_WORD_S) before it pins the attempt's failure, and the cell waits
    with it (it failed at the first death, where a job waits for the evidence). The agent says
    nothing: the cell fails as rank 1's once the wait is over, and its restart follows."""
    spec = job_spec(
        {"nproc": "2", "max_restarts": "1", "log_dir": str(tmp_path)}, cwd=str(tmp_path)
    )
    site = FakeSite(RunDir.of(spec.log_dir, "5e5510a2"))
    group = RankGroup("5e5510a2", spec, site, _nothing)
    group.core.handle(decider.AttemptOpened(time.time(), 0, 2, counted=False))
    ranks = [
        group.book.add(0, rank, pid=100 + rank, started_at=time.time(), site=site)
        for rank in (0, 1)
    ]
    for r in ranks:
        group.core.handle(decider.RankStarted(time.time(), r))
    links = [Link(r, _Stream()) for r in ranks]  # type: ignore[arg-type]
    cell = SessionCell(Submission("ce11ce12", spec, "a = a + 1\n", {}, None, "5e5510a2"), _nothing)
    cell.rd.attempt(0).mkdir(parents=True)

    async def main() -> Any:
        decided: list[Any] = []

        async def decide() -> None:
            decided.append(await cell.decide(links, group))

        async with anyio.create_task_group() as tg:
            tg.start_soon(decide)
            await anyio.wait_all_tasks_blocked()
            ranks[1].died_at, ranks[1].exit_code = time.time(), -signal.SIGTERM
            waits = group.core.handle(decider.RankExited(time.time(), ranks[1]))
            assert [type(a).__name__ for a in waits] == ["Show", "Wait"]
            cell.poke()
            await anyio.wait_all_tasks_blocked()
            assert decided == []  # a death alone does not end the cell
            for action in group.core.handle(decider.Waited(time.time(), 0, "agent")):
                if isinstance(action, cell_rules.CellAction):
                    cell.act(action)  # the session's part (Session._cell_act)
            tg.cancel_scope.deadline = anyio.current_time() + 5  # decide ends within
        assert decided, "the cell was not decided within 5 s"
        return decided[0]

    outcome, why, _, restarts = anyio.run(main)
    assert (outcome, why, restarts) == ("failed", "rank 1 killed by SIGTERM", True)
