"""The desync verdict: which rank fell out of step with the others (left the cell early, ran
another collective, never reached the one the others wait in), and where each of them is, in the
words a user needs. From the flight recorders when they make it certain (`collectives`), else
from the stacks (`stacks`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from elastic_nb.supervisor.forensics.collectives import (
    DEFAULT_GROUP,
    NCCL,
    CertainDesync,
    History,
    Op,
    base,
    find_certain,
)
from elastic_nb.supervisor.forensics.stacks import RankWhere, cell_source

__all__ = ["Desync", "desync_verdict"]


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
    f: CertainDesync, where: dict[int, RankWhere], cell: str, lines: list[str]
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
            left = f"left the cell after {n} collective{'s' if n != 1 else ''}{of}"
            # The chip says what happened in the user's words: a count of collectives is the
            # wire's (a person counts steps), said in the finding with where the others wait.
            notes[r] = "left the cell early"
            parts.append(f"{_who(where, r)} {left}" + (its if n else ""))
        text = "; ".join(parts) + "; " + waits
        backward = any(_in_backward(w.op, where.get(w.rank)) for w in f.waiters)
        hint = _DDP_HINT if backward else _LEFT_HINT
    else:
        ref = f.waiters[0]
        ref_op = f"{ref.op.name if ref.op else 'a collective'} #{ref.seq}{of}"
        parts = []
        for r in f.culprits:
            op = f.culprit_ops[r]
            assert op is not None  # a mismatch is between ops seen in flight
            line = _line_of(op, where.get(r), cell)
            at = f" ({_at(line, lines)})" if line else ""
            parts.append(
                f"{_who(where, r)} never entered {ref_op}: it waits in {op.name} #{op.seq}{at}"
            )
            notes[r] = f"in {op.name} #{op.seq}, not {ref_op}"
        text = "; ".join(parts) + "; " + waits
        hint = None
    return Desync(list(f.culprits), [w.rank for w in f.waiters], text, hint, True, notes)


def _waits(f: CertainDesync, where: dict[int, RankWhere], cell: str, lines: list[str]) -> str:
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
        who = _all_who(where, ranks)
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
    return f"cell line {line}: {cell_source(lines, line)}"


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
        parts.append(f"{_who(where, r)} never entered {op_name}{at}: {_elsewhere(where[r], cell)}")
        notes[r] = f"never entered {op_name}"
        h = histories.get(r)
        if h is not None and h.left and h.known and seq:
            ran = max(h.last.get(DEFAULT_GROUP, 0), h.last.get(DEFAULT_GROUP + NCCL, 0))
            parts[-1] += f" after {ran} collective{'s' if ran != 1 else ''}"
    text = "; ".join(parts) + f"; {_all_who(where, sorted(waiters))} waited in it"
    return Desync(behind, sorted(waiters), text, notes=notes)


def _who(where: dict[int, RankWhere], r: int) -> str:
    """'rank 3', or across machines 'node 1 (gpu-b) rank 3'."""
    return where[r].who if r in where else f"rank {r}"


def _all_who(where: dict[int, RankWhere], ranks: list[int]) -> str:
    """'ranks 0, 2' (or 'rank 0'); across machines each rank with its node."""
    if any(where.get(r) and where[r].name for r in ranks):
        return ", ".join(_who(where, r) for r in ranks)
    return f"ranks {', '.join(map(str, ranks))}" if len(ranks) > 1 else f"rank {ranks[0]}"


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
