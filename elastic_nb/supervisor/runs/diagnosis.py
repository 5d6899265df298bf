"""What a diagnosis finds, in words, and the desync watch that jobs and session cells share.

A diagnosis takes the evidence (`evidence.EvidenceCollector`: every stack, every flight recorder)
while the ranks still live, and says what it shows: a collective timeout and whose fault it is,
a desync, where every rank waits. Whoever runs the ranks (a job, a session cell) decides what
happens; this module finds and words.

The desync watch looks at the ranks' flight recorders every LOOK_LEFT_S once a rank has left the
cell (a desync can become certain any moment then), and every LOOK_IDLE_S otherwise (two ranks
stalled in different ops): a status look costs a rank 0.1 ms.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from elastic_nb.common.rank_state import RankState, watchdog_op, watchdog_summary
from elastic_nb.common.report import oom_lines, size
from elastic_nb.common.spec import JobSpec
from elastic_nb.supervisor.forensics.collectives import CertainDesync, History
from elastic_nb.supervisor.forensics.desync import Desync
from elastic_nb.supervisor.ranks.evidence import Evidence, EvidenceCollector

__all__ = [
    "LOOK_IDLE_S",
    "LOOK_LEFT_S",
    "DesyncWatch",
    "Finding",
    "oom_alert",
    "timeout_finding",
    "watchdog_title",
    "where_finding",
]

LOOK_LEFT_S = 0.25
LOOK_IDLE_S = 1.0
RELOOK_S = 1.0  # after a full look that did not confirm a finding

OOM_HINT = (
    "if this rank's error is caught and it skips a collective (e.g. backward()), the "
    "other ranks wait in that collective until --collective-timeout: a desync"
)


@dataclass
class Finding:
    """A diagnosis the summary keeps: the alert's title, whom it blames, what the summary says."""

    title: str
    culprit: int | None
    desync: Desync | None
    stacks: str

    @property
    def record(self) -> dict[str, Any]:
        """What summary.json keeps as "diagnosis"."""
        return {
            "text": self.desync.text if self.desync else None,
            "hint": self.desync.hint if self.desync else None,
            "stacks": self.stacks,
        }


def timeout_finding(
    r: RankState, ev: Evidence, spec: JobSpec, paused: dict[int, int | None] | None = None
) -> Finding:
    """Rank `r` timed out in a collective: in which op, after how long, and whose fault. A rank
    the others waited for because it sat at a prompt (`paused`: rank -> its cell line) did not
    fall out of step: the timeout is the pause's, and `r`'s to report."""
    op = ev.where[r.rank].collective() if r.rank in ev.where else None
    after = f" after {spec.collective_timeout:g} s" if spec.collective_timeout else ""
    if r.watchdog is not None:  # its own words: the op, and the timeout it had
        op, after = watchdog_op(r.watchdog["line"]) or op, ""
    title = f"rank {r.rank} timed out in {op or 'a collective'}{after}"
    desync = ev.desync
    if paused and desync is not None and set(desync.behind) <= paused.keys():
        at = [
            f"rank {p}" + (f" (cell line {paused[p]})" if paused[p] else "") for p in desync.behind
        ]
        title += f" while {', '.join(at)} waited at a prompt (a debugger's, an input())"
        return Finding(title, r.rank, None, ev.stacks)
    if desync is not None:
        title += f": {desync.text}"
    culprit = desync.behind[0] if desync is not None and desync.behind else r.rank
    return Finding(title, culprit, desync, ev.stacks)


def where_finding(title: str, ev: Evidence, held: dict[int, int | None] | None = None) -> Finding:
    """Nothing ended (a hang, stacks on request, a watchdog that keeps the rank): where
    everyone is, what they say of a desync, and (`held`: each rank's host memory) the rank
    holding far more memory than the others."""
    if ev.desync is not None:
        title += f": {ev.desync.text}"
    title += memory_words(held or {})
    culprit = ev.desync.behind[0] if ev.desync is not None and ev.desync.behind else None
    return Finding(title, culprit, ev.desync, ev.stacks)


MEMORY_OUTLIER = 2.0  # a rank holding this many times the others' median stands out


