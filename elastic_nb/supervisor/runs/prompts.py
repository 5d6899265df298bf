"""The ranks' asks for a line of input (a rank's input(): pdb's prompt, a cell's own input()):
seen in the run directory (rank-R.input.json), shown in the notebook once what the rank printed
before it has been sent, and answered back to the rank through its node (a probe). A rank that
waits for its answer is paused: the group's watch for silence (--hang-after) leaves it alone.
"""

from __future__ import annotations

import json
import os
import typing
from dataclasses import dataclass, field

from elastic_nb import protocol
from elastic_nb.common.rundir import RunDir, read_json
from elastic_nb.supervisor.processes.node import Node
from elastic_nb.supervisor.ranks.log_tailer import LogTailer
from elastic_nb.supervisor.ranks.rank_state import RankState

__all__ = ["ANSWER_WAIT_S", "Prompts"]

ANSWER_WAIT_S = 10.0  # for the rank's probe thread to take an answer
MIRROR_WAIT_S = 2.0  # for what a rank printed before its prompt to reach the tailer


@dataclass
class Prompts:
    rd: RunDir
    # The last ask of each rank taken (attempt, rank): each is shown once.
    taken: dict[tuple[int, int], int] = field(default_factory=dict)
    # Asks shown and not answered yet: those ranks are paused.
    paused: dict[tuple[int, int], protocol.rank_probes.InputAsked] = field(default_factory=dict)
    _seen: dict[tuple[int, int], tuple[int, float]] = field(default_factory=dict)

    def ready(
        self, ranks: list[RankState], tailer: LogTailer, now: float
    ) -> list[tuple[RankState, protocol.rank_probes.InputAsked]]:
        """The live ranks' new asks whose output before them the tailer has read (or whose
        output is late: a joined node's mirror), each once."""
        out = []
        for r in ranks:
            key = (r.attempt, r.rank)
            if r.died_at is not None or key in self.paused:
                continue
            path = self.rd.input_asked(r.attempt, r.rank)
            try:
                mtime = os.stat(path).st_mtime_ns
            except OSError:
                continue
            first_seen = self._seen.get(key)
            if first_seen is None or first_seen[0] != mtime:
                self._seen[key] = first_seen = (mtime, now)
            record = read_json(path)
            if not isinstance(record, dict) or record.get("ask", 0) <= self.taken.get(key, 0):
                continue
            try:
                protocol.wire.check_record(record, protocol.rank_probes.InputAsked, path.name)
            except protocol.wire.ProtocolError:
                continue
            asked = typing.cast(protocol.rank_probes.InputAsked, record)
            offsets = {"out": asked["out"], "err": asked["err"]}
            if (
                not tailer.read_to(r.attempt, r.rank, offsets)
                and now - first_seen[1] < MIRROR_WAIT_S
            ):
                continue
            self.taken[key] = asked["ask"]
            self.paused[key] = asked
            out.append((r, asked))
        return out

    def check(self, r: RankState, ask: int) -> None:
        """KeyError unless `r` waits for the answer to `ask`."""
        waiting = self.paused.get((r.attempt, r.rank))
        if waiting is None or waiting["ask"] != ask:
            raise KeyError(f"rank {r.rank} does not wait for that answer")

    async def answer(
        self, node: Node, r: RankState, ask: int, text: str | None, why: str | None
    ) -> None:
        """The notebook's answer, to the rank that asks; RuntimeError if it did not take it."""
        key = (r.attempt, r.rank)
        self.check(r, ask)
        answer = protocol.rank_probes.InputAnswer(ask=ask, text=text, why=why)
        what = f"{protocol.rank_probes.PROBE_ANSWER} {json.dumps(answer)}"
        record = await node.probe(r, what, ANSWER_WAIT_S)
        self.paused.pop(key, None)
        if record is None or not record.get("taken"):
            raise RuntimeError(f"rank {r.rank} did not take the answer (it is no longer waiting)")

    def forget(self, attempt: int, rank: int) -> None:
        """A rank ended: it waits for nothing."""
        self.paused.pop((attempt, rank), None)
