"""The cells of a session that the kernel follows: the one the ranks run, those waiting their
turn, and a failed one still showing the restart and the replay it brought. The session's alerts
reach all of them; the ranks' new lines reach one (the cell that runs, else the oldest open one);
each ends with its last lines, its closing alerts and its summary.
"""

from __future__ import annotations

import contextlib
from typing import Any

import anyio

from elastic_nb.supervisor.ranks.log_tailer import LogTailer
from elastic_nb.supervisor.ranks.rank_state import RankState
from elastic_nb.supervisor.sessions.session_cell import SessionCell

__all__ = ["Followed"]


class Followed:
    def __init__(self, tailer: LogTailer) -> None:
        self.cells: list[SessionCell] = []  # oldest first
        self._tailer = tailer

    def add(self, cell: SessionCell) -> None:
        self.cells.append(cell)

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
