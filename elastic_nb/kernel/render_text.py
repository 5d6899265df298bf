"""The text renderer: rank-prefixed lines, alerts and a one-line summary, on stdout/stderr.

It serves every frontend without widgets (terminal IPython, nbconvert/nbclient, CI) and is what
a saved notebook keeps. Lines arrive in batches (the supervisor bounds them: lines per update,
characters per line); a batch that left lines out says how many and where the full log is. A cell
prints at most `MAX_CELL_CHARS` characters of rank output, then says once that it stops and
where the logs are; alerts and the summary line are still printed.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Literal, TextIO

from elastic_nb.common import report
from elastic_nb.common.protocol import Summary

__all__ = ["MAX_CELL_CHARS", "TextRenderer"]

# An unfinished progress bar is re-printed at most this often per rank and stream.
PROGRESS_EVERY_S = 5.0
# Characters of rank output one cell prints; the run directory's logs keep everything.
MAX_CELL_CHARS = 500_000


class TextRenderer:
    """``mode``: "live" writes everything as it comes (the renderer of frontends without
    widgets); "quiet" leaves the rank lines out (a background job's stay in the run directory,
    for job.logs(), instead of landing among whatever the notebook does next); "summary" writes
    only the summary line, at the end: under a dashboard, which shows everything else once and
    whose display carries the start line as its text for readers without widgets (a saved
    notebook on GitHub or nbviewer, nbconvert), the summary is the one line a saved notebook
    needs besides them."""

    def __init__(
        self,
        job_id: str,
        run_dir: str,
        out: TextIO | None = None,
        err: TextIO | None = None,
        *,
        mode: Literal["live", "quiet", "summary"] = "live",
    ) -> None:
        self._mode = mode
        self._job = job_id
        self._run_dir = run_dir
        self._out = out or sys.stdout
        self._err = err or sys.stderr
        self._progress_at: dict[tuple[int, str], float] = {}
        self._left = MAX_CELL_CHARS  # of rank output this cell may still print
        self._where: dict[int, str] = {}  # a multi-node job's ranks: rank -> its node
        self._rounds_said = 0  # rounds whose line was printed

    def start(
        self,
        nproc: int,
        worst_case_s: float | None = None,
        session: str | None = None,
        nodes: tuple[int, int] = (1, 1),
    ) -> None:
        if self._mode == "summary":
            return
        self._out.write(report.start_line(self._job, nproc, worst_case_s, session, nodes) + "\n")
        self._out.flush()

    def update(self, msg: dict[str, Any]) -> None:
        if self._mode == "summary":
            return
        for rank, chip in msg.get("ranks", {}).items():
            if chip.get("node"):
                self._where[int(rank)] = chip["node"]
        for entry in msg.get("rounds", ())[self._rounds_said :]:
            if entry["running_s"] is None:
                break  # said once every rank of it runs (its ranks' nodes are known then)
            ranks = {r: n for r, n in self._where.items() if n in entry["nodes"]}
            self._out.write(report.round_line(entry, ranks) + "\n")
            self._rounds_said += 1
        for alert in msg.get("alerts", ()):
            if alert["kind"] == "failure":
                continue  # the error the cell raises says it, traceback and all
            stream = self._err if alert["severity"] == "error" else self._out
            stream.write(f"[elastic_nb] {alert['title']}\n")
            if alert.get("text"):
                stream.write(alert["text"].rstrip("\n") + "\n")
        for batch in msg.get("logs", ()) if self._mode == "live" else ():
            attempt, rank, name = batch["attempt"], batch["rank"], batch["stream"]
            lines, skipped, progress = batch["lines"], batch["skipped"], batch["progress"]
            stream = self._out if name == "out" else self._err
            prefix = f"[rank {rank}] "
            text = []
            if skipped:
                log = f"{self._run_dir}/attempt-{attempt}/rank-{rank}.{name}"
                text.append(f"{prefix}... {skipped:,} lines not shown (full log: {log})\n")
            text.extend(f"{prefix}{line}\n" for line in lines)
            if progress is not None:
                now = time.monotonic()
                if now - self._progress_at.get((rank, name), -PROGRESS_EVERY_S) >= PROGRESS_EVERY_S:
                    self._progress_at[(rank, name)] = now
                    text.append(f"{prefix}{progress}\n")
            self._write(stream, "".join(text), attempt)
        # After the lines of the same update: the ranks printed those first.
        for saved in msg.get("checkpoints", ()) if self._mode == "live" else ():
            self._out.write(f"[elastic_nb] checkpoint saved: {report.checkpoint_words(saved)}\n")
        self._out.flush()
        self._err.flush()

    def _write(self, stream: TextIO, text: str, attempt: int) -> None:
        """Rank output, while the cell's allowance lasts; then one line saying it stopped."""
        if self._left <= 0 or not text:
            return
        if len(text) > self._left:
            cut = text.rfind("\n", 0, self._left) + 1  # whole lines only
            text = text[:cut] + (
                f"[elastic_nb] {MAX_CELL_CHARS:,} characters of rank output shown: the rest is "
                f"not printed (full logs: {self._run_dir}/attempt-{attempt}/)\n"
            )
            self._left = 0
        else:
            self._left -= len(text)
        stream.write(text)

    def flush(self) -> None:
        """Lines are written as they come (IOPub batches them)."""

    def end(self, summary: Summary) -> None:
        peaks = report.peaks_line(summary) if self._mode == "live" else None
        if peaks:
            self._out.write(peaks + "\n")
        self._out.write(report.summary_line(summary) + "\n")
        self._out.flush()
