"""A session's journal: the cells that succeeded, in order, and the replays that brought their
state back after each restart. ``--no-replay`` cells are kept (``%elastic session`` lists them)
but left out of a replay.
"""

from __future__ import annotations

import time
from typing import Any, Protocol

from elastic_nb.supervisor.sessions.session_cell import SessionCell, failure_words

__all__ = ["Journal", "Replayer"]


class Replayer(Protocol):
    """What a replay needs of its session."""

    async def run_cell(self, cell: SessionCell) -> bool: ...  # False: the attempt ended

    def alert(self, kind: str, severity: str, title: str, rank: int | None = None) -> None: ...


class Journal:
    def __init__(self) -> None:
        self.cells: list[SessionCell] = []
        self.replays: list[dict[str, Any]] = []  # attempt, cells, seconds, failed

    def add(self, cell: SessionCell) -> None:
        self.cells.append(cell)

    def to_replay(self) -> list[SessionCell]:
        return [c for c in self.cells if c.spec.replay]

    def start_replay(self, attempt: int) -> dict[str, Any]:
        """The record of one attempt's replay (attempt 0 has nothing to replay)."""
        record = {"attempt": attempt, "cells": 0, "seconds": 0.0, "failed": False}
        if attempt > 0:
            self.replays.append(record)
        return record

    async def replay(self, attempt: int, session: Replayer) -> None:
        """Run the journal (minus --no-replay cells) in order on a new attempt's ranks, saying
        how long each took; a cell that fails stops the replay."""
        cells = self.to_replay()
        left_out = len(self.cells) - len(cells)
        record = self.start_replay(attempt)
        if cells:
            session.alert(
                "replay",
                "info",
                f"attempt {attempt}: replaying {_cells(len(cells))}"
                + (f" ({left_out} left out: --no-replay)" if left_out else ""),
            )
        t0 = time.monotonic()
        for c in cells:
            t = time.monotonic()
            if not await session.run_cell(c):
                return  # a rank died: the next attempt replays again
            failed = sorted(rank for rank, ok in c.answers.items() if not ok)
            if failed:
                record["failed"] = True
                session.alert(
                    "replay",
                    "error",
                    f"the replay stopped: cell {c.no} ({c.first_line}) failed on "
                    f"{failure_words(c, attempt, failed)}; the cells after it did not run",
                    rank=failed[0],
                )
                break
            record["cells"] += 1
            took = time.monotonic() - t
            session.alert(
                "replay", "info", f"replayed cell {c.no} ({c.first_line}) in {took:.2f} s"
            )
        record["seconds"] = time.monotonic() - t0
        if cells and not record["failed"]:
            session.alert(
                "replay",
                "info",
                f"the session's state is back: {_cells(record['cells'])} replayed in "
                f"{record['seconds']:.2f} s",
            )

    def words(self, attempt: int) -> str | None:
        """How the replay of `attempt` went, in a few words; None before it has."""
        last = self.replays[-1] if self.replays else None
        if last is None or last["attempt"] != attempt:
            return None
        if last["failed"]:
            return "its replay failed"
        return f"replayed {_cells(last['cells'])} in {last['seconds']:.2f} s"

    def info(self) -> list[dict[str, Any]]:
        return [
            {"no": c.no, "job": c.id, "line": c.first_line, "replay": c.spec.replay}
            for c in self.cells
        ]


def _cells(n: int) -> str:
    return f"{n} cell{'s' if n != 1 else ''}"
