"""A finished job's summary (summary.json, and the END message the kernel turns into the cell's
result or error), its cause class, and the alerts that close it.

Every key the kernel side reads is written here: `report` words the failure from it, the handle
and the dashboard show it.
"""

from __future__ import annotations

import contextlib
import signal
import time
from typing import Any

from elastic_nb import protocol
from elastic_nb.common import report
from elastic_nb.common.rank_state import RankState
from elastic_nb.common.rundir import RunDir
from elastic_nb.common.spec import JobSpec
from elastic_nb.supervisor.forensics.verdict import Verdict, analyze
from elastic_nb.supervisor.processes.site import Survivor
from elastic_nb.supervisor.ranks.checkpoint_log import CheckpointLog, cost_words
from elastic_nb.supervisor.ranks.rank_book import RankBook

__all__ = [
    "DOWNS",
    "STOPS",
    "cause",
    "closing_alerts",
    "restart_alert",
    "summarize",
    "unkillable",
]


# How a stop request ends a job, by who asked: (outcome, reason).
STOPS = {
    "interrupt": ("interrupted", "interrupted from the kernel"),
    "user": ("stopped", "stopped with %elastic stop"),
    "handle": ("stopped", "stopped with job.stop()"),
    "button": ("stopped", "stopped with the dashboard's Stop button"),
    "panel": ("stopped", "stopped from the JupyterLab panel"),
    "shutdown": ("stopped", "the supervisor shut down (its kernel exited)"),
}
# How a down request ends a session, by who asked.
DOWNS = {
    "user": "ended with %elastic down",
    "panel": "ended from the JupyterLab panel",
}


def summarize(
    *,
    job_id: str,
    spec: JobSpec,
    rd: RunDir,
    outcome: str,
    reason: str,
    verdict: Verdict,
    attempt: int,
    created: float,
    zombie: bool,
    diagnosis: dict[str, Any] | None,
    leftovers: list[protocol.records.Leftover],
    lines: int,
    memory: dict[str, protocol.records.MemoryPeak],
    checkpoints: CheckpointLog,
    world_size: int | None = None,
    restarts: int | None = None,
    nodes_missing: bool = False,
) -> protocol.records.Summary:
    """`world_size` and `restarts`: a multi-node group's (its round's world, the restarts its
    failures and departures spent); else the spec's and the attempt's. `nodes_missing`: a
    multi-node group ended because too few nodes came."""
    root = verdict.root
    failure = None
    if outcome == "failed" and root is not None:
        kind = "zombie" if zombie else verdict.cause
        said = diagnosis if kind == "desync" and diagnosis is not None else {}
        failure = {
            "rank": root.rank,
            "node": root.where,
            "attempt": root.attempt,
            "cause": kind,
            "summary": said.get("text") or root.failure_summary(),
            "hint": said.get("hint"),
            "record": root.failure,
            "exit_code": root.exit_code,
        }
    ended = time.time()
    return protocol.records.summary(
        job_id,
        outcome,
        reason,
        cause=cause(outcome, failure, zombie, nodes_missing),
        world_size=spec.world_size if world_size is None else world_size,
        attempt=attempt,
        restarts=attempt if restarts is None else restarts,
        max_restarts=spec.max_restarts,
        worst_case_s=spec.worst_case_s,
        started=created,
        ended=ended,
        wall_s=ended - created,
        run_dir=str(rd),
        failure=failure,
        diagnosis=diagnosis if outcome != "succeeded" else None,
        others=verdict.others if outcome != "succeeded" else [],
        launcher_log_tail=_log_tail(rd) if outcome == "failed" and failure is None else None,
        leftovers=leftovers,
        result=rd.result(attempt).exists(),
        lines=lines,
        memory=memory,
        checkpoint=_checkpoint(checkpoints, outcome, root),
    )


