"""Which rank broke an attempt, and what happened to the others because of it.

torchelastic names as root cause the failure with the smallest whole-second timestamp, ties to the
lowest rank, so it often blames a victim (elastic/multiprocessing/errors/__init__.py). Here every
rank's failure carries a sub-second time of our own: the worker stamps the exception it raised,
the supervisor stamps the moment a rank's site saw it die. The root is the earliest failure
that is not itself a consequence; "connection closed by peer" errors and SIGTERMs sent while the
group is being torn down are consequences.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import Any

from elastic_nb.common.rank_state import RankState
from elastic_nb.common.report import signal_name

__all__ = ["FAILED", "Verdict", "analyze", "stopped_after_a_peer_went"]

_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGKILL)
# A rank's own failure, as opposed to a consequence of another rank's.
_REAL = ("exception", "oom", "host_oom", "exit", "exit0", "signal", "lost")
# The kinds (`RankState.kind`) of a rank that failed, on its own or as a consequence.
FAILED = frozenset((*_REAL, "collective_timeout", "peer"))
# The cause class of a job's failure, by the root rank's kind.
CAUSES = {
    "exception": "exception",
    "oom": "cuda_oom",
    "host_oom": "host_oom",
    "exit": "exit",
    "exit0": "exit",
    "signal": "signal",
    "collective_timeout": "collective_timeout",
    "peer": "peer",
    "lost": "node_lost",
}


@dataclass
class Verdict:
    root: RankState | None
    cause: str | None  # a cause class (CAUSES' values, or "desync")
    others: list[dict[str, Any]]  # one per other rank: rank, kind, text, delay


def stopped_after_a_peer_went(r: RankState, peers: list[RankState]) -> bool:
    """`r` was SIGTERMed or SIGINTed once a rank that reported a peer's error had exited: torch's
    agent stopping the others (a peer outside the job died under that rank)."""
    gone = [p.died_at for p in peers if p.died_at is not None]
    return (
        bool(gone)
        and r.exit_code in (-signal.SIGTERM, -signal.SIGINT)
        and min(gone) <= (r.died_at or 0.0)
    )


def analyze(
    ranks: list[RankState],
    teardown_at: float | None,
    behind: list[int] | None = None,
    nproc: int = 0,
) -> Verdict:
    """`behind`: ranks a desync verdict found missing from the collective the others timed out
    in; one of them is the root when no rank failed on its own. Ranks below `nproc` that are
    not in `ranks` had not started (a deadline can pass before they do)."""
    kinds = {r.rank: r.kind(teardown_at) for r in ranks}
    by_time = sorted(ranks, key=lambda r: r.failed_at or 0.0)
    peers = [r for r in by_time if kinds[r.rank] == "peer"]
    timeouts = [r for r in by_time if kinds[r.rank] == "collective_timeout"]
    real = [r for r in by_time if kinds[r.rank] in _REAL]
    # A rank killed by SIGTERM/SIGINT/SIGKILL after another rank failed (on its own, or timing
    # out in a collective) was stopped by the agent: a consequence. Not after a peer error: a
    # peer sees a death before our clock does, so that death may well be its cause; but a
    # SIGTERM or SIGINT seen after the peer's own exit is torch's agent stopping the others once
    # a rank has gone (a peer outside the job died under it).
    stopped = [
        r for r in real if kinds[r.rank] == "signal" and -(r.exit_code or 0) in _STOP_SIGNALS
    ]
    failures = [r for r in by_time if kinds[r.rank] in (*_REAL, "collective_timeout")]
    first = next((r for r in failures if r not in stopped), None)
    for r in stopped:
        after_first = first is not None and (first.failed_at or 0.0) <= (r.failed_at or 0.0)
        if after_first or stopped_after_a_peer_went(r, peers):
            kinds[r.rank] = "agent"
    real = [r for r in real if kinds[r.rank] != "agent"]
    # NCCL aborts every rank (SIGABRT) once a collective timed out: after the first timeout,
    # an abort is its consequence, whichever rank the abort reached first.
    if timeouts:
        first_timeout = timeouts[0].failed_at or 0.0
        for r in real:
            if r.exit_code == -signal.SIGABRT and (r.failed_at or 0.0) >= first_timeout:
                kinds[r.rank] = "nccl_abort"
        real = [r for r in real if kinds[r.rank] != "nccl_abort"]
    lagging = [r for r in ranks if r.rank in (behind or ())]
    if lagging:
        # A desync was found first; ranks stopped after it (by us, to end the attempt, or by
        # the agent) are its consequences.
        for r in stopped:
            kinds[r.rank] = "terminated"
        real = [r for r in real if r not in stopped]
    cause = None
    root: RankState | None
    if real:
        root = real[0]
    elif lagging:
        root, cause = lagging[0], "desync"
    else:
        root = next(iter(timeouts or peers), None)

    others: list[dict[str, Any]] = []
    for r in sorted(ranks, key=lambda r: r.rank):
        if r is root:
            continue
        kind = kinds[r.rank]
        delay = None
        if root is not None and r.failed_at is not None and root.failed_at is not None:
            delay = r.failed_at - root.failed_at
        others.append(
            {
                "rank": r.rank,
                "node": r.where,
                "kind": kind,
                "text": _describe(r, kind, root),
                "delay": delay,
            }
        )
    started = {r.rank for r in ranks}
    others.extend(
        {"rank": rank, "kind": "pending", "text": "had not started", "delay": None}
        for rank in range(nproc)
        if rank not in started
    )
    others.sort(key=lambda o: o["rank"])
    if root is not None and cause is None:
        cause = CAUSES.get(kinds[root.rank], kinds[root.rank])
    return Verdict(root, cause, others)


def _describe(r: RankState, kind: str, root: RankState | None) -> str:
    after = ""
    if root is not None:
        after = f" after {root.name} {'left the cell' if root.done else 'failed'}"
    if kind == "done":
        return "finished the cell"
    if kind == "running":
        return "was still running"
    if kind == "peer":
        return f"{r.failure_summary()}: its peer had died"
    if kind == "collective_timeout":
        return f"timed out waiting: {r.failure_summary()}"
    if kind == "terminated":
        if r.failure is not None and r.died_at is None:
            # A session's rank, interrupted in the cell and back in its loop.
            return f"interrupted by elastic_nb (KeyboardInterrupt in the cell){after}"
        if r.failure:
            how = "SIGINT"
        elif r.exit_code is None:
            return f"stopped by elastic_nb (its exit status never came){after}"
        else:
            how = signal_name(-r.exit_code)
        if how == "SIGINT":
            return f"ended with its parent (torch's parent-death signal, SIGINT){after}"
        return f"stopped by elastic_nb ({how}){after}"
    if kind == "nccl_abort":
        return "aborted by NCCL (SIGABRT) after the collective timeout"
    if kind == "agent":
        return f"stopped by the torchelastic agent ({signal_name(-(r.exit_code or 0))}){after}"
    return f"also failed: {r.failure_summary()}"
