"""A session's journal: the cells that succeeded, in order, and the replays that brought their
state back after each restart (the session runs them: `session.Session`). ``--no-replay`` cells
are kept (``%elastic session`` lists them) but left out of a replay.
"""

from __future__ import annotations

from elastic_nb import protocol
from elastic_nb.supervisor.sessions.session_cell import SessionCell

__all__ = ["Journal", "cells"]


class Journal:
    def __init__(self) -> None:
        self.cells: list[SessionCell] = []
        self.replays: list[protocol.kernel.Replay] = []

    def add(self, cell: SessionCell) -> None:
        self.cells.append(cell)

    def to_replay(self) -> list[SessionCell]:
        return [c for c in self.cells if c.spec.replay]

    def start_replay(self, attempt: int) -> protocol.kernel.Replay:
        """The record of one attempt's replay (attempt 0 has nothing to replay)."""
        record = protocol.kernel.Replay(attempt=attempt, cells=0, seconds=0.0, failed=False)
        if attempt > 0:
            self.replays.append(record)
        return record

    def words(self, attempt: int) -> str | None:
        """How the replay of `attempt` went, in a few words; None before it has."""
        last = self.replays[-1] if self.replays else None
        if last is None or last["attempt"] != attempt:
            return None
        if last["failed"]:
            return "its replay failed"
        return f"replayed {cells(last['cells'])} in {last['seconds']:.2f} s"

    def info(self) -> list[protocol.kernel.JournalCell]:
        return [
            protocol.kernel.JournalCell(
                no=c.no or 0, job=c.id, line=c.first_line, replay=c.spec.replay
            )
            for c in self.cells  # each has run (and has its number)
        ]


def cells(n: int) -> str:
    return f"{n} cell{'s' if n != 1 else ''}"
