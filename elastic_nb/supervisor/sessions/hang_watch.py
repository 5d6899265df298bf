"""``--hang-after`` on a session: while a cell runs, a silence of every rank that lasts the cell's
``--hang-after`` brings an alert with where each rank is, which its chips show until a rank speaks
again. Nothing ends: the cell goes on (a stop while the alert stands says where it stood).
The session's `silence` is a job's (`watchdogs.Silence`), reset as each cell starts.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import anyio

from elastic_nb.supervisor.ranks.evidence import EvidenceCollector
from elastic_nb.supervisor.runs.cell_rules import Standing
from elastic_nb.supervisor.runs.diagnosis import where_finding
from elastic_nb.supervisor.runs.rank_group import RankGroup
from elastic_nb.supervisor.sessions.session_cell import SessionCell

__all__ = ["watch_hangs"]

HANG_POLL_S = 0.1


async def watch_hangs(group: RankGroup, current: Callable[[], SessionCell | None]) -> None:
    """Look every HANG_POLL_S at the cell the ranks run (`current`), for as long as the group."""
    while True:
        await anyio.sleep(HANG_POLL_S)
        cell = current()
        if cell is None or not cell.running or cell.spec.hang_after is None:
            continue
        lines = group.tailer.activity_total()
        if cell.places is not None and cell.places[1] != lines:
            cell.places = None  # a rank spoke: its chips say "running" again
            cell.chips(cell.ranks(group.book.of(cell.attempt)), None)
        if group.silence.due(time.monotonic(), lines, True, cell.spec.hang_after):
            group.task_group.start_soon(_hang_alert, group, cell)


async def _hang_alert(group: RankGroup, cell: SessionCell) -> None:
    collector = EvidenceCollector(group.rd, group.book.site, cell.source, cell.rd.cell)
    ev = await collector.collect(group.book.of(group.attempt))
    title = f"no output from any rank for {cell.spec.hang_after:g} s (--hang-after)"
    found = where_finding(title, ev, group.held_memory())
    cell.standing = found  # a stop while it stands ends the cell with it
    cell.hear(Standing(time.time(), cell.id, found.title))
    cell.report.alert("hang", "warning", found.title, rank=found.culprit, text=found.stacks)
    if cell.running:
        cell.places = (group.places(ev.places), group.tailer.activity_total())
        cell.chips(cell.ranks(group.book.of(cell.attempt)), None)
