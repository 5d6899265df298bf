"""Asking a job's ranks where they are and what they ran: the evidence every diagnosis uses.

Stacks come on request (`protocol.STACK_SIGNAL`, answered by faulthandler even inside a
collective), flight recorders through probes (`probes.Probes`); a diagnosis asks both at once
and awaits them together. The desync watch's cheaper look asks only for each group's last
collective number. The job decides what to make of the answers; nothing here ends anything.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import anyio

from elastic_nb.common import procs, protocol
from elastic_nb.common.rundir import RunDir
from elastic_nb.supervisor.forensics.collectives import Finding, History, find_certain, stalled
from elastic_nb.supervisor.forensics.stacks import (
    Desync,
    RankWhere,
    desync_verdict,
    format_stacks,
    where_from_dump,
    where_from_record,
)
from elastic_nb.supervisor.forensics.verdict import RankState
from elastic_nb.supervisor.ranks.probes import Probes

__all__ = ["Evidence", "EvidenceCollector"]

STACKS_WAIT_S = 1.0  # how long live ranks get to answer a stack dump request
_TAIL = 1024  # bytes: enough for a dump's last line


@dataclass
class Evidence:
    where: dict[int, RankWhere]
    histories: dict[int, History]
    desync: Desync | None  # what the two say of who is out of step, if anyone is
    stacks: str  # every rank's stack, trimmed to the cell's frames, as reports show them


class EvidenceCollector:
    def __init__(self, rd: RunDir, source: str, cell: os.PathLike[str] | None = None) -> None:
        """`cell`: the cell's file, when it is not the run directory's own: a session's cell
        has a run directory of its own, and its ranks' stacks and probes are the session's
        (its ranks live on after the cell)."""
        self._rd = rd
        self._cell = str(cell or rd.cell)
        self._lines = source.splitlines()
        self._probes = Probes(rd, live_done=cell is not None)

    async def collect(self, ranks: list[RankState]) -> Evidence:
        """Every rank's stack and flight recorder, now. `ranks` (one attempt's) carry their
        latest records: a rank that finished or raised tells from them."""
        where: dict[int, RankWhere] = {}
        histories: dict[int, History] = {}

        async def stacks() -> None:
            where.update(await self._where(ranks))

        async def recorders() -> None:
            histories.update(await self._probes.look(ranks, full=True))

        async with anyio.create_task_group() as tg:
            tg.start_soon(stacks)
            tg.start_soon(recorders)
        desync = desync_verdict(where, self._cell, self._lines, histories)
        return Evidence(where, histories, desync, format_stacks(where, self._cell, self._lines))

    async def look(
        self, ranks: list[RankState], before: dict[int, History]
    ) -> tuple[dict[int, History], Finding | None]:
        """The desync watch's look: each group's last collective number of every rank (cheap),
        then every entry of the ranks that have not moved since `before` and sit at the same
        number as another (a mismatch needs the ops' names)."""
        now = await self._probes.look(ranks, full=False)
        certain = find_certain(now)
        still = stalled(before, now)
        suspects = [r for r in ranks if r.rank in still and r.died_at is None]
        if certain is None and suspects:
            now.update(await self._probes.look(suspects, full=True))
            certain = find_certain(now)
        return now, certain

    async def _where(self, ranks: list[RankState]) -> dict[int, RankWhere]:
        """Live ranks dump their stacks on request (all at once, answers awaited together);
        the others tell from their records."""
        where: dict[int, RankWhere] = {}
        asked: dict[int, tuple[os.PathLike[str], int, tuple[str, str]]] = {}
        for r in ranks:
            if r.done is not None:
                where[r.rank] = RankWhere(r.rank, "finished")
            elif r.failure is not None:
                where[r.rank] = where_from_record(r.rank, r.failure)
            elif r.died_at is not None or r.pid is None:
                where[r.rank] = RankWhere(r.rank, "exited", note=r.failure_summary())
            else:
                path = self._rd.stacks(r.attempt, r.rank)
                state = procs.proc_state(r.pid)
                if state is None or not path.exists():
                    note = "not yet running the cell" if state else "gone"
                    where[r.rank] = RankWhere(r.rank, "unknown", note=note)
                    continue
                size = path.stat().st_size
                if procs.send_signal(r.pid, r.pidfd, protocol.STACK_SIGNAL):
                    asked[r.rank] = (path, size, state)
                else:
                    where[r.rank] = RankWhere(r.rank, "unknown", note="gone")
        ends = {rank: _dump_end(path) for rank, (path, _, _) in asked.items()}
        last: dict[int, int] = {}
        answered: set[int] = set()
        with anyio.move_on_after(STACKS_WAIT_S):
            while len(answered) < len(asked):
                await anyio.sleep(0.02)
                for rank, (path, size, _) in asked.items():
                    now = os.stat(path).st_size
                    if rank not in answered and now > size:
                        # Whole once it ends as every dump of the rank ends (a rank descheduled
                        # mid-dump holds still too). Where that line is unknown, or the dump is
                        # cut ("...": a stack deeper than faulthandler writes): once it held
                        # still for a poll.
                        tail = _read_from(path, max(size, now - _TAIL)).rstrip("\n")
                        end = ends[rank]
                        if end and not tail.endswith("..."):
                            whole = tail.endswith(end)
                        else:
                            whole = last.get(rank) == now
                        if whole:
                            answered.add(rank)
                    last[rank] = now
        for rank, (path, size, state) in asked.items():
            dump = _read_from(path, size)
            w = where_from_dump(rank, dump, self._cell, str(path))
            if not dump:
                w.note = f"no answer to the stack request: the process is {state[1]}"
            elif state[0] in "DTt":
                w.note = state[1]
            where[rank] = w
        return where


def _dump_end(path: os.PathLike[str]) -> str | None:
    """How every dump of this .stacks file ends (its first line says, protocol.STACKS_END_MARK)."""
    with contextlib.suppress(OSError), open(path, encoding="utf-8", errors="replace") as f:
        first = f.readline().rstrip("\n")
        if first.startswith(protocol.STACKS_END_MARK):
            return first[len(protocol.STACKS_END_MARK) :]
    return None


def _read_from(path: os.PathLike[str], offset: int) -> str:
    with open(path, "rb") as f:
        f.seek(offset)
        return f.read().decode(errors="replace")
