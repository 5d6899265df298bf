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

from elastic_nb.supervisor.ranks.log_tailer import LogTailer
from elastic_nb.supervisor.ranks.memory_watch import MemoryWatch
from elastic_nb.supervisor.ranks.rank_book import RankBook
from elastic_nb.supervisor.ranks.rank_state import RankState
from elastic_nb.supervisor.sessions.session_cell import SessionCell

__all__ = ["Followed"]


class Followed:
    def __init__(self, tailer: LogTailer, memory: MemoryWatch) -> None:
        self.cells: list[SessionCell] = []  # oldest first
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
        return current if current in self.cells else next(iter(self.cells), None)

    async def flush(self, attempt: int, current: SessionCell | None) -> None:
        target = self.logs_target(current)
        for c in self.cells:
            await c.report.flush(attempt, self._tailer if c is target else None)
        if target is None:
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
        cell.summary = cell.conclude(
            outcome, reason, ranks, teardown_at, self._tailer.lines_total()
        )
        return logs

    async def end(self, cell: SessionCell, logs: bool, attempt: int) -> None:
        """Its last lines and alerts, then its END."""
        with anyio.CancelScope(shield=True):
            if logs:
                self._tailer.poll()
                await cell.report.flush(attempt, self._tailer)
            await cell.report.flush(attempt, None)
            cell.report.close()
            assert cell.summary is not None
            await cell.report.end(cell.summary)

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
