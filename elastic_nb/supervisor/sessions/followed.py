"""The cells of a session that the kernel follows: the one the ranks run, those waiting their
turn, and a failed one still showing the restart and the replay it brought. The session's alerts
reach all of them; the ranks' new lines reach one (the cell that runs, else the oldest open one);
each ends with its last lines, its closing alerts and its summary.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import anyio

from elastic_nb.common.rank_state import RankState
from elastic_nb.supervisor.ranks.log_tailer import LogTailer
from elastic_nb.supervisor.ranks.memory_watch import MemoryWatch
from elastic_nb.supervisor.ranks.rank_book import RankBook
from elastic_nb.supervisor.sessions.session_cell import SessionCell

__all__ = ["Followed"]

LOGS_WAIT_S = 2.0  # for a rank's output to reach the notebook after its answer did
LOGS_POLL_S = 0.02


class Followed:
    def __init__(self, tailer: LogTailer, memory: MemoryWatch) -> None:
        self.cells: list[SessionCell] = []  # oldest first
        self.ending: list[SessionCell] = []  # concluded, their last lines and END on their way
        self._tailer = tailer
        self._memory = memory

    def add(self, cell: SessionCell, attempt: int) -> None:
        """Its ranks' memory peaks from now on, and its dashboard's memory from the attempt's
        start."""
        self.cells.append(cell)
        cell.peaks = self._memory.follow()
        for sample in self._memory.recent(attempt):
            cell.report.memory(sample)

    def alert(self, kind: str, severity: str, title: str, **about: Any) -> None:
        """`about`: Reporter.alert's rank, key or ends."""
        for cell in self.cells:
            cell.report.alert(kind, severity, title, **about)

    def logs_target(self, current: SessionCell | None) -> SessionCell | None:
        """Whose the ranks' new lines are: the cell they run; else, unless a cell that ended
        waits for its last lines (its END takes them), the oldest one open."""
        if current in self.cells:
            return current
        return None if self.ending else next(iter(self.cells), None)

    async def flush(self, attempt: int, current: SessionCell | None) -> None:
        target = self.logs_target(current)
        for c in self.cells:
            await c.report.flush(attempt, self._tailer if c is target else None)
        if target is None and not self.ending:
            self._tailer.take()  # nobody follows: the files keep them

    def conclude(
        self,
        cell: SessionCell,
        outcome: str,
        reason: str,
        ranks: list[RankState],
        teardown_at: float | None,
        current: SessionCell | None,
    ) -> bool:
        """The cell's summary; True if the ranks' latest lines are its own (a rank writes its
        lines, then says it ran)."""
        self._memory.unfollow(cell.peaks)
        logs = cell is self.logs_target(current)
        with contextlib.suppress(ValueError):
            self.cells.remove(cell)
        if logs:
            self.ending.append(cell)  # the ranks' lines wait for it (end)
        cell.summary = cell.conclude(
            outcome, reason, ranks, teardown_at, self._tailer.lines_total()
        )
        return logs

    async def end(self, cell: SessionCell, logs: bool, attempt: int) -> None:
        """Its last lines (once what each rank had written when it answered has been read: a
        rank on another machine answers over one stream, its output comes over another), its
        alerts, then its END."""
        with anyio.CancelScope(shield=True):
            if logs:
                await self._read_to(cell)
                await cell.report.flush(attempt, self._tailer)
            await cell.report.flush(attempt, None)
            cell.report.close()
            assert cell.summary is not None
            await cell.report.end(cell.summary)
            with contextlib.suppress(ValueError):
                self.ending.remove(cell)
            cell.ended.set()

    async def _read_to(self, cell: SessionCell) -> None:
        """Until the tailer has read each rank's output up to its answer (LOGS_WAIT_S at most: a
        machine lost meanwhile)."""
        with anyio.move_on_after(LOGS_WAIT_S):
            while True:
                self._tailer.poll()
                if all(
                    self._tailer.read_to(cell.attempt, rank, written)
                    for rank, written in cell.written.items()
                ):
                    return
                await anyio.sleep(LOGS_POLL_S)

    async def end_all(
        self, reason: str, book: RankBook, attempt: int, current: SessionCell | None
    ) -> None:
        """The session ended: every cell the kernel still follows ends with it."""
        for cell in list(self.cells):
            ranks = cell.ranks(book.of(cell.attempt)) if cell.no is not None else []
            if cell.no is not None:
                outcome, why = "failed", f"the session ended: {reason}"
            else:
                outcome, why = "stopped", f"the session ended before the cell ran: {reason}"
            logs = self.conclude(cell, outcome, why, ranks, time.time(), current)
            await self.end(cell, logs, attempt)
