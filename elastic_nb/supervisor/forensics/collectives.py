"""Desync from the flight recorder: which rank ran fewer collectives, or other ones, than the rest.

Every rank's history comes through one parser (`history`), whatever wrote it: the record a rank
leaves when it ends (``rank-R.collectives.json``), a live rank's answer to a probe
(``rank-R.probe.json``), both written by `elastic_nb.rank.recorder` in torch's dump format, and the
dump NCCL itself writes on a collective timeout (``fr-rank-R``, pickled, the same format).

torch keeps two flight recorders, the CPU one (gloo) and NCCL's, and each backend numbers its
own collectives: a process group with both (``cpu:gloo,cuda:nccl``) has two sequences under one
name. NCCL's are kept apart as ``<name>@nccl``.

Collectives of a process group are numbered per group, in the order each rank issues them
(``collective_seq_id``); a correct program issues the same op as number N on every member. Two
situations can then never resolve, whatever the collective timeout says (`find_certain`):

* **left**: rank L finished the cell after its last collective #a of group G, and another member
  has issued #s > a in G: #s needs L, and L will never come;
* **mismatch**: two members wait at the same #s of G in different ops (rank 1 skipped an
  all_reduce and now sits in a barrier that rank 0's all_reduce will never match).

A slow rank is neither: it has left nothing and waits in nothing, so the others' wait is not yet
a desync (it may still arrive).
"""

from __future__ import annotations

import io
import json
import pickle
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from elastic_nb.common.rundir import RunDir
from elastic_nb.supervisor.forensics.stacks import is_cell

__all__ = [
    "CertainDesync",
    "History",
    "Op",
    "base",
    "find_certain",
    "history",
    "read_nccl_dump",
    "stalled",
]

DEFAULT_GROUP = "0"  # c10d names groups by a counter shared by every rank: the default is "0"
NCCL = "@nccl"  # suffix of a group's NCCL sequence
# Frames of autograd's engine: a collective issued from there is DDP's gradient all-reduce.
_BACKWARD = {"_engine_run_backward", "run_backward"}


@dataclass(frozen=True)
class Op:
    group: str
    seq: int  # its number among the collectives of its group
    name: str  # "all_reduce" (the backend's "gloo:" or "nccl:" dropped)
    done: bool  # retired (gloo) or completed (NCCL): nothing waits in it any more
    line: int | None = None  # the cell line that issued it, when the dump has frames
    backward: bool = False  # issued from autograd's backward(): DDP's gradient all-reduce
    # The seconds its timeout had left when the rank's record was taken (created + its group's
    # timeout, both on the rank's clock): a probe's answer only.
    timeout_left: float | None = field(default=None, compare=False)


@dataclass
class History:
    """One rank's collectives, as far as its flight recorder still holds them."""

    rank: int
    last: dict[str, int] = field(default_factory=dict)  # group -> its last collective issued
    ops: dict[tuple[str, int], Op] = field(default_factory=dict)  # the ring buffer's entries
    members: dict[str, list[int]] = field(default_factory=dict)  # its groups and their ranks
    left: bool = False  # it finished the cell: no collective will ever come from it again
    final: bool = False  # the rank has ended (finished or raised): this is its last word
    known: bool = False  # its recorder could be read (else `last` says nothing)

    def member_of(self, group: str) -> bool:
        return group in self.members or group in self.last or base(group) == DEFAULT_GROUP

    def in_flight(self, group: str) -> Op | None:
        """The collective of `group` this rank waits in: its oldest one not yet done. NCCL's
        CPU side runs ahead of the GPU, so later ones may be queued behind it."""
        pending = [op for (g, _), op in self.ops.items() if g == group and not op.done]
        return min(pending, key=lambda op: op.seq, default=None)

    def waiting_in(self) -> Op | None:
        """The collective this rank waits in, whichever of its groups it is in."""
        return next((op for g in self.last if (op := self.in_flight(g)) is not None), None)

    def absorb(self, other: History) -> None:
        """Add another dump of the same rank (NCCL's own, beside the record the rank wrote)."""
        self.known = self.known or other.known
        for group, seq in other.last.items():
            self.last[group] = max(self.last.get(group, 0), seq)
        for key, op in other.ops.items():
            self.ops.setdefault(key, op)
        for group, ranks in other.members.items():
            self.members.setdefault(group, ranks)