def memory_words(held: dict[int, int | None]) -> str:
    """'; rank 1 holds 4.5× the others' host memory (1.2 GiB)': the rank whose latest host
    memory (`held`: rank -> bytes) is at least MEMORY_OUTLIER times the others' median, said
    beside a hang or a desync (a rank that silently filled its memory is often the one stuck);
    '' where none is."""
    known = {r: v for r, v in held.items() if v}
    if len(known) < 2:
        return ""
    rank = max(known, key=lambda r: known[r])
    others = sorted(v for r, v in known.items() if r != rank)
    median = others[len(others) // 2]
    ratio = known[rank] / median
    if ratio < MEMORY_OUTLIER:
        return ""
    return f"; rank {rank} holds {ratio:.1f}× the others' host memory ({size(known[rank])})"


def desync_finding(ev: Evidence) -> Finding:
    """A desync a full look confirmed (`DesyncWatch.confirm`)."""
    assert ev.desync is not None
    culprit = ev.desync.behind[0] if ev.desync.behind else None
    return Finding(f"desync: {ev.desync.text}", culprit, ev.desync, ev.stacks)


def watchdog_title(rank: int, line: str, mode: int) -> str:
    """NCCL's watchdog fired in a mode that keeps the rank alive (0 or 2)."""
    return f"rank {rank}: {watchdog_summary(line)}; it lives on (--async-error-handling {mode})"


def oom_alert(r: RankState) -> tuple[str, str]:
    """The title and text of a CUDA OOM alert, from the worker's memory report."""
    assert r.failure is not None
    mem = r.failure.get("memory") or {}
    facts = [f"requested {mem['requested']}"] if mem.get("requested") else []
    for key in ("allocated", "reserved"):
        if mem.get(key) is not None:
            facts.append(f"{key} {mem[key] / 2**30:.2f} GiB")
    line = r.failure.get("cell_line")
    gpu = f" on GPU {mem['device']}" if mem.get("device") is not None else ""
    title = f"rank {r.rank} ran out of CUDA memory{gpu}"
    title += f" at cell line {line}" if line else ""
    if facts:
        title += f" ({', '.join(facts)})"
    found = "\n".join(oom_lines(mem))
    text = "\n".join(x for x in (found, mem.get("summary"), mem.get("error"), OOM_HINT) if x)
    return title, text


class DesyncWatch:
    """Finds a desync the moment it can no longer resolve (`collectives.find_certain`: a rank left
    the cell while another waits in a later collective of its group, or two ranks wait in
    different ops at the same number), not when the collective timeout ends it. One per attempt
    of a job, one per session cell; its owner calls `look` while the ranks run the cell, and
    `confirm` when a look found something (a full look: every stack and flight recorder)."""

    def __init__(self, collector: EvidenceCollector) -> None:
        self._collector = collector
        self._before: dict[int, History] = {}
        # The first look is one interval after the watch starts: at its start every rank has just
        # entered the cell, and a look then only delays the end of a cell that takes
        # milliseconds (a session's `x = 1` waited 10 ms for it).
        self._looked = time.monotonic()
        self._unconfirmed: dict[str, float] = {}  # findings a full look did not bear out, when
        self.last: Evidence | None = None  # the latest full look, whatever it found

    def next_look(self, left: bool) -> float:
        """When the next look is due (monotonic): a rank that left the cell makes a desync
        possible at any moment."""
        return self._looked + (LOOK_LEFT_S if left else LOOK_IDLE_S)

    def forget(self) -> None:
        """The ranks are not all in the cell: the next look starts afresh."""
        self._before = {}

    async def look(self, ranks: list[RankState], left: bool) -> CertainDesync | None:
        """A cheap look (each group's last collective number of every rank), if one is due: what
        it finds certain, unless a full look did not bear the same out a moment ago (a rank
        too busy to answer in time: each full look dumps every rank's stack)."""
        now = time.monotonic()
        if now < self.next_look(left):
            return None
        self._looked = now
        self._before, certain = await self._collector.look(ranks, self._before)
        if certain is None:
            return None
        if now - self._unconfirmed.get(_key(certain), -RELOOK_S) < RELOOK_S:
            return None
        return certain

    async def confirm(self, ranks: list[RankState], certain: CertainDesync) -> Evidence | None:
        """The full look: the evidence if the desync holds, else None (and the finding is not
        taken again for RELOOK_S)."""
        ev = self.last = await self._collector.collect(ranks)
        if ev.desync is None or not ev.desync.certain:
            self._unconfirmed[_key(certain)] = time.monotonic()
            return None
        return ev


def _key(certain: CertainDesync) -> str:
    return repr((certain.kind, [(w.rank, w.seq) for w in certain.waiters]))
