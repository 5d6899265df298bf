"""Reading run directories back, for a person: a job's rank logs (`%elastic logs`, `elastic-nb
logs`) and the runs under a log directory (`elastic-nb runs`). Only files: no supervisor, no
kernel, so that a terminal on the notebook's machine can read what a job left after the fact.
"""

from __future__ import annotations

import os
import re
import time
from pathlib import Path

from elastic_nb.common.rundir import RunDir, read_json

__all__ = ["rank_logs", "ranks_of", "runs_table"]

_RANK_LOG = re.compile(r"rank-(\d+)\.(?:out|err)\Z")


def ranks_of(rd: RunDir, attempt: int) -> list[int]:
    """The ranks an attempt's folder has logs of (every node's, in a multi-node job)."""
    try:
        names = os.listdir(rd.attempt(attempt))
    except FileNotFoundError:
        return []
    return sorted({int(m.group(1)) for n in names if (m := _RANK_LOG.match(n))})


def rank_logs(rd: RunDir, rank: int | None, attempt: int | None, tail: int) -> list[str]:
    """Every rank's (or one rank's) stdout and stderr of an attempt (the last by default), each
    line prefixed with its rank; `tail` lines per file (0: all)."""
    attempts = rd.attempts()
    if not attempts:
        return [f"no logs yet in {rd}"]
    attempt = attempts[-1] if attempt is None else attempt
    out: list[str] = []
    for r in ranks_of(rd, attempt) if rank is None else [rank]:
        paths = [(s, rd.log(attempt, r, s)) for s in ("out", "err")]
        paths = [(s, p) for s, p in paths if p.exists() and p.stat().st_size]
        if not paths:
            out.append(f"==> rank {r}, attempt {attempt}: no output <==")
        for stream, path in paths:
            lines = path.read_text(errors="replace").splitlines()
            shown = lines[-tail:] if tail else lines
            out.append(
                f"==> rank {r} std{stream}, attempt {attempt}: {path} ({len(lines)} lines) <=="
            )
            out.extend(f"[rank {r}] {text}" for text in shown)
    return out


def runs_table(log_dir: Path, limit: int = 30) -> list[str]:
    """The latest runs under `log_dir`, newest last: id, outcome, ranks, restarts, wall time."""
    runs = []
    for d in log_dir.iterdir() if log_dir.is_dir() else []:
        spec = d / "spec.json"
        if d.is_dir() and spec.exists():
            runs.append((spec.stat().st_mtime, d))
    rows = []
    for mtime, d in sorted(runs)[-limit:]:
        s = read_json(d / "summary.json") or {}
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(mtime))
        restarts = f"{s['restarts']}/{s['max_restarts']}" if s else "-"
        wall = f"{s['wall_s']:.1f}" if s else "-"
        rows.append(
            (d.name, when, s.get("outcome", "running?"), s.get("world_size", "-"), restarts, wall)
        )
    if not rows:
        return [f"no runs in {log_dir}"]
    header = ("run", "started", "outcome", "ranks", "restarts", "wall s")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]
