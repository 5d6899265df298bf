"""Where was every rank? Stacks, collectives, and the desync verdict built from them.

Stacks come from three places: a live rank dumps every thread on `protocol.STACK_SIGNAL`
(faulthandler, so it answers even inside a collective); a rank that raised left its traceback in
its failure record; a rank that finished left a done record. Collectives come from torch's flight
recorder, which each rank writes into the run directory when it ends (gloo records too).

The verdict is the one a user needs after a collective timed out or the job went silent: which
rank never reached the collective the others wait in.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__all__ = ["Frame", "RankWhere", "desync_verdict", "format_stacks", "where_from_dump"]

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

    def collective(self) -> str | None:
        """The c10d function the rank is inside (or raised from), e.g. 'all_reduce'."""
        names = [f.func for f in self.frames if f.file.endswith(_C10D)]
        names = [n for n in names if n not in _C10D_PLUMBING]
        return names[-1] if names else None  # the outermost: what the user called

    def cell_frame(self, cell: str) -> Frame | None:
        return next((f for f in self.frames if f.file == cell), None)


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
    """The thread that runs the cell (else the first one) of a live rank's dump."""
    threads = parse_faulthandler(dump)
    if not threads:
        return RankWhere(rank, "unknown", note="its stack dump was empty", dump=path)
    main = next((t for t in threads if any(f.file == cell for f in t)), threads[0])
    return RankWhere(rank, "live", main, dump=path)


def where_from_record(rank: int, record: dict[str, Any]) -> RankWhere:
    return RankWhere(rank, "raised", parse_traceback(record.get("traceback") or ""))


# ---- the verdict ----------------------------------------------------------------------------


@dataclass
class Desync:
    behind: list[int]  # ranks that never reached the collective the others waited in
    waiting: list[int]
    text: str


def desync_verdict(
    where: dict[int, RankWhere],
    cell: str,
    collectives: dict[int, list[list[Any]]] | None = None,
) -> Desync | None:
    """Compare the ranks: who waits in a collective, who is elsewhere, who ran fewer."""
    waiting = {r: w for r, w in where.items() if w.collective() is not None}
    if not waiting:
        return None
    # The collective most ranks wait in, at the cell line they wait at.
    groups: dict[tuple[str | None, int | None], list[int]] = {}
    for r, w in waiting.items():
        cf = w.cell_frame(cell)
        groups.setdefault((w.collective(), cf.line if cf else None), []).append(r)
    (op, line), waiters = max(groups.items(), key=lambda kv: (len(kv[1]), -min(kv[1])))
    at = f" (cell line {line})" if line else ""
    behind = sorted(r for r in where if r not in waiters)
    seq = _waited_seq(waiters, collectives or {})
    op_name = f"{op} #{seq}" if seq else op
    if not behind:
        return Desync(
            [],
            sorted(waiters),
            f"every rank was in {op_name}{at}: none was missing, so the collective itself "
            "stalled (a slow rank, the network or the driver)",
        )
    parts = []
    for r in behind:
        parts.append(f"rank {r} never entered {op_name}{at}: {_elsewhere(where[r], cell)}")
        ran = _ran(collectives or {}, r)
        if ran is not None and seq:
            parts[-1] += f" after {ran} collective{'s' if ran != 1 else ''}"
    waited = ", ".join(str(r) for r in sorted(waiters))
    text = "; ".join(parts) + f"; rank{'s' if len(waiters) > 1 else ''} {waited} waited in it"
    return Desync(behind, sorted(waiters), text)


def _elsewhere(w: RankWhere, cell: str) -> str:
    if w.how == "finished":
        return "it had finished the cell"
    if w.how == "exited":
        return f"it had {w.note}"
    cf = w.cell_frame(cell)
    if w.collective():
        return f"it was in {w.collective()}" + (f" at cell line {cf.line}" if cf else "")
    if cf is not None:
        inner = w.frames[0]
        what = f" in {inner.func}" if inner.func != "<module>" else ""
        return f"it was at cell line {cf.line}{what}"
    return w.note or "its position is unknown"


def _waited_seq(waiters: list[int], collectives: dict[int, list[list[Any]]]) -> int | None:
    """The sequence number of the collective the waiting ranks were in: their last entry."""
    seqs = {ops[-1][1] for r in waiters if (ops := collectives.get(r))}
    return seqs.pop() if len(seqs) == 1 else None


def _ran(collectives: dict[int, list[list[Any]]], rank: int) -> int | None:
    ops = collectives.get(rank)
    if ops is None:
        return None
    return max((op[1] or 0 for op in ops if op[0] == 0), default=0)


# ---- showing it -----------------------------------------------------------------------------


def format_stacks(where: dict[int, RankWhere], cell: str, cell_lines: list[str]) -> str:
    """Per rank: a headline with the cell line, then its innermost frames down to the cell."""
    out: list[str] = []
    for rank in sorted(where):
        w = where[rank]
        cf = w.cell_frame(cell)
        head = f"rank {rank}"
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
            head += f" · cell line {cf.line}: {_line(cell_lines, cf.line)}"
        if w.note and w.how not in ("exited",):
            head += f" ({w.note})"
        out.append(head)
        for f in _trim(w.frames, cell):
            if f.file == cell:
                out.append(f"    cell line {f.line} in {f.func}: {_line(cell_lines, f.line)}")
            else:
                out.append(f"    {Path(f.file).name}:{f.line} in {f.func}")
        if w.dump:
            out.append(f"    full dump: {w.dump}")
    return "\n".join(out)


def _trim(frames: list[Frame], cell: str) -> list[Frame]:
    """Innermost frames down to the outermost cell frame (what called the cell is ours): every
    cell frame, and at most MAX_FRAMES of the library frames above them."""
    last_cell = max((i for i, f in enumerate(frames) if f.file == cell), default=None)
    if last_cell is None:
        return frames[:MAX_FRAMES]
    kept, budget = [], MAX_FRAMES
    for f in frames[: last_cell + 1]:
        if f.file == cell:
            kept.append(f)
        elif budget:
            kept.append(f)
            budget -= 1
    return kept


def _line(lines: list[str], lineno: int) -> str:
    return lines[lineno - 1].strip() if 0 < lineno <= len(lines) else "?"
