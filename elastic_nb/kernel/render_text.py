"""The text renderer: rank-prefixed lines, alerts and a one-line summary, on stdout/stderr.

It serves every frontend without widgets (terminal IPython, nbconvert/nbclient, CI) and is what
a saved notebook keeps. Lines arrive in batches (the supervisor bounds them: lines per update,
characters per line); a batch that left lines out says how many and where the full log is. A cell
prints at most `MAX_CELL_CHARS` characters of rank output, then says once that it stops and
where the logs are; alerts and the summary line are still printed.

While a job runs, a line of its ranks' memory (what the supervisor samples each second): the
first once the job has run MEMORY_EVERY_S, then at most once every MEMORY_EVERY_S and only when a
figure moved by MEMORY_MOVE (a tenth) since the line printed last: a job that holds steady
prints one, a job that grows one a minute, a job of seconds none (its peak line at the end says
it all). A background job's stay out, as its rank lines do.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Literal, TextIO

from elastic_nb.common import report
from elastic_nb.protocol.records import Summary

__all__ = ["MAX_CELL_CHARS", "TextRenderer"]

# An unfinished progress bar is re-printed at most this often per rank and stream.
PROGRESS_EVERY_S = 5.0
# Characters of rank output one cell prints; the run directory's logs keep everything.
MAX_CELL_CHARS = 500_000
# The memory line: at most this often, and only when a figure moved this much since the last.
MEMORY_EVERY_S = 60.0
MEMORY_MOVE = 0.10


class TextRenderer:
    """``mode``: "live" writes everything as it comes (the renderer of frontends without
    widgets); "quiet" leaves the rank lines out (a background job's stay in the run directory,
    for job.logs(), instead of landing among whatever the notebook does next); "summary" writes
    only the summary line, at the end: under a dashboard, which shows everything else once and
    whose display carries the start line as its text for readers without widgets (a saved
    notebook on GitHub or nbviewer, nbconvert), the summary is the one line a saved notebook
    needs besides them."""

    live_beside_input = False  # a line printed under an input box lands in what is typed

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
        self._paused: dict[int, str | None] = {}  # ranks at a prompt: the words said of it
        self._waiting: dict[int, str | None] = {}  # ranks waiting for a paused one: said so
        # The timeline, printed at the end of a job that restarted or ran across machines: each
        # attempt's start (wall clock), nodes and world size, and why it ended.
        self._attempts: list[dict[str, Any]] = [{"attempt": 0, "t": time.time()}]
        self._multi_node = False
        self._memory: dict[int, tuple[int | None, ...]] = {}  # each rank's latest figures
        self._memory_attempt = -1
        self._memory_shown: dict[int, tuple[int | None, ...]] | None = None  # as the last line said
        self._memory_at: float | None = None  # when the memory line's clock started

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

    def _pause_line(self, rank: int, chip: dict[str, Any]) -> None:
        """A line when a rank stops at a prompt (a debugger's, an input()) and when it goes on:
        not one a pdb command (its next prompt comes before the chip could say it ran). A line
        when a rank begins to wait for a paused one in a collective, with its timeout's end."""
        if chip.get("state") == "waiting":
            if self._waiting.get(rank) != chip.get("label"):
                self._waiting[rank] = chip.get("label")
                expires = chip.get("expires")
                left = time.time() if expires is None else float(expires)
                words = f": its timeout runs out in {report.duration(left - time.time())}"
                said = words if expires is not None else ""
                self._out.write(f"[elastic_nb] rank {rank} {chip.get('label')}{said}\n")
            return
        self._waiting.pop(rank, None)
        paused = chip.get("state") == "paused"
        if paused and self._paused.get(rank) != chip.get("label"):
            self._out.write(f"[elastic_nb] rank {rank} {chip.get('label')}\n")
        elif chip.get("state") in ("running", "done") and rank in self._paused:  # it went on
            self._out.write(f"[elastic_nb] rank {rank} resumed\n")
        if paused:
            self._paused[rank] = chip.get("label")
        else:
            self._paused.pop(rank, None)

    def update(self, msg: dict[str, Any]) -> None:
        if self._mode == "summary":
            return
        for rank, chip in msg.get("ranks", {}).items():
            if chip.get("node"):
                self._where[int(rank)] = chip["node"]
            self._pause_line(int(rank), chip)
        self._follow_attempts(msg)
        for entry in msg.get("rounds", ())[self._rounds_said :]:
            if entry["running_s"] is None:
                break  # said once every rank of it runs (its ranks' nodes are known then)
            ranks = {
                r: n
                for r, n in self._where.items()
                if r < entry["world_size"] and n in entry["nodes"]  # not an earlier round's
            }
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
        if msg.get("memory") and self._mode == "live":
            self._memory_line(msg["memory"])
        self._out.flush()
        self._err.flush()

    def _follow_attempts(self, msg: dict[str, Any]) -> None:
        """Each attempt's start, and across machines its round (whose beginning says why the
        one before it ended, in a few words). One machine's attempts end in a restart, whose
        alert said why as it happened."""
        for entry in msg.get("rounds", ()):
            self._multi_node = True
            self._attempt(entry["attempt"], entry["started"]).update(
                nodes=entry["nodes"], world_size=entry["world_size"]
            )
            if entry["attempt"]:
                self._attempts[entry["attempt"] - 1]["why"] = entry["why"]
        if msg.get("attempt") is not None:
            self._attempt(msg["attempt"], time.time())
        for alert in msg.get("alerts", ()):
            if alert.get("ends") is not None and not self._multi_node:
                self._attempt(alert["ends"], time.time())["why"] = "restarted (said above)"

    def _attempt(self, attempt: int, t: float) -> dict[str, Any]:
        while len(self._attempts) <= attempt:
            self._attempts.append({"attempt": len(self._attempts), "t": t})
        return self._attempts[attempt]

    def _memory_line(self, samples: list[dict[str, Any]]) -> None:
        """Take the samples in; say the ranks' memory if it is time and it moved."""
        for s in samples:
            if s["attempt"] > self._memory_attempt:  # a restart: its ranks start afresh
                self._memory_attempt, self._memory = s["attempt"], {}
            if s["rss"] is None and s["gpu"] is None and s["cuda"] is None:
                continue  # an exiting rank's last look: no figure, keep its last
            if s["attempt"] == self._memory_attempt:
                gpu, cuda = s["gpu"], s["cuda"]
                self._memory[s["rank"]] = (
                    s["rss"],
                    gpu["process"] if gpu else None,
                    gpu["index"] if gpu else None,
                    cuda["allocated"] if cuda else None,
                )
        now = time.monotonic()
        if self._memory_at is None:
            self._memory_at = now
        if now - self._memory_at < MEMORY_EVERY_S or not _moved(self._memory_shown, self._memory):
            return
        self._memory_at, self._memory_shown = now, dict(self._memory)
        parts = [
            f"rank {rank} {report.memory_figures(*figures)}"
            for rank, figures in sorted(self._memory.items())
        ]
        self._out.write("[elastic_nb] memory: " + " · ".join(parts) + "\n")

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

    def flush(self, now: bool = False) -> None:
        """Lines are written as they come (IOPub batches them)."""

    def end(self, summary: Summary) -> None:
        peaks = report.peaks_line(summary) if self._mode == "live" else None
        if peaks:
            self._out.write(peaks + "\n")
        if self._mode == "live" and (len(self._attempts) > 1 or self._multi_node):
            started = summary["started"] or self._attempts[0]["t"]
            attempts = [{**a, "started": max(0.0, a["t"] - started)} for a in self._attempts]
            attempts[0]["started"] = 0.0  # the last attempt's end is the summary's to say
            self._out.write("\n".join(report.timeline_lines(attempts, summary["wall_s"])) + "\n")
        self._out.write(report.summary_line(summary) + "\n")
        self._out.flush()


def _moved(
    before: dict[int, tuple[int | None, ...]] | None, now: dict[int, tuple[int | None, ...]]
) -> bool:
    """Whether a figure moved by MEMORY_MOVE since `before` (nothing said yet: it did), or a
    rank came or went."""
    if before is None or before.keys() != now.keys():
        return True
    for rank, figures in now.items():
        for old, new in zip(before[rank], figures, strict=True):
            if old is None or new is None:
                if old != new:
                    return True
            elif abs(new - old) >= MEMORY_MOVE * max(old, 1):
                return True
    return False
