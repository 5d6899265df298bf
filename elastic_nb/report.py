"""The words elastic_nb uses to report a job: the one-line summary and the failure report.

Both renderers (text and widgets) and the exception a failed cell raises say the same thing, from
the summary the supervisor sends when a job ends.
"""

from __future__ import annotations

from typing import Any

__all__ = ["failure_headline", "failure_report", "summary_line"]

Summary = dict[str, Any]


def summary_line(s: Summary) -> str:
    restarts = f"restarts {s['restarts']}/{s['max_restarts']}"
    parts = [
        f"job {s['job']} {s['outcome']}",
        f"{s['world_size']} rank{'s' if s['world_size'] != 1 else ''}",
        restarts,
        f"{s['wall_s']:.1f} s",
        f"logs: {s['run_dir']}",
    ]
    return "[elastic_nb] " + " · ".join(parts)


def failure_headline(s: Summary) -> str:
    f = s.get("failure")
    if s["outcome"] == "timeout":
        return f"job {s['job']} ran past its deadline: {s['reason']}; every rank was stopped"
    if f is None:
        return f"job {s['job']} failed: {s['reason']}"
    first = "failed first" if s["world_size"] > 1 else "failed"
    return f"rank {f['rank']} {first}: {f['summary']}"


def failure_report(s: Summary) -> list[str]:
    """The lines under the headline: the root rank's traceback, then every other rank."""
    lines: list[str] = []
    f = s.get("failure")
    record = f.get("record") if f else None
    if record:
        lines.append("")
        lines.append(f"--- rank {f['rank']} (attempt {f['attempt']}) ---")
        lines.extend(_cell_traceback(record["traceback"], s["run_dir"]).rstrip("\n").splitlines())
    elif s.get("launcher_log_tail"):
        lines.append("")
        lines.append("--- launcher.log (last lines) ---")
        lines.extend(s["launcher_log_tail"].splitlines())
    others = s.get("others") or []
    if others:
        lines.append("")
        lines.append("--- the other ranks ---" if f else "--- ranks ---")
        for o in others:
            delay = (
                f" (+{o['delay']:.2f} s)" if o.get("delay") is not None and o["delay"] >= 0 else ""
            )
            lines.append(f"rank {o['rank']}: {o['text']}{delay}")
    return lines


def _cell_traceback(text: str, run_dir: str) -> str:
    """Show the cell's frames as the cell, not as the file the ranks ran."""
    return text.replace(f'File "{run_dir}/cell.py", line ', "%%elastic cell, line ")
