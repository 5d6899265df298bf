"""Where was every rank? Stacks, collectives, and the desync verdict built from them.

Stacks come from three places: a live rank dumps every thread on `protocol.STACK_SIGNAL`
(faulthandler, so it answers even inside a collective); a rank that raised left its traceback in
its failure record; a rank that finished left a done record. Collectives come from torch's flight
recorder (`desync.History`): what a rank wrote when it ended, or answered to a probe.

The verdict is the one a user needs when the ranks stopped meeting: which rank left early, ran
another collective, or never reached the one the others wait in, and where each of them is.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_nb.supervisor.forensics.collectives import (
    DEFAULT_GROUP,
    NCCL,
    Finding,
    History,
    Op,
    base,
    find_certain,
)

__all__ = [
    "Desync",
    "Frame",
    "RankWhere",
    "desync_verdict",
    "format_stacks",
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
    """The thread that runs the cell's body (else one in a function of the cell, a thread the
    cell started; else the first one) of a live rank's dump."""
    threads = parse_faulthandler(dump)
    if not threads:
        return RankWhere(rank, "unknown", note="its stack dump was empty", dump=path)
    body = [t for t in threads if any(f.file == cell and f.func == "<module>" for f in t)]
    in_cell = [t for t in threads if any(f.file == cell for f in t)]
    return RankWhere(rank, "live", (body or in_cell or threads)[0], dump=path)


def where_from_record(rank: int, record: dict[str, Any]) -> RankWhere:
    return RankWhere(rank, "raised", parse_traceback(record.get("traceback") or ""))


# ---- the verdict ----------------------------------------------------------------------------


@dataclass
class Desync:
    behind: list[int]  # the culprits: ranks that left early, skipped or ran the odd collective
    waiting: list[int]
    text: str
    hint: str | None = None  # what to do, when the evidence says more than the cause class
    certain: bool = False  # the flight recorder proves it: it can never resolve by waiting
    notes: dict[int, str] = field(default_factory=dict)  # per culprit, a few words for its chip


_DDP_HINT = (
    "a rank ran fewer backward() passes than the others: with uneven inputs, wrap the loop in "
    "DDP's join() context manager or give every rank the same number of batches "
    "(DistributedSampler(drop_last=True)); a rank that skips a step (a caught OOM) must skip "
    "it on every rank together (all_reduce a flag first)"
)
_LEFT_HINT = (
    "a rank finished the cell while the others still ran collectives with it: every rank "
    "must run the same collectives (look for loops whose length differs by rank, and "
    "collectives under a rank-dependent if)"
)


def desync_verdict(
    where: dict[int, RankWhere],
    cell: str,
    cell_lines: list[str],
    histories: dict[int, History] | None = None,
) -> Desync | None:
    """Who is behind: from the flight recorder when it makes a desync certain (a rank left
    early, two ranks in different ops at the same number), else from the stacks: who waits in
    a collective, who is elsewhere."""
    histories = histories or {}
    finding = find_certain(histories)
    if finding is not None:
        return _describe_finding(finding, where, cell, cell_lines)
    return _from_stacks(where, cell, histories)


def _describe_finding(
    f: Finding, where: dict[int, RankWhere], cell: str, lines: list[str]
) -> Desync:
    of = f" of group {base(f.group)}" if base(f.group) != DEFAULT_GROUP else ""
    waits = _waits(f, where, cell, lines)
    notes = {}
    if f.kind == "left":
        parts = []
        for r in f.culprits:
            n = f.culprit_seqs[r]
            last = f.culprit_ops.get(r)
            name = f"{last.name} " if last else ""
            at = f", {_at(last.line, lines)}" if last and last.line else ""
            its = f" (its last: {name}#{n}{at})"
            notes[r] = f"left the cell after {n} collective{'s' if n != 1 else ''}{of}"
            parts.append(f"rank {r} {notes[r]}" + (its if n else ""))
        text = "; ".join(parts) + "; " + waits
        backward = any(_in_backward(w.op, where.get(w.rank)) for w in f.waiters)
        hint = _DDP_HINT if backward else _LEFT_HINT
    else:
        ref = f.waiters[0]
        ref_op = f"{ref.op.name if ref.op else 'a collective'} #{ref.seq}{of}"
        parts = []
        for r in f.culprits:
            op = f.culprit_ops[r]
            line = _line_of(op, where.get(r), cell)
            at = f" ({_at(line, lines)})" if line else ""
            parts.append(f"rank {r} never entered {ref_op}: it waits in {op.name} #{op.seq}{at}")
            notes[r] = f"in {op.name} #{op.seq}, not {ref_op}"
        text = "; ".join(parts) + "; " + waits
        hint = None
    return Desync(list(f.culprits), [w.rank for w in f.waiters], text, hint, True, notes)


