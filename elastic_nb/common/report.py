"""The words elastic_nb uses to report a job: its start line, the one-line summary, the
failure report, and how a process ended.

Both renderers (text and widgets) and the exception a failed cell raises say the same thing, from
the spec a job starts with and the summary the supervisor sends when it ends.
"""

from __future__ import annotations

import os
import re
import signal
from typing import Any

from elastic_nb.protocol.records import Round, Summary

__all__ = [
    "CAUSE_HINTS",
    "checkpoint_how",
    "checkpoint_words",
    "describe_exit",
    "duration",
    "failure_headline",
    "failure_report",
    "memory_figures",
    "oom_lines",
    "peaks_line",
    "rate",
    "round_line",
    "signal_name",
    "size",
    "start_line",
    "summary_line",
]

# Every cause class a job can end with, and what to do about it.
CAUSE_HINTS = {
    "exception": "the cell raised on this rank; its traceback is below",
    "cuda_oom": "CUDA ran out of memory on this rank: smaller batches, activation "
    "checkpointing or mixed precision, or torch.cuda.empty_cache() between steps",
    "host_oom": "the kernel's OOM killer ended this rank (host memory): fewer ranks, fewer "
    "DataLoader workers or smaller batches",
    "collective_timeout": "a collective waited longer than --collective-timeout with every rank "
    "in it: a slow rank, the network or the driver; the stacks show where each rank was",
    "desync": "the ranks ran different collectives (e.g. one caught an error and skipped "
    "backward()): every rank must run the same collectives in the same order",
    "peer": "this rank saw its peer disappear; no rank reported a failure of its own",
    "signal": "killed by a signal: from outside (a user, the OOM killer) or a native crash "
    "(NCCL's watchdog aborts with SIGABRT after a collective timeout)",
    "exit": "the rank called exit() (or os._exit) before the cell finished",
    "zombie": "torchelastic's agent got stuck (a rank died while the agent woke it, or the "
    "launcher froze); elastic_nb stopped it",
    "deadline": "the job ran past --timeout",
    "interrupted": "stopped on request before the ranks finished",
    "launcher": "the launcher failed before any rank did; see launcher.log",
    "node_lost": "the node this rank ran on left (its agent died, its machine or the network "
    "to it went): --max-restarts lets the job go on without it, %elastic nodes lists the nodes",
    "nodes": "the job's nodes did not come (too few joined agents): %elastic join-command prints "
    "the line that adds one, %elastic nodes lists those there are",
}


def start_line(
    job: str,
    nproc: int,
    worst_case_s: float | None = None,
    session: str | None = None,
    nodes: tuple[int, int] = (1, 1),
) -> str:
    """What a cell says as its job starts: its id, its ranks (a session's, for a session's cell;
    across machines, `nproc` on each of MIN to MAX `nodes`) and the worst case a stuck
    collective can hold the cell."""
    worst = (
        f" (a stuck collective fails the cell within {worst_case_s:g} s)"
        if worst_case_s is not None
        else ""
    )
    ranks = f"{nproc} rank{'s' if nproc != 1 else ''}"
    if nodes != (1, 1):
        count = f"{nodes[0]}" if nodes[0] == nodes[1] else f"{nodes[0]} to {nodes[1]}"
        ranks += f" on each of {count} nodes"
    what = f"on session {session}'s {ranks}" if session else f"starting {ranks}"
    return f"[elastic_nb] job {job}: {what}{worst}"


def round_line(entry: Round, ranks: dict[int, str]) -> str:
    """A multi-node job's round, once every rank of it runs: its nodes and their ranks, what the
    change took (why it began is its alert's line, said as it began; the first round's is
    here). `ranks`: rank -> its node."""
    by_node: dict[str, list[int]] = {}
    for rank, node in sorted(ranks.items()):
        by_node.setdefault(node, []).append(rank)
    where = "; ".join(f"{node}: ranks {_spans(rs)}" for node, rs in by_node.items())
    took = f", running {entry['running_s']:.1f} s after it began" if entry["running_s"] else ""
    why = f": {entry['why']}" if not entry["attempt"] else ""
    return (
        f"[elastic_nb] attempt {entry['attempt']}{why} · world size {entry['world_size']} · "
        f"{where or ', '.join(entry['nodes'])}{took}"
    )


def _spans(ranks: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], None
    for i, r in enumerate(ranks):
        if start is None:
            start = r
        if i + 1 == len(ranks) or ranks[i + 1] != r + 1:
            out.append(f"{start}-{r}" if r != start else f"{r}")
            start = None
    return ", ".join(out)


def timeline_lines(attempts: list[dict[str, Any]], wall_s: float) -> list[str]:
    """The timeline in words (the dashboard draws it): an attempt a line, from its start to its
    end in seconds into the job, its nodes and world size across machines, and why it ended.
    `attempts`: each attempt's `started` (seconds into the job), and `nodes`, `world_size`, `why`
    where known."""
    lines = ["[elastic_nb] timeline:"]
    for i, a in enumerate(attempts):
        end = attempts[i + 1]["started"] if i + 1 < len(attempts) else wall_s
        parts = [
            f"attempt {a['attempt']}",
            f"{a['started']:.1f} s to {end:.1f} s ({duration(end - a['started'])})",
        ]
        if a.get("nodes"):
            parts.append(f"{', '.join(a['nodes'])} · world size {a['world_size']}")
        if a.get("why"):
            parts.append(f"ended: {a['why']}")
        lines.append("[elastic_nb]   " + " · ".join(parts))
    return lines


