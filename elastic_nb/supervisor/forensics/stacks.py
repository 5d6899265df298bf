"""Where was every rank? The stacks a diagnosis shows, from three places: a live rank dumps every
thread on `protocol.rank_probes.STACK_SIGNAL` (faulthandler, so it answers even inside a collective); a rank
that raised left its traceback in its failure record; a rank that finished left a done record.
`format_stacks` shows them trimmed to the cell's frames, as the alerts and the error do.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = [
    "Frame",
    "RankWhere",
    "cell_source",
    "format_stacks",
    "is_cell",
    "where_from_dump",
    "where_from_record",
]

# faulthandler:  File "/path/x.py", line 12 in func
_FH_FRAME = re.compile(r'^\s*File "(?P<file>.*)", line (?P<line>\d+) in (?P<func>.*)$')
# traceback:     File "/path/x.py", line 12, in func
_TB_FRAME = re.compile(r'^\s*File "(?P<file>.*)", line (?P<line>\d+), in (?P<func>.*)$')
_THREAD = re.compile(r"^(Current thread|Thread) 0x[0-9a-f]+")
_C10D = "distributed_c10d.py"
# Frames of the c10d API that are plumbing, not the collective the cell called.
_C10D_PLUMBING = {"wrapper", "_get_default_group", "_check_single_tensor"}
MAX_FRAMES = 12  # innermost frames shown per rank above the cell's own


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str


@dataclass
class RankWhere:
    """One rank at the moment of the diagnosis."""

    rank: int
    how: str  # live | raised | finished | exited | unknown
    frames: list[Frame] = field(default_factory=list)  # innermost first
    note: str | None = None  # exit description, D state, "no stack"
    dump: str | None = None  # the full dump's path
    name: str | None = None  # across machines: "node 1 (gpu-b) rank 3" (else "rank 3")

    @property
    def who(self) -> str:
        return self.name or f"rank {self.rank}"

    def collective(self) -> str | None:
        """The c10d function the rank is inside (or raised from), e.g. 'all_reduce'."""
        names = [f.func for f in self.frames if f.file.endswith(_C10D)]
        names = [n for n in names if n not in _C10D_PLUMBING]
        return names[-1] if names else None  # the outermost: what the user called

    def cell_frame(self, cell: str) -> Frame | None:
        return next((f for f in self.frames if is_cell(f.file, cell)), None)


def is_cell(file: str, cell: str) -> bool:
    """A frame's file is the cell: its path here, or on another machine the same run
    directory's name and file there (``<runs>/<job>/cell.py``: a node's run directories are
    its own, named as the notebook's)."""
    if file == cell:
        return True
    a, b = Path(file).parts[-2:], Path(cell).parts[-2:]
    return len(a) == 2 and a == b


def parse_faulthandler(text: str) -> list[list[Frame]]:
    """Every thread of one faulthandler dump, innermost frame first."""
    threads: list[list[Frame]] = []
    for line in text.splitlines():
        if _THREAD.match(line):
            threads.append([])
        elif (m := _FH_FRAME.match(line)) and threads:
            threads[-1].append(Frame(m["file"], int(m["line"]), m["func"].strip()))
    return threads


def parse_traceback(text: str) -> list[Frame]:
    """A Python traceback's frames, innermost first (tracebacks print outermost first)."""
    frames = [
        Frame(m["file"], int(m["line"]), m["func"].strip())
        for line in text.splitlines()
        if (m := _TB_FRAME.match(line))
    ]
    return frames[::-1]


def where_from_dump(rank: int, dump: str, cell: str, path: str) -> RankWhere:
    """The thread that runs the cell's body (else one in a function of the cell, a thread the
    cell started; else the main thread, which faulthandler dumps last: a session's rank between
    cells waits there for the next one, while its helper threads read sockets and probes) of a
    live rank's dump."""
    threads = parse_faulthandler(dump)
    if not threads:
        return RankWhere(rank, "unknown", note="its stack dump was empty", dump=path)
    body = [t for t in threads if any(is_cell(f.file, cell) and f.func == "<module>" for f in t)]
    in_cell = [t for t in threads if any(is_cell(f.file, cell) for f in t)]
    return RankWhere(rank, "live", (body or in_cell or threads[-1:])[0], dump=path)


def where_from_record(rank: int, record: dict[str, Any]) -> RankWhere:
    return RankWhere(rank, "raised", parse_traceback(record.get("traceback") or ""))


def place_words(w: RankWhere, cell: str, seq: int | None = None) -> str:
    """Where a rank is, in a chip's few words: 'waiting in all_reduce #5 · line 14' (`seq`: the
    number of the collective it waits in, where its flight recorder says), 'line 13',
    'finished the cell'."""
    if w.how == "finished":
        return "finished the cell"
    cf = w.cell_frame(cell)
    op = w.collective()
    number = f" #{seq}" if seq is not None else ""
    parts = [f"{'raised in' if w.how == 'raised' else 'waiting in'} {op}{number}"] if op else []
    if cf is not None:
        parts.append(f"line {cf.line}")
    return " · ".join(parts) or (w.note or w.how)


def format_stacks(where: dict[int, RankWhere], cell: str, cell_lines: list[str]) -> str:
    """Per rank: a headline with the cell line, then its innermost frames down to the cell."""
    out: list[str] = []
    for rank in sorted(where):
        w = where[rank]
        cf = w.cell_frame(cell)
        head = w.who
        op = w.collective()
        if w.how == "finished":
            head += " · finished the cell"
        elif w.how == "exited":
            head += f" · {w.note}"
        elif op:
            head += f" · {'raised in' if w.how == 'raised' else 'waiting in'} {op}"
        elif w.how == "raised":
            head += " · raised"
        if cf is not None:
            head += f" · cell line {cf.line}: {cell_source(cell_lines, cf.line)}"
        if w.note and w.how not in ("exited",):
            head += f" ({w.note})"
        out.append(head)
        for f in _trim(w.frames, cell):
            if is_cell(f.file, cell):
                out.append(f"    cell line {f.line} in {f.func}: {cell_source(cell_lines, f.line)}")
            else:
                out.append(f"    {Path(f.file).name}:{f.line} in {f.func}")
        if w.dump:
            out.append(f"    full dump: {w.dump}")
    return "\n".join(out)


def _trim(frames: list[Frame], cell: str) -> list[Frame]:
    """Innermost frames down to the outermost cell frame (what called the cell is ours): every
    cell frame, and at most MAX_FRAMES of the library frames above them."""
    last_cell = max((i for i, f in enumerate(frames) if is_cell(f.file, cell)), default=None)
    if last_cell is None:
        return frames[:MAX_FRAMES]
    kept, budget = [], MAX_FRAMES
    for f in frames[: last_cell + 1]:
        if is_cell(f.file, cell):
            kept.append(f)
        elif budget:
            kept.append(f)
            budget -= 1
    return kept


def cell_source(lines: list[str], lineno: int) -> str:
    """The cell's line `lineno`, stripped ('?' past its end)."""
    return lines[lineno - 1].strip() if 0 < lineno <= len(lines) else "?"
