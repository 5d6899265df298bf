"""What the JupyterLab panel (the server extension) asks a supervisor: every job, session and
session cell it owns, one entry each (OVERVIEW), and the messages a job's renderer was sent
(EVENTS). Read-only views of the owners' state; nothing here decides."""

from __future__ import annotations

import os
import time
from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from elastic_nb.common.report import summary_line
from elastic_nb.protocol.records import Summary

if TYPE_CHECKING:
    from elastic_nb.supervisor.runs.job import Job
    from elastic_nb.supervisor.runs.reporter import Reporter
    from elastic_nb.supervisor.sessions.session import Session
    from elastic_nb.supervisor.sessions.session_cell import SessionCell

__all__ = ["entries", "rank_pids", "reporter_of"]


def entries(jobs: Iterable[Job], sessions: Iterable[Session]) -> list[dict[str, Any]]:
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


def _owner(o: Job | Session, kind: str) -> dict[str, Any]:
    """A job or a session: each owns its ranks and run directory."""
    return _entry(
        o.id,
        kind,
        None,
        state=o.state,
        running=o.running,
        world_size=o.world_size,
        attempt=o.attempt,
        restarts=o.restarts,
        max_restarts=o.spec.max_restarts,
        created=o.created,
        summary=o.summary,
        report=o.report,
        run_dir=str(o.rd),
        logs_dir=str(o.rd),
    )


def _cell(s: Session, c: SessionCell) -> dict[str, Any]:
    return _entry(
        c.id,
        "cell",
        s.id,
        state=c.summary["outcome"] if c.summary else c.report.state,
        running=c.running,
        world_size=s.world_size,
        attempt=s.attempt,
        restarts=s.restarts,
        max_restarts=s.spec.max_restarts,
        created=c.created,
        summary=c.summary,
        report=c.report,
        run_dir=str(c.rd),
        logs_dir=str(s.rd),  # a cell's ranks are its session's
    )


def _entry(
    owner_id: str,
    kind: str,
    session: str | None,
    *,
    state: str,
    running: bool,
    world_size: int,
    attempt: int,
    restarts: int,
    max_restarts: int,
    created: float,
    summary: Summary | None,
    report: Reporter,
    run_dir: str,
    logs_dir: str,
) -> dict[str, Any]:
    line = summary_line(summary) if summary is not None else None
    return {
        "id": owner_id,
        "kind": kind,
        "session": session,
        "supervisor_pid": os.getpid(),
        "state": state,
        "running": running,
        "world_size": world_size,
        "attempt": attempt,
        "restarts": restarts,
        "max_restarts": max_restarts,
        "created": created,
        "elapsed_s": summary["wall_s"] if summary else time.time() - created,
        "alerts": [
            {"kind": a["kind"], "severity": a["severity"], "rank": a["rank"], "text": a["title"]}
            for a in report.recent_alerts
        ],
        "outcome": summary["outcome"] if summary else None,
        "summary": line,
        "run_dir": run_dir,
        "logs_dir": logs_dir,
    }
