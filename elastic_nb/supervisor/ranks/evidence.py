"""Asking a job's ranks where they are and what they ran: the evidence every diagnosis uses.

Stacks come on request (the site signals the rank, which answers with faulthandler even inside
a collective), flight recorders through probes (`probes.Probes`); a diagnosis asks both at once
and awaits them together. The desync watch's cheaper look asks only for each group's last
collective number. The job decides what to make of the answers; nothing here ends anything.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import anyio

from elastic_nb.common.rank_state import RankState
from elastic_nb.common.rundir import RunDir
from elastic_nb.supervisor.forensics.collectives import (
    CertainDesync,
    History,
    find_certain,
    stalled,
)
from elastic_nb.supervisor.forensics.desync import Desync, desync_verdict
from elastic_nb.supervisor.forensics.stacks import (
    RankWhere,
    format_stacks,
    place_words,
    where_from_dump,
    where_from_record,
)
from elastic_nb.supervisor.processes.site import Site, stacks_of
from elastic_nb.supervisor.ranks.probes import Probes

__all__ = ["Evidence", "EvidenceCollector"]

STACKS_WAIT_S = 1.0  # how long live ranks get to answer a stack dump request


@dataclass
class Evidence:
    where: dict[int, RankWhere]
    histories: dict[int, History]
    desync: Desync | None  # what the two say of who is out of step, if anyone is
    stacks: str  # every rank's stack, trimmed to the cell's frames, as reports show them
    places: dict[int, str]  # each rank's place in a few words (stacks.place_words)


class EvidenceCollector:
    def __init__(
        self,
        rd: RunDir,
        site_of: Callable[[RankState], Site],
        source: str,
        cell: os.PathLike[str] | None = None,
    ) -> None:
        """`rd`: the run directory of the ranks' group (their records); `cell`: the cell's file,
        when it is not the run directory's own: a session's cell has a run directory of its
        own, and its ranks' stacks and probes are the session's (its ranks live on after the
        cell)."""
        self._cell = str(cell or rd.cell)
        self._lines = source.splitlines()
        self._site_of = site_of
        self._probes = Probes(rd, site_of, live_done=cell is not None)

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
        for r in ranks:
            if r.where is not None and r.rank in where:
                where[r.rank].name = r.name  # across machines, each rank named with its node
        desync = desync_verdict(where, self._cell, self._lines, histories)
        text = format_stacks(where, self._cell, self._lines)
        places = {
            rank: place_words(w, self._cell, _number(w, histories.get(rank)))
            for rank, w in where.items()
        }
        return Evidence(where, histories, desync, text, places)

    async def look(
        self, ranks: list[RankState], before: dict[int, History]
    ) -> tuple[dict[int, History], CertainDesync | None]:
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
        live = []
        for r in ranks:
            if r.done is not None:
                where[r.rank] = RankWhere(r.rank, "finished")
            elif r.failure is not None:
                where[r.rank] = where_from_record(r.rank, r.failure)
            elif r.died_at is not None or r.pid is None:
                where[r.rank] = RankWhere(r.rank, "exited", note=r.failure_summary())
            else:
                live.append(r)
        for rank, dump in (await stacks_of(live, self._site_of, STACKS_WAIT_S)).items():
            if not dump.asked:
                note = "not yet running the cell" if dump.state else "gone"
                where[rank] = RankWhere(rank, "unknown", note=note)
                continue
            w = where_from_dump(rank, dump.text, self._cell, dump.path)
            if not dump.text:
                state = dump.state[1] if dump.state else "gone"
                w.note = f"no answer to the stack request: the process is {state}"
            elif dump.state and dump.state[0] in "DTt":
                w.note = dump.state[1]
            where[rank] = w
        return where


def _number(w: RankWhere, history: History | None) -> int | None:
    """The number of the collective the rank's stack waits in, from its flight recorder."""
    op = history.waiting_in() if history is not None else None
    return op.seq if op is not None and op.name == w.collective() else None