def history(rank: int, record: dict[str, Any] | None, cell: str, left: bool = False) -> History:
    """Parse what `elastic_nb.rank.recorder` wrote (or `read_nccl_dump` read) for one rank."""
    record = record or {}
    h = History(rank, left=left, final=bool(record.get("final")))
    taken = record.get("time")
    for key in ("dump", "nccl"):
        dump = record.get(key)
        if isinstance(dump, dict):
            h.known = True
            _parse(h, dump, cell, key, taken if isinstance(taken, (int, float)) else None)
    seqs = record.get("seqs")
    if isinstance(seqs, dict) and seqs:  # none: no group yet, or a torch that cannot say
        h.known = True
        for group, seq in seqs.items():
            if (n := _int(seq)) is not None and n > 0:
                h.last[str(group)] = max(h.last.get(str(group), 0), n)
    h.members.update({str(g): list(r) for g, r in (record.get("groups") or {}).items()})
    return h


def _parse(h: History, dump: dict[str, Any], cell: str, key: str, taken: float | None) -> None:
    entries = [e for e in dump.get("entries") or () if isinstance(e, dict)]
    names = [str(e.get("profiling_name") or "") for e in entries]
    # A dump is NCCL's by its entries' names ("nccl:all_reduce"); an empty one by where it came.
    nccl = any(n.startswith("nccl:") for n in names) if names else key == "nccl"
    suffix = NCCL if nccl else ""
    # Not pg_status: torch keys it by a per-process backend counter, not by the group's name
    # (a rank outside a group never creates its backend, so the same key names other groups
    # on other ranks), and NCCL's counts point-to-point ops in it too.
    for e in entries:
        if e.get("is_p2p"):
            continue  # point-to-point ops count apart (p2p_seq_id) and pair up by peer
        pg = e.get("process_group") or ()
        seq = _int(e.get("collective_seq_id"))
        if not pg or seq is None:
            continue
        frames = e.get("frames") or []
        op = Op(
            group=f"{pg[0]}{suffix}",
            seq=seq,
            name=str(e.get("profiling_name") or "?").split(":", 1)[-1],
            done=bool(e.get("retired")) or e.get("state") == "completed",
            line=next(
                (int(f["line"]) for f in frames if is_cell(str(f.get("filename")), cell)), None
            ),
            backward=any(f.get("name") in _BACKWARD for f in frames),
            timeout_left=_timeout_left(e, taken),
        )
        h.ops[(op.group, seq)] = op
        h.last[op.group] = max(h.last.get(op.group, 0), seq)
    for group, config in (dump.get("pg_config") or {}).items():
        ranks = _ranks(config.get("ranks"))
        if group and ranks:  # gloo's config is keyed "" and lists no ranks: useless
            h.members[f"{group}{suffix}"] = ranks


def _timeout_left(entry: dict[str, Any], taken: float | None) -> float | None:
    created, timeout = _int(entry.get("time_created_ns")), _int(entry.get("timeout_ms"))
    if taken is None or not created or not timeout:
        return None
    return created / 1e9 + timeout / 1e3 - taken


def base(group: str) -> str:
    """The process group's own name, without the backend's suffix."""
    return group.removesuffix(NCCL)


def read_nccl_dump(rd: RunDir, path: Path) -> dict[str, Any] | None:
    """NCCL's own dump on a timeout (TORCH_FR_DUMP_TEMP_FILE<rank>), as a record: only what
    `RunDir.read_private` lets through (ours, nobody else's to write), and read as plain data
    (`_PlainData`): a joined machine mirrors its ranks' dumps into the run directory, and one
    that forged a pickle must not run code in the supervisor."""
    try:
        dump = _PlainData(io.BytesIO(rd.read_private(path))).load()
    except (OSError, pickle.UnpicklingError, EOFError, ValueError, IndexError, KeyError):
        return None
    return {"nccl": dump} if isinstance(dump, dict) else None


