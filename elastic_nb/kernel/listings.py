"""What ``%elastic jobs``, ``%elastic logs`` and ``%elastic status`` print: this kernel's jobs as
a table, a job's rank logs from its run directory, its ranks' memory now."""

from __future__ import annotations

from collections.abc import Iterable

from elastic_nb import protocol
from elastic_nb.common.report import memory_figures, rate, size
from elastic_nb.common.run_records import rank_logs
from elastic_nb.common.rundir import RunDir
from elastic_nb.kernel.job_handle import JobHandle

__all__ = ["jobs_table", "memory_lines", "print_logs"]


def memory_lines(ranks: dict[str, protocol.kernel.RankMemory]) -> list[str]:
    """One line per rank from the supervisor's latest samples (RankGroup.memory_now)."""
    out = []
    for rank, m in ranks.items():
        s = m["sample"]
        cuda, gpu = s["cuda"], s["gpu"]
        line = f"rank {rank}: " + memory_figures(
            s["rss"],
            gpu["process"] if gpu else None,
            gpu["index"] if gpu else None,
            cuda["allocated"] if cuda else None,
        )
        host = [f"peak {size(m['rss_peak'])}"] if m["rss_peak"] else []
        if growth := rate(m["growth"]):
            host.append(growth)
        if host:
            line += f"; host {', '.join(host)}"
        if gpu and gpu["total"]:
            line += f"; GPU {gpu['index']} {size(gpu['used'])} of {size(gpu['total'])} in use"
        out.append(line)
    return out


def jobs_table(jobs: Iterable[JobHandle], running: dict[str, protocol.kernel.JobRow]) -> list[str]:
    """One row per job: its outcome once it has ended, else what the supervisor says now."""
    rows = []
    for job in jobs:
        s = job.summary
        if s is not None:
            restarts = f"{s['restarts']}/{s['max_restarts']}"
            row = (job.id, s["outcome"], s["world_size"], restarts, f"{s['wall_s']:.1f}")
        else:
            info = running.get(job.id)
            state, wall = (info["state"], info["wall_s"]) if info else ("running", 0.0)
            row = (job.id, state, job.spec.world_size, "-", f"{wall:.1f}")
        rows.append((*row, job.run_dir))
    if not rows:
        return []
    header = ("job", "state", "ranks", "restarts", "wall s", "run dir")
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    return [
        "  ".join(str(v).ljust(w) for v, w in zip(row, widths, strict=True)).rstrip()
        for row in [header, *rows]
    ]


def print_logs(job: JobHandle, rank: int | None, attempt: int | None, tail: int) -> None:
    """Every rank's (or one rank's) stdout and stderr of an attempt (the last by default); a
    session's cell reads its session's logs."""
    rd = RunDir(job.ranks_run_dir)
    if not rd.attempts():
        print(f"job {job.id} has no logs yet ({rd})")
        return
    print("\n".join(rank_logs(rd, rank, attempt, tail)))
