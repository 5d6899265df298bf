"""Tail every rank's log files and hand out bounded batches of lines.

Files are the truth for logs: ranks write them at the fd level and nothing here can slow a rank
down. Each poll reads what is new; each batch carries at most `max_lines` lines per stream (the
newest) and the count of lines it left out, so a rank printing 100,000 lines costs the kernel a
few messages, not 100,000. Progress bars (``\\r`` rewrites) collapse to their last state. Each
line is cut at `max_chars` characters (a tensor printed whole, a JSON blob: one 5 MB line), its
first characters kept and the rest counted: "… N characters not shown (full log: PATH)". What is
held of an unfinished line is bounded the same way, so memory does not grow with a line's length;
an unfinished line without ``\\r`` shows when it ends (or when the job does).

Two kinds of line are told apart on the way, whatever the batch keeps: lines carrying a *mark*
are handed out whole (`take_marked`: NCCL's watchdog announcing a timeout is evidence, and may
sit in a flood), and lines carrying *noise* (torch's own C++ logging) are not counted as a
rank's activity (`activity_total`: what --hang-after watches).
"""

from __future__ import annotations

import collections
import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from elastic_nb.protocol.records import LogBatch

__all__ = ["MAX_LINE_CHARS", "Batch", "LogTailer"]

_READ_CHUNK = 4 * 1024 * 1024
_POLL_READ = 16 * 1024 * 1024
MAX_LINE_CHARS = 4000  # characters of one line handed out; the log file has the rest
_CONTINUATION = bytes(range(0x80, 0xC0))  # UTF-8 bytes that do not start a character


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
        """As it travels to the kernel (protocol.records.LogBatch)."""
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
    max_chars: int = MAX_LINE_CHARS
    marks: tuple[bytes, ...] = ()
    noise: tuple[bytes, ...] = ()
    fd: int | None = None
    partial: bytes = b""  # the unfinished line: what a terminal shows of it, at most max_chars
    cut: int = 0  # characters of the unfinished line left out of partial
    cr: bool = False  # the unfinished line's last byte was a \r
    lines: collections.deque[str] = field(init=False)
    skipped: int = 0
    total: int = 0
    quiet: int = 0  # lines of noise among total
    active_at: float | None = None  # when it last took a line the rank wrote itself (monotonic)
    marked: list[str] = field(default_factory=list)
    progress: str | None = None
    progress_sent: str | None = None
    read: int = 0  # bytes of the file read so far

    def __post_init__(self) -> None:
        self.lines = collections.deque(maxlen=self.max_lines)

    def poll(self, final: bool = False) -> None:
        if self.fd is None:
            try:
                self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return
        # At most _POLL_READ a poll but the last: a log that grew by gigabytes (a rank printing
        # in a loop, a node's file) is read over many polls, never in one stall of the loop.
        for _ in range(_POLL_READ // _READ_CHUNK if not final else sys.maxsize):
            data = os.read(self.fd, _READ_CHUNK)
            if not data:
                break
            self.read += len(data)
            self._consume(data)
        if final and (self.partial or self.cut):
            self._add([self.partial], self.cut)
            self.partial, self.cut, self.cr = b"", 0, False
            self.progress = None

    def _consume(self, data: bytes) -> None:
        *complete, rest = data.split(b"\n")
        if complete:
            self._pend(complete[0])  # the end of the unfinished line
            first, cut = self.partial, self.cut
            self.partial, self.cut, self.cr = b"", 0, False
            self._add([first, *complete[1:]], cut)
        self._pend(rest)
        self.progress = self._render(self.partial, self.cut) if b"\r" in self.partial else None

    def _pend(self, data: bytes) -> None:
        """Add bytes without a newline to the unfinished line, keeping what a terminal would show
        (the text after the last \\r, a bar rewritten 200,000 times: its last state) and of that
        the first max_chars characters, counting the rest."""
        if not data:
            return
        body = data.rstrip(b"\r")
        restart = body.rfind(b"\r") + 1
        if restart == 0 and not (body and self.cr):
            restart = -1  # no \r followed by text: the shown text goes on
        self.cr = data.endswith(b"\r")
        if restart >= 0:
            self.partial, self.cut = b"\r" + data[restart:], 0
        elif self.cut:
            self.cut += _chars(body)  # a \r here ends data: it shows nothing
            return
        else:
            self.partial += data
        if len(self.partial) > self.max_chars + 1:
            lead = b"\r" if self.partial.startswith(b"\r") else b""
            shown = self.partial[len(lead) :].rstrip(b"\r")
            n = _chars(shown)
            if n > self.max_chars:
                head = shown.decode("utf-8", errors="replace")[: self.max_chars]
                self.partial, self.cut = lead + head.encode(), n - self.max_chars

    def _add(self, raws: list[bytes], cut: int = 0) -> None:
        """Finished lines; `cut`: characters already left out of the first."""
        quiet = self.quiet
        if self.marks or self.noise:
            self._sort(raws)
        if len(raws) > self.quiet - quiet:
            self.active_at = time.monotonic()
        # Only the newest max_lines can survive to the next batch: decode just those.
        keep = raws[-self.max_lines :]
        self.total += len(raws)
        self.skipped += len(raws) - len(keep) + max(0, len(self.lines) + len(keep) - self.max_lines)
        first = len(raws) - len(keep)  # keep[0]'s index in raws
        self.lines.extend(
            self._render(raw, cut if first + i == 0 else 0) for i, raw in enumerate(keep)
        )

    def _render(self, raw: bytes, cut: int = 0) -> str:
        """A line as handed out: what a terminal shows, cut at max_chars characters."""
        shown = _shown(raw)
        head = shown[: 4 * self.max_chars + 4]  # decode no more than can be kept
        text = head.decode("utf-8", errors="replace")
        cut += _chars(shown[len(head) :]) + max(0, len(text) - self.max_chars)
        if not cut:
            return text
        return f"{text[: self.max_chars]}… {cut:,} characters not shown (full log: {self.path})"

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


def _shown(raw: bytes) -> bytes:
    """What a terminal would show: the text after the last carriage return."""
    raw = raw.rstrip(b"\r")
    return raw[raw.rfind(b"\r") + 1 :]


def _collapse(raw: bytes) -> str:
    return _shown(raw).decode("utf-8", errors="replace")


def _chars(raw: bytes) -> int:
    """Characters in UTF-8 bytes, without decoding them (a character split across reads counts
    once)."""
    return len(raw.translate(None, _CONTINUATION))


class LogTailer:
    def __init__(
        self,
        max_lines: int = 200,
        marks: tuple[bytes, ...] = (),
        noise: tuple[bytes, ...] = (),
        max_chars: int = MAX_LINE_CHARS,
    ) -> None:
        self._max_lines = max_lines
        self._max_chars = max_chars
        self._marks = marks
        self._noise = noise
        self._streams: dict[tuple[int, int, str], _Stream] = {}

    def follow(self, attempt: int, rank: int, paths: dict[str, Path]) -> None:
        for stream, path in paths.items():
            key = (attempt, rank, stream)
            if key not in self._streams:
                self._streams[key] = _Stream(
                    attempt,
                    rank,
                    stream,
                    path,
                    self._max_lines,
                    self._max_chars,
                    self._marks,
                    self._noise,
                )

    def poll(self, final: bool = False) -> None:
        for s in self._streams.values():
            s.poll(final)

    def take(self) -> list[Batch]:
        return [b for s in self._streams.values() if (b := s.take()) is not None]

    def take_marked(self) -> list[tuple[int, int, str, str]]:
        """Every marked line since the last call: (attempt, rank, stream, line)."""
        out: list[tuple[int, int, str, str]] = []
        for s in self._streams.values():
            out.extend((s.attempt, s.rank, s.stream, line) for line in s.marked)
            s.marked.clear()
        return out

    def lines_total(self) -> int:
        return sum(s.total for s in self._streams.values())

    def activity_total(self) -> int:
        """Lines the ranks wrote themselves: torch's own logging (noise) left out."""
        return sum(s.total - s.quiet for s in self._streams.values())

    def silent_for(self, attempt: int, rank: int) -> float | None:
        """Seconds since the rank last wrote a line of its own (None: none yet)."""
        times = [
            s.active_at
            for stream in ("out", "err")
            if (s := self._streams.get((attempt, rank, stream))) and s.active_at is not None
        ]
        return time.monotonic() - max(times) if times else None

    def read_to(self, attempt: int, rank: int, offsets: dict[str, int]) -> bool:
        """Whether the rank's streams have been read up to these byte offsets ("out", "err":
        what it had written when it asked for input, shown before its prompt)."""
        for stream, offset in offsets.items():
            s = self._streams.get((attempt, rank, stream))
            if offset and (s is None or s.read < offset):
                return False
        return True

    def last_line(self, attempt: int, rank: int) -> str | None:
        s = self._streams.get((attempt, rank, "out"))
        return s.lines[-1] if s and s.lines else None

    def close(self) -> None:
        for s in self._streams.values():
            s.close()
