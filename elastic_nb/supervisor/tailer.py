"""Tail every rank's log files and hand out bounded batches of lines.

Files are the truth for logs: ranks write them at the fd level and nothing here can slow a rank
down. Each poll reads what is new; each batch carries at most `max_lines` lines per stream (the
newest) and the count of lines it left out, so a rank printing 100,000 lines costs the kernel a
few messages, not 100,000. Progress bars (``\\r`` rewrites) collapse to their last state.

Two kinds of line are told apart on the way, whatever the batch keeps: lines carrying a *mark*
are handed out whole (`take_marked`: NCCL's watchdog announcing a timeout is evidence, and may
sit in a flood), and lines carrying *noise* (torch's own C++ logging) are not counted as a
rank's activity (`activity_total`: what --hang-after watches).
"""

from __future__ import annotations

import collections
import os
from dataclasses import dataclass, field
from pathlib import Path

from elastic_nb.protocol import LogBatch

__all__ = ["Batch", "LogTailer"]

_READ_CHUNK = 4 * 1024 * 1024
_MAX_PARTIAL = 64 * 1024  # a "line" without a newline longer than this is flushed as is


@dataclass
class Batch:
    """New output of one stream since the last batch."""

    attempt: int
    rank: int
    stream: str
    lines: list[str]
    skipped: int = 0
    progress: str | None = None  # the latest state of an unfinished \r-rewritten line

    def record(self) -> LogBatch:
        """As it travels to the kernel (protocol.LogBatch)."""
        return LogBatch(
            attempt=self.attempt,
            rank=self.rank,
            stream=self.stream,
            lines=self.lines,
            skipped=self.skipped,
            progress=self.progress,
        )


@dataclass
class _Stream:
    attempt: int
    rank: int
    stream: str
    path: Path
    max_lines: int
    marks: tuple[bytes, ...] = ()
    noise: tuple[bytes, ...] = ()
    fd: int | None = None
    partial: bytes = b""
    lines: collections.deque[str] = field(init=False)
    skipped: int = 0
    total: int = 0
    quiet: int = 0  # lines of noise among total
    marked: list[str] = field(default_factory=list)
    progress: str | None = None
    progress_sent: str | None = None

    def __post_init__(self) -> None:
        self.lines = collections.deque(maxlen=self.max_lines)

    def poll(self, final: bool = False) -> None:
        if self.fd is None:
            try:
                self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return
        while True:
            data = os.read(self.fd, _READ_CHUNK)
            if not data:
                break
            self._consume(self.partial + data)
        if final and self.partial:
            self._add([self.partial])
            self.partial = b""
            self.progress = None

    def _consume(self, data: bytes) -> None:
        *complete, partial = data.split(b"\n")
        self._add(complete)
        self.progress = None
        if b"\r" in partial:
            self.progress = _collapse(partial)
            if len(partial) > _MAX_PARTIAL:  # a bar rewritten 10,000 times: keep its last state
                partial = b"\r" + self.progress.encode()
        elif len(partial) > _MAX_PARTIAL:
            self._add([partial])
            partial = b""
        self.partial = partial

    def _add(self, raws: list[bytes]) -> None:
        if self.marks or self.noise:
            self._sort(raws)
        # Only the newest max_lines can survive to the next batch: decode just those.
        keep = raws[-self.max_lines :]
        self.total += len(raws)
        self.skipped += len(raws) - len(keep) + max(0, len(self.lines) + len(keep) - self.max_lines)
        self.lines.extend(_collapse(raw) for raw in keep)

    def _sort(self, raws: list[bytes]) -> None:
        for raw in raws:
            if any(m in raw for m in self.noise):
                self.quiet += 1
            if any(m in raw for m in self.marks):
                self.marked.append(_collapse(raw))

    def take(self) -> Batch | None:
        progress = self.progress if self.progress != self.progress_sent else None
        if not self.lines and not self.skipped and progress is None:
            return None
        batch = Batch(
            self.attempt, self.rank, self.stream, list(self.lines), self.skipped, progress
        )
        self.lines.clear()
        self.skipped = 0
        self.progress_sent = self.progress
        return batch

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _collapse(raw: bytes) -> str:
    """What a terminal would show: the text after the last carriage return."""
    raw = raw.rstrip(b"\r")
    if b"\r" in raw:
        segments = [s for s in raw.split(b"\r") if s]
        raw = segments[-1] if segments else b""
    return raw.decode("utf-8", errors="replace")


class LogTailer:
    def __init__(
        self, max_lines: int = 200, marks: tuple[bytes, ...] = (), noise: tuple[bytes, ...] = ()
    ) -> None:
        self._max_lines = max_lines
        self._marks = marks
        self._noise = noise
        self._streams: dict[tuple[int, int, str], _Stream] = {}

    def follow(self, attempt: int, rank: int, paths: dict[str, Path]) -> None:
        for stream, path in paths.items():
            key = (attempt, rank, stream)
            if key not in self._streams:
                self._streams[key] = _Stream(
                    attempt, rank, stream, path, self._max_lines, self._marks, self._noise
                )

    def poll(self, final: bool = False) -> None:
        for s in self._streams.values():
            s.poll(final)

    def take(self) -> list[Batch]:
        return [b for s in self._streams.values() if (b := s.take()) is not None]

    def take_marked(self) -> list[tuple[int, int, str, str]]:
        """Every marked line since the last call: (attempt, rank, stream, line)."""
        out = []
        for s in self._streams.values():
            out.extend((s.attempt, s.rank, s.stream, line) for line in s.marked)
            s.marked.clear()
        return out

    def lines_total(self) -> int:
        return sum(s.total for s in self._streams.values())

    def activity_total(self) -> int:
        """Lines the ranks wrote themselves: torch's own logging (noise) left out."""
        return sum(s.total - s.quiet for s in self._streams.values())

    def last_line(self, attempt: int, rank: int) -> str | None:
        s = self._streams.get((attempt, rank, "out"))
        return s.lines[-1] if s and s.lines else None

    def close(self) -> None:
        for s in self._streams.values():
            s.close()