def _waits(f: Finding, where: dict[int, RankWhere], cell: str, lines: list[str]) -> str:
    """'rank 0 waits in all_reduce #8 (cell line 16: loss.backward(): DDP's gradient
    all-reduce)', ranks that wait alike grouped."""
    of = f" of group {base(f.group)}" if base(f.group) != DEFAULT_GROUP else ""
    alike: dict[tuple[bool, str], list[int]] = {}
    for w in f.waiters:
        rw = where.get(w.rank)
        name = w.op.name if w.op else (rw.collective() if rw else None) or "a collective"
        line = _line_of(w.op, rw, cell)
        detail = [_at(line, lines)] if line else []
        if _in_backward(w.op, rw) and name == "all_reduce":
            detail.append("DDP's gradient all-reduce")
        what = f"{name} #{w.seq}{of}" + (f" ({': '.join(detail)})" if detail else "")
        timed_out = rw is not None and rw.how == "raised"
        alike.setdefault((timed_out, what), []).append(w.rank)
    out = []
    for (timed_out, what), ranks in alike.items():
        many = len(ranks) > 1
        who = f"ranks {', '.join(map(str, ranks))}" if many else f"rank {ranks[0]}"
        verb = "timed out in" if timed_out else "wait in" if many else "waits in"
        out.append(f"{who} {verb} {what}")
    return ", ".join(out)


def _line_of(op: Op | None, w: RankWhere | None, cell: str) -> int | None:
    if op is not None and op.line:
        return op.line
    cf = w.cell_frame(cell) if w is not None else None
    return cf.line if cf else None


def _in_backward(op: Op | None, w: RankWhere | None) -> bool:
    return bool(op and op.backward) or bool(
        w and any(fr.func in ("_engine_run_backward", "run_backward") for fr in w.frames)
    )


def _at(line: int, lines: list[str]) -> str:
    return f"cell line {line}: {_line(lines, line)}"


def _from_stacks(
    where: dict[int, RankWhere], cell: str, histories: dict[int, History]
) -> Desync | None:
    """No certainty: compare where the ranks are. A rank counts as waiting when its stack is
    inside a c10d collective or its flight recorder has one in flight (DDP's all-reduces are
    issued from C++, with no c10d frame on the stack)."""
    waiting: dict[int, str] = {}
    for r, w in where.items():
        h = histories.get(r)
        in_flight = h.waiting_in() if h is not None else None
        op = w.collective() or (in_flight.name if in_flight else None)
        if op is not None and w.how != "finished":
            waiting[r] = op
    if not waiting:
        return None
    # The collective most ranks wait in, at the cell line they wait at.
    groups: dict[tuple[str | None, int | None], list[int]] = {}
    for r, op in waiting.items():
        cf = where[r].cell_frame(cell)
        groups.setdefault((op, cf.line if cf else None), []).append(r)
    (op, line), waiters = max(groups.items(), key=lambda kv: (len(kv[1]), -min(kv[1])))
    at = f" (cell line {line})" if line else ""
    others = [r for r in where if r not in waiters]
    # Only a rank seen elsewhere is behind: one whose position is unknown (no stack, or a stack
    # taken outside the cell while it was raising) may as well have been on its way in.
    behind = sorted(r for r in others if _seen(where[r], cell))
    unseen = sorted(r for r in others if r not in behind)
    seq = _waited_seq(waiters, histories)
    op_name = f"{op} #{seq}" if seq else op
    if not behind and unseen:
        return Desync(
            [],
            sorted(waiters),
            f"rank{'s' if len(waiters) > 1 else ''} {', '.join(map(str, sorted(waiters)))} "
            f"waited in {op_name}{at}; where rank{'s' if len(unseen) > 1 else ''} "
            f"{', '.join(map(str, unseen))} {'were' if len(unseen) > 1 else 'was'} is unknown",
        )
    if not behind:
        return Desync(
            [],
            sorted(waiters),
            f"every rank was in {op_name}{at}: none was missing, so the collective itself "
            "stalled (a slow rank, the network or the driver)",
        )
    parts, notes = [], {}
    for r in behind:
        parts.append(f"rank {r} never entered {op_name}{at}: {_elsewhere(where[r], cell)}")
        notes[r] = f"never entered {op_name}"
        h = histories.get(r)
        if h is not None and h.left and h.known and seq:
            ran = max(h.last.get(DEFAULT_GROUP, 0), h.last.get(DEFAULT_GROUP + NCCL, 0))
            parts[-1] += f" after {ran} collective{'s' if ran != 1 else ''}"
    waited = ", ".join(str(r) for r in sorted(waiters))
    text = "; ".join(parts) + f"; rank{'s' if len(waiters) > 1 else ''} {waited} waited in it"
    return Desync(behind, sorted(waiters), text, notes=notes)


def _seen(w: RankWhere, cell: str) -> bool:
    """Where the rank is, known: it left the cell, or its stack or record is in the cell."""
    return w.how in ("finished", "exited") or w.cell_frame(cell) is not None


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


def _waited_seq(waiters: list[int], histories: dict[int, History]) -> int | None:
    """The number of the collective the waiting ranks were in: their last, if they agree."""
    seqs = set()
    for r in waiters:
        h = histories.get(r)
        if h is None or not h.known:
            continue
        op = h.waiting_in()
        seqs.add(op.seq if op else h.last.get(DEFAULT_GROUP, h.last.get(DEFAULT_GROUP + NCCL)))
    seqs.discard(None)
    return seqs.pop() if len(seqs) == 1 else None


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