def summary_line(s: Summary) -> str:
    restarts = f"restarts {s['restarts']}/{s['max_restarts']}"
    parts = [
        f"job {s['job']} {s['outcome']}",
        f"{s['world_size']} rank{'s' if s['world_size'] != 1 else ''}",
        restarts,
        f"{s['wall_s']:.1f} s",
        f"logs: {s['run_dir']}",
    ]
    if s["outcome"] != "succeeded" and s.get("cause"):
        parts.insert(1, f"cause: {s['cause']}")
    return "[elastic_nb] " + " · ".join(parts)


def failure_headline(s: Summary) -> str:
    f = s.get("failure")
    if s["outcome"] == "timeout":
        return f"job {s['job']} ran past its deadline: {s['reason']}; every rank was stopped"
    if f is None:
        return f"job {s['job']} failed: {s['reason']}"
    if f["cause"] == "desync":
        return f"desync: {f['summary']}"
    first = "failed first" if s["world_size"] > 1 else "failed"
    return f"{_rank(f)} {first}: {f['summary']}"


def _rank(r: dict[str, Any]) -> str:
    """'rank 3', or across machines 'node 1 (gpu-b) rank 3'."""
    return f"{r['node']} rank {r['rank']}" if r.get("node") else f"rank {r['rank']}"


def failure_report(s: Summary) -> list[str]:
    """The lines under the headline: the root rank's traceback, then every other rank."""
    lines: list[str] = []
    f = s.get("failure")
    hint = (f or {}).get("hint") or CAUSE_HINTS.get(s.get("cause") or "")
    if hint:
        lines.append(f"cause: {s['cause']} ({hint})")
    checkpoint = s.get("checkpoint")
    if checkpoint and f:
        lines.append(f"checkpoint: {checkpoint['words']} ({checkpoint['path']})")
    record = f.get("record") if f else None
    if f and record:
        lines.append("")
        lines.append(f"--- {_rank(f)} (attempt {f['attempt']}) ---")
        lines.extend(_cell_traceback(record["traceback"], s["run_dir"]).rstrip("\n").splitlines())
        lines.extend(oom_lines(record.get("memory")))
    elif tail := s.get("launcher_log_tail"):
        lines.append("")
        lines.append("--- launcher.log (last lines) ---")
        lines.extend(tail.splitlines())
    diagnosis = s.get("diagnosis") or {}
    if diagnosis.get("stacks"):
        lines.append("")
        lines.append("--- where every rank was (stacks taken before the teardown) ---")
        lines.extend(diagnosis["stacks"].splitlines())
    others = s.get("others") or []
    if others:
        lines.append("")
        lines.append("--- the other ranks ---" if f else "--- ranks ---")
        for o in others:
            delay = (
                f" (+{o['delay']:.2f} s)" if o.get("delay") is not None and o["delay"] >= 0 else ""
            )
            lines.append(f"{_rank(o)}: {o['text']}{delay}")
    if s.get("session"):
        # What the failure did to the session's ranks: kept, restarted and replayed, or ended.
        lines.append("")
        lines.append(f"--- session {s['session']} ---")
        lines.append(s["reason"])
    return lines


def peaks_line(s: Summary) -> str | None:
    """Each rank's peak memory over the job, as sampled each second; None if never sampled."""
    peaks = s.get("memory") or {}
    parts = [
        f"rank {rank} {memory_figures(p['rss'], p['gpu'], p['gpu_index'], p['cuda'])}"
        for rank, p in peaks.items()
    ]
    return "[elastic_nb] peak memory: " + " · ".join(parts) if parts else None


def memory_figures(
    rss: int | None, gpu: int | None, gpu_index: int | None, cuda: int | None
) -> str:
    """'412 MiB host, 31.2 GiB on GPU 0 (28.0 GiB allocated by torch)'."""
    text = f"{size(rss)} host" if rss is not None else "host memory unknown"
    if gpu is not None:
        text += f", {size(gpu)} on GPU {gpu_index}"
        if cuda is not None:
            text += f" ({size(cuda)} allocated by torch)"
    elif cuda is not None:
        text += f", {size(cuda)} of CUDA memory allocated by torch"
    return text


