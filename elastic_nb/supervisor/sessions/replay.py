"""The replay: after a restart, the session's journal (`journal.Journal`: the cells that succeeded,
minus the ``--no-replay`` ones) runs again, in order, on the new attempt's ranks before any other
cell, so that they come back with the state the cells built (`session.Session` starts it once
every rank of the attempt is up, and sends each cell).

One alert says how it goes and grows as it does (each replaces the last of its key). A cell that
fails on a rank stops the replay: the cells after it would run on a state it did not build. A rank
that dies during it ends the attempt, and the next attempt replays again.
"""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from elastic_nb.supervisor.sessions.journal import Journal, cells
from elastic_nb.supervisor.sessions.session_cell import SessionCell, failure_words

__all__ = ["Alert", "RunCell", "replay"]

# A journal's cell run on every rank of the attempt; False if the attempt ended first.
RunCell = Callable[[SessionCell], Awaitable[bool]]


class Alert(Protocol):
    """The session's alert (`Session.alert`: to the cells the kernel follows too)."""

    def __call__(self, kind: str, severity: str, title: str, **about: Any) -> None: ...


async def replay(journal: Journal, attempt: int, run: RunCell, alert: Alert) -> None:
    """Run the journal on `attempt`'s ranks, saying how long each cell took; the journal keeps
    the replay's record (`Journal.start_replay`)."""
    replayed = journal.to_replay()
    left_out = len(journal.cells) - len(replayed)
    record = journal.start_replay(attempt)
    key = f"replay-{attempt}"
    head = f"attempt {attempt}: replaying {cells(len(replayed))}" + (
        f" ({left_out} left out: --no-replay)" if left_out else ""
    )
    if replayed:
        alert("replay", "info", head, key=key)
    t0 = time.monotonic()
    for c in replayed:
        t = time.monotonic()
        if not await run(c):
            return  # a rank died: the next attempt replays again
        failed = sorted(rank for rank, ok in c.answers.items() if not ok)
        if failed:
            record["failed"] = True
            alert(
                "replay",
                "error",
                f"{head}: the replay stopped: cell {c.no} ({c.first_line}) failed on "
                f"{failure_words(c, attempt, failed)}; the cells after it did not run",
                rank=failed[0],
                key=key,
            )
            break
        record["cells"] += 1
        took = time.monotonic() - t
        alert(
            "replay",
            "info",
            f"{head}: {record['cells']} done, the last: replayed cell {c.no} "
            f"({c.first_line}) in {took:.2f} s",
            key=key,
        )
    record["seconds"] = time.monotonic() - t0
    if replayed and not record["failed"]:
        alert(
            "replay",
            "info",
            f"the session's state is back: {cells(record['cells'])} replayed in "
            f"{record['seconds']:.2f} s",
            key=key,
        )
