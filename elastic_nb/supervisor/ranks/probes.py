"""The supervisor's side of the ranks' flight-recorder probes (`elastic_nb.rank.recorder` is the rank's).

A probe is one line the rank's site hands the live rank (today: written into its FIFO); the rank's
probe thread answers into a file, tagged with the probe's number. A rank that has ended is read from the record it left (and from
NCCL's own dump, when a timeout made one). A rank that does not answer within `PROBE_WAIT_S` (its
probe thread starved of the GIL by a C call that holds it, or the rank going away) is left out:
the verdict then rests on the other ranks and on the stacks.
"""

from __future__ import annotations

from collections.abc import Callable

import anyio

from elastic_nb.common.rank_state import RankState
from elastic_nb.common.rundir import RunDir, read_json
from elastic_nb.protocol.rank_probes import PROBE_FULL, PROBE_STATUS
from elastic_nb.supervisor.forensics.collectives import History, history, read_nccl_dump
from elastic_nb.supervisor.processes.site import Site

__all__ = ["Probes"]

PROBE_WAIT_S = 1.0  # a rank answers in milliseconds; a full dump of 2,000 entries in ~0.1 s


class Probes:
    def __init__(
        self, rd: RunDir, site_of: Callable[[RankState], Site], live_done: bool = False
    ) -> None:
        """`live_done`: a rank that finished the cell lives on and answers probes (a session's
        rank, back in its loop); a job's rank has left its final record instead."""
        self._rd = rd
        self._site_of = site_of
        self._live_done = live_done
        self._cell = str(rd.cell)
        # Group members a rank reported earlier: a group it destroyed before leaving the cell
        # is gone from c10d's registry by the time it writes its final record.
        self._members: dict[tuple[int, int], dict[str, list[int]]] = {}
        self._ended: dict[tuple[int, int], History] = {}  # ranks that left their last record
        self._nccl: set[tuple[int, int]] = set()  # ranks whose NCCL dump has been read

    async def look(self, ranks: list[RankState], full: bool) -> dict[int, History]:
        """Every rank's collectives now; `full` asks live ranks for every entry, not only each
        group's last number."""
        out: dict[int, History] = {}

        async def one(r: RankState) -> None:
            h = await self._history(r, full)
            if h is not None:
                out[r.rank] = h

        async with anyio.create_task_group() as tg:
            for r in ranks:
                tg.start_soon(one, r)
        return out

    async def _history(self, r: RankState, full: bool) -> History | None:
        key = (r.attempt, r.rank)
        ended = (r.done is not None and not self._live_done) or r.failure is not None
        nccl_path = self._rd.flight_recorder(r.attempt, r.rank)
        if ended and key in self._ended and (key in self._nccl or not nccl_path.exists()):
            return self._ended[key]  # its record will not change: read (and parse) it once
        if ended:
            record = read_json(self._rd.collectives(r.attempt, r.rank))
        elif r.died_at is None:
            record = await self._ask(r, full)
        else:
            record = None
        nccl = read_nccl_dump(self._rd, nccl_path)
        if record is None and nccl is None:
            return None
        h = history(r.rank, record, self._cell, left=r.done is not None)
        if nccl is not None:
            h.absorb(history(r.rank, nccl, self._cell))
            self._nccl.add(key)
        for group, ranks in self._members.get(key, {}).items():
            h.members.setdefault(group, ranks)
        self._members[key] = dict(h.members)
        if ended:
            self._ended[key] = h
        return h

    async def _ask(self, r: RankState, full: bool) -> dict | None:
        site = self._site_of(r)
        return await site.probe(r, PROBE_FULL if full else PROBE_STATUS, PROBE_WAIT_S)