def oom_lines(memory: dict[str, Any] | None) -> list[str]:
    """At a CUDA OOM (a failure record's memory report): what filled the GPU, by the cell lines
    whose allocations were live (--memory-history), or how to see that next time."""
    if not memory:
        return []
    history = memory.get("history")
    if history is None:
        return [
            "what filled the GPU: run the cell again with --memory-history (a session's next "
            "cells: %elastic config --memory-history) and this report lists the cell lines "
            "whose allocations held it"
        ]
    gpu = f"GPU {memory['device']}" if memory.get("device") is not None else "the GPU"
    out = []
    if history.get("largest") is not None:
        out.append(f"what filled {gpu} (live allocations by the cell line that made them):")
        for g in history["largest"]:
            if g["line"] is None:
                where = g["what"]
            else:
                where = f"{_cell_line(g['job'], g['line'])}: {g['what']}"
            blocks = f"{g['blocks']:,} block{'s' if g['blocks'] != 1 else ''}"
            out.append(f"  {size(g['bytes']):>8}  {where}  ({blocks})")
            if len(g.get("calls") or ()) > 1:  # one frame is the line just said
                out.append(f"{'':12}its largest block: {' → '.join(map(_call, g['calls']))}")
    if history.get("failed"):
        # The flag was on: how to turn it on is no answer; what broke is.
        out.append(f"what filled {gpu}: --memory-history was on, but {history['failed']}")
    if history.get("snapshot"):
        out.append(
            f"torch's memory snapshot: {history['snapshot']} (drop it on "
            "https://pytorch.org/memory_viz)"
        )
    return out


def _cell_line(job: str | None, line: int | None) -> str:
    return f"cell of job {job}, line {line}" if job else f"cell line {line}"


def _call(frame: dict[str, Any]) -> str:
    """One frame of an allocation's stack (rank.memory.calls_of)."""
    if "skipped" in frame:
        n = frame["skipped"]
        return f"({n} frame{'s' if n != 1 else ''})"
    if "where" in frame:
        return str(frame["where"])
    return _cell_line(frame.get("job"), frame.get("line"))


def _cell_traceback(text: str, run_dir: str) -> str:
    """Show the cell's frames as the cell, not as the file the ranks ran; a frame of an earlier
    cell (a function a session cell defined) as that cell, named by its job."""
    text = text.replace(f'File "{run_dir}/cell.py", line ', "%%elastic cell, line ")
    parent = re.escape(os.path.dirname(run_dir))
    earlier = re.compile(rf'File "{parent}/([0-9a-f]{{8}})/cell\.py", line ')
    return earlier.sub(r"%%elastic cell of job \1, line ", text)


def size(n: float) -> str:
    """Bytes as a person reads them: 412 MiB, 74.1 GiB."""
    if n >= 2**30:
        return f"{n / 2**30:.1f} GiB"
    if n >= 2**20:
        return f"{n / 2**20:.0f} MiB"
    return f"{n / 2**10:.0f} KiB"


def checkpoint_words(saved: dict[str, Any]) -> str:
    """A saved checkpoint (elastic_nb.checkpoint's record): 'step 1200 (1.2 GiB, written in
    3.1 s, 0.2 s of it blocking training)'."""
    how = f"written in {duration(saved['seconds'])}"
    if saved.get("async") and saved.get("blocked_s") is not None:
        how += f", {duration(saved['blocked_s'])} of it blocking training"
    sized = f"{size(saved['bytes'])}, " if saved.get("bytes") else ""
    return f"step {saved['step']} ({sized}{how})"


def checkpoint_how(saved: dict[str, Any]) -> str:
    """How a saved checkpoint was written (the dashboard header's tooltip): 'written in 1.4 s by
    2 ranks', async: 'written in 3.1 s by 2 ranks (async: 0.20 s blocking training, 2.9 s beside
    it)'."""
    how = f"written in {duration(saved['seconds'])}"
    ranks = saved.get("world_size")
    if ranks:
        how += f" by {ranks} rank{'' if ranks == 1 else 's'}"
    blocked, beside = saved.get("blocked_s"), saved.get("overlapped_s")
    if saved.get("async") and blocked is not None and beside is not None:
        how += f" (async: {duration(blocked)} blocking training, {duration(beside)} beside it)"
    return how


def duration(seconds: float) -> str:
    """A span as a person says it: 0.04 s, 1.4 s, 14 s, 3 min 5 s, 2 h 10 min."""
    if seconds < 1:
        return f"{seconds:.2f} s"
    if seconds < 10:
        return f"{seconds:.1f} s"
    if seconds < 60:
        return f"{seconds:.0f} s"
    if seconds < 3600:
        m, s = divmod(round(seconds), 60)
        return f"{m} min {s} s" if s else f"{m} min"
    h, m = divmod(round(seconds) // 60, 60)
    return f"{h} h {m} min" if m else f"{h} h"


def rate(per_minute: float | None) -> str | None:
    """'+1.2 GiB per minute'; None for no rate, or less than a MiB a minute."""
    if per_minute is None or abs(per_minute) < 2**20:
        return None
    return f"{'+' if per_minute > 0 else '-'}{size(abs(per_minute))} per minute"


def signal_name(signum: int) -> str:
    try:
        return signal.Signals(signum).name
    except ValueError:
        return f"signal {signum}"


def describe_exit(code: int | None) -> str:
    if code is None:
        return "exited (status unknown)"
    if code < 0:
        return f"killed by {signal_name(-code)}"
    return f"exited with code {code}"