def _checkpoint(log: CheckpointLog, outcome: str, root: RankState | None) -> dict[str, Any] | None:
    """The latest checkpoint saved, and after a failure what it cost."""
    latest = log.latest
    if latest is None:
        return None
    words = f"the last checkpoint is {report.checkpoint_words(latest)}"
    if outcome == "failed" and root is not None and root.failed_at is not None:
        words = cost_words(log, root.failed_at, root.name, root.lost is not None) or words
    return {**latest, "words": words}


def cause(
    outcome: str, failure: dict[str, Any] | None, zombie: bool, nodes_missing: bool = False
) -> str | None:
    """The job's cause class (report.CAUSE_HINTS explains each)."""
    if failure is not None:
        return str(failure["cause"])
    if outcome == "timeout":
        return "deadline"
    if outcome in ("interrupted", "stopped"):
        return "interrupted"
    if outcome == "failed":
        if zombie:
            return "zombie"
        return "nodes" if nodes_missing else "launcher"
    return None


def closing_alerts(
    summary: protocol.records.Summary,
    current: list[RankState],
    leftovers: list[protocol.records.Leftover],
) -> list[dict[str, Any]]:
    """What the end adds to the alerts: processes the cell left running, a rank that broke
    after finishing, and the failure itself in the words of the error the cell raises."""
    alerts: list[dict[str, Any]] = []
    if leftovers:
        pids = ", ".join(f"{p['pid']} ({p['cmd']})" for p in leftovers)
        alerts.append(
            dict(
                kind="leftovers",
                severity="warning",
                title=f"stopped {len(leftovers)} process(es) the cell left running: {pids}",
            )
        )
    outcome = summary["outcome"]
    if outcome == "succeeded":
        # SIGTERM/SIGKILL after finishing is the agent closing the group, nothing more.
        stops = (0, None, -signal.SIGTERM, -signal.SIGKILL)
        for r in current:
            if r.exit_code not in stops:
                how = report.describe_exit(r.exit_code)
                alerts.append(
                    dict(
                        kind="exit_after_done",
                        severity="warning",
                        title=f"{r.name} finished the cell, then {how} while exiting",
                        rank=r.rank,
                    )
                )
    if outcome in ("failed", "timeout"):
        f = summary["failure"]
        alerts.append(
            dict(
                kind="failure",
                severity="error",
                title=report.failure_headline(summary),
                rank=f["rank"] if f else None,
                text="\n".join(report.failure_report(summary)).strip("\n"),
            )
        )
    return alerts


def restart_alert(
    book: RankBook, attempt: int, desync: str | None, spec: JobSpec, checkpoints: CheckpointLog
) -> dict[str, Any]:
    """`attempt` failed and the next starts: who broke it (`desync`: the verdict's words, if a
    desync did), and what it cost where the cell saves checkpoints."""
    verdict = analyze(book.of(attempt), None, book.behind.get(attempt))
    root = verdict.root
    if verdict.cause == "desync" and desync:
        why = f"desync: {desync}"
    else:
        why = f"{root.name} {root.failure_summary()}" if root else "it failed"
    title = (
        f"attempt {attempt} failed: {why}; restarting as attempt {attempt + 1} "
        f"(restart {attempt + 1}/{spec.max_restarts})"
    )
    if root is not None and root.failed_at is not None:
        cost = cost_words(checkpoints, root.failed_at, root.name, root.lost is not None)
        title += f"; {cost}" if cost else ""
    rank = root.rank if root else None
    return dict(kind="restart", severity="warning", title=title, rank=rank, ends=attempt)


def unkillable(survivors: list[Survivor]) -> dict[str, Any]:
    """The alert for processes of a group that outlived SIGKILL (D state, most often)."""
    return dict(
        kind="unkillable",
        severity="error",
        title=f"{len(survivors)} process(es) of the job survived SIGKILL",
        text="\n".join(f"pid {s['pid']}: {s['state']}" for s in survivors),
    )


def _log_tail(rd: RunDir, n: int = 15) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(rd.launcher_log.read_text(errors="replace").splitlines()[-n:])
    return ""
