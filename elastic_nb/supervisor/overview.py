"""What the JupyterLab panel (the server extension) asks a supervisor: every job, session and
session cell it owns, one entry each (OVERVIEW), and the messages a job's renderer was sent
(EVENTS). Read-only views of the owners' state; nothing here decides."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING

from elastic_nb import protocol
from elastic_nb.common.report import summary_line

if TYPE_CHECKING:
    from elastic_nb.supervisor.runs.job import Job
    from elastic_nb.supervisor.runs.reporter import Reporter
    from elastic_nb.supervisor.sessions.session import Session
    from elastic_nb.supervisor.sessions.session_cell import SessionCell

__all__ = ["entries", "rank_pids", "reporter_of"]


def entries(jobs: Iterable[Job], sessions: Iterable[Session]) -> list[protocol.kernel.PanelEntry]:
    """One entry per job, session and session cell, oldest first."""
    out = [_owner(j, "job") for j in jobs]
    for s in sessions:
        out.append(_owner(s, "session"))
        out.extend(_cell(s, c) for c in s.cells.values())
    return sorted(out, key=lambda e: e["created"])


def reporter_of(owner_id: str, jobs: dict[str, Job], sessions: dict[str, Session]) -> Reporter:
    if owner_id in jobs:
        return jobs[owner_id].report
    if owner_id in sessions:
        return sessions[owner_id].report
    for s in sessions.values():
        if owner_id in s.cells:
            return s.cells[owner_id].report
    raise KeyError(f"no job {owner_id!r}")


def rank_pids(owner: Job | Session) -> dict[str, int]:
    """The live ranks of the current attempt: {rank: pid} (string keys: it travels as JSON)."""
    return {
        str(r.rank): r.pid
        for r in owner.book.of(owner.attempt)
        if r.pid is not None and r.died_at is None
    }


def _owner(o: Job | Session, kind: str) -> protocol.kernel.PanelEntry:
    """A job or a session: each owns its ranks and run directory."""
    return _entry(o, kind, o.state, ranks=o)


def _cell(s: Session, c: SessionCell) -> protocol.kernel.PanelEntry:
    # A cell's ranks are its session's.
    return _entry(c, "cell", c.summary["outcome"] if c.summary else c.report.state, ranks=s)


def _entry(
    it: Job | Session | SessionCell, kind: str, state: str, ranks: Job | Session
) -> protocol.kernel.PanelEntry:
    """`it`'s entry; `ranks`: the group that runs its ranks (`it` itself, or a cell's session)."""
    summary = it.summary
    return protocol.kernel.PanelEntry(
        id=it.id,
        kind=kind,
        session=None if ranks is it else ranks.id,
        supervisor_pid=os.getpid(),
        state=state,
        running=it.running,
        world_size=ranks.world_size,
        attempt=ranks.attempt,
        restarts=ranks.restarts,
        max_restarts=ranks.spec.max_restarts,
        created=it.created,
        elapsed_s=summary["wall_s"] if summary else time.time() - it.created,
        alerts=[
            protocol.kernel.PanelAlert(
                kind=a["kind"], severity=a["severity"], rank=a["rank"], text=a["title"]
            )
            for a in it.report.recent_alerts
        ],
        outcome=summary["outcome"] if summary else None,
        summary=summary_line(summary) if summary is not None else None,
        run_dir=str(it.rd),
        logs_dir=str(ranks.rd),
        paused=sorted(r for a, r in ranks.prompts.paused if a == ranks.attempt)
        if it.running
        else [],
    )