class _PlainData(pickle.Unpickler):
    """A flight-recorder dump holds dicts, lists, tuples, strings, numbers, booleans and None:
    torch's JIT pickler (c10d's FlightRecorder::dump) writes no global, so refusing every one
    reads torch's dumps whole while a forged one cannot name a callable, the only way a pickle
    runs code (tests/test_desync.py checks both on torch's own dumps)."""

    def find_class(self, module: str, name: str) -> Any:
        raise pickle.UnpicklingError(f"not plain data: {module}.{name}")


# ---- the certain cases --------------------------------------------------------------------


@dataclass
class Waiter:
    rank: int
    group: str
    seq: int
    op: Op | None  # None when only its number is known (a status probe)


@dataclass
class CertainDesync:
    """A desync that can never resolve by waiting (`find_certain`)."""

    kind: str  # "left" | "mismatch"
    group: str
    culprits: list[int]  # the ranks that left early, or ran the odd op
    culprit_ops: dict[int, Op | None]  # left: its last collective; mismatch: the odd one
    culprit_seqs: dict[int, int]  # left: how many collectives of the group it ran
    waiters: list[Waiter]


def find_certain(histories: dict[int, History]) -> CertainDesync | None:
    return _left(histories) or _mismatch(histories)


def _left(histories: dict[int, History]) -> CertainDesync | None:
    leavers = [h for h in histories.values() if h.left and h.known]
    if not leavers:
        return None
    for group in sorted({g for h in histories.values() for g in h.last}, key=_group_order):
        culprits = [h for h in leavers if h.member_of(group)]
        if not culprits:
            continue
        first = min(h.last.get(group, 0) for h in culprits)  # the earliest leaver binds
        waiters = []
        for h in sorted(histories.values(), key=lambda h: h.rank):
            op = h.ops.get((group, first + 1))
            if h.left or h.last.get(group, 0) <= first:
                continue
            if op is not None and op.done and not h.final:
                # Done without the leaver: it was no member after all. (A rank that raised
                # has its timed-out op retired too: gloo retires it on the error.)
                continue
            waiters.append(Waiter(h.rank, group, first + 1, op))
        if waiters:
            late = [h for h in culprits if h.last.get(group, 0) == first]
            return CertainDesync(
                "left",
                group,
                [h.rank for h in late],
                {h.rank: h.ops.get((group, first)) for h in late},
                {h.rank: first for h in late},
                waiters,
            )
    return None


def _mismatch(histories: dict[int, History]) -> CertainDesync | None:
    at: dict[tuple[str, int], dict[int, Op]] = {}
    for h in histories.values():
        if h.left:
            continue
        for group in h.last:
            op = h.in_flight(group)
            if op is not None:
                at.setdefault((group, op.seq), {})[h.rank] = op
    for (group, seq), ops in sorted(at.items(), key=lambda kv: (_group_order(kv[0][0]), kv[0][1])):
        names = Counter(op.name for op in ops.values())
        if len(names) < 2:
            continue
        # The op most ranks run is the reference; on a tie, the lowest rank's.
        lowest = ops[min(ops)].name
        ref = max(names, key=lambda n: (names[n], n == lowest))
        odd = sorted(r for r, op in ops.items() if op.name != ref)
        return CertainDesync(
            "mismatch",
            group,
            odd,
            {r: ops[r] for r in odd},
            {},
            [Waiter(r, group, seq, op) for r, op in sorted(ops.items()) if op.name == ref],
        )
    return None


def stalled(before: dict[int, History], now: dict[int, History]) -> list[int]:
    """Live ranks whose groups have not moved between two looks and that sit at the same
    collective number as another such rank: the candidates for a mismatch, worth a full look."""
    still = [
        r
        for r, h in now.items()
        if not h.left and h.known and h.last and r in before and before[r].last == h.last
    ]
    spots = Counter((g, s) for r in still for g, s in now[r].last.items())
    return sorted(r for r in still if any(spots[(g, s)] > 1 for g, s in now[r].last.items()))


def _group_order(group: str) -> tuple[int, str]:
    return (0 if base(group) == DEFAULT_GROUP else 1, group)


def _int(x: Any) -> int | None:
    try:
        return int(x)
    except (TypeError, ValueError):
        return None


def _ranks(x: Any) -> list[int] | None:
    if isinstance(x, str):
        try:
            x = json.loads(x)
        except ValueError:
            return None
    return [int(r) for r in x] if isinstance(x, list) else None
