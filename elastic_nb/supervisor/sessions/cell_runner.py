"""A session's cells, one at a time: each new attempt's replay first, then the cells in the order
they came, each decided by `SessionCell.decide`; the cells the kernel follows get the session's
news and the ranks' lines (`Followed`). The session (`Session`) owns the ranks and their
restarts; this runs what they are given.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any, Protocol

import anyio
from anyio.abc import TaskGroup

from elastic_nb.common import protocol
from elastic_nb.supervisor.forensics.verdict import RankState
from elastic_nb.supervisor.forensics.watchdogs import Silence
from elastic_nb.supervisor.ranks.evidence import EvidenceCollector
from elastic_nb.supervisor.ranks.log_tailer import LogTailer
from elastic_nb.supervisor.ranks.rank_book import RankBook
from elastic_nb.supervisor.ranks.rank_links import Link
from elastic_nb.supervisor.sessions.followed import Followed
from elastic_nb.supervisor.sessions.journal import Journal
from elastic_nb.supervisor.sessions.session_cell import Host, SessionCell

__all__ = ["CellRunner", "Ranks"]


class Ranks(Host, Protocol):
    """What the runner needs of its session: the ranks, where they stand, and a way to wait
    for them to change."""

    attempt: int
    book: RankBook
    tailer: LogTailer
    restart_why: str  # what the last restart was for

    def up(self) -> bool: ...

    def links(self) -> list[Link]: ...

    def notify(self) -> None: ...

    async def until(self, ready: Callable[[], bool], timeout: float = math.inf) -> bool: ...


class CellRunner:
    def __init__(self, session: Ranks) -> None:
        self._s = session
        self.journal = Journal()
        self.followed = Followed(session.tailer)
        self.cells: dict[str, SessionCell] = {}
        self.cells_run = 0
        self.current: SessionCell | None = None  # the cell the ranks run (a replay's too)
        self.replayed = -1  # the attempt whose replay is over
        self._in, self._queue = anyio.create_memory_object_stream[SessionCell](math.inf)
        self._silence = Silence(last_activity=time.monotonic())
        self._shown_attempt = 0  # the attempt the last cell ran on
        self._tg: TaskGroup | None = None

    def submit(self, cell: SessionCell) -> None:
        self.cells[cell.id] = cell
        self.followed.add(cell)
        self._in.send_nowait(cell)

    def stop(self, cell_id: str, reason: str) -> None:
        cell = self.cells[cell_id]
        if cell.running:
            cell.request_stop(reason)
            if cell is not self.current and cell.no is None:  # still waiting its turn
                self._close(cell, *cell.stopped(), ranks=[])
            self._s.notify()

    def ready(self) -> bool:
        """The ranks wait for a cell: all up, the journal replayed, nothing running."""
        s = self._s
        return s.up() and self.replayed == s.attempt and self.current is None

    async def run(self, tg: TaskGroup) -> None:
        """Serve the cells (and each attempt's replay) until cancelled."""
        self._tg = tg
        tg.start_soon(self._keep_replayed)
        tg.start_soon(self._poll_hangs)
        async for cell in self._queue:
            await self._s.until(lambda cell=cell: self.ready() or not cell.running)  # type: ignore[misc]
            if cell.running:  # not stopped while it waited
                await self._run(cell)

    async def _keep_replayed(self) -> None:
        """Each new attempt gets the journal before any other cell."""
        s = self._s
        while True:
            await s.until(lambda: s.up() and self.replayed != s.attempt and self.current is None)
            attempt = s.attempt
            await self.journal.replay(attempt, self)
            self.replayed = attempt
            s.notify()

    async def _send(self, cell: SessionCell) -> list[Link]:
        cell.answers = {}
        self.current = cell
        links = self._s.links()
        for link in links:
            await link.send(protocol.RUN, cell=cell.id, run_dir=str(cell.rd))
        self._s.notify()
        return links

    async def _run(self, cell: SessionCell) -> None:
        s = self._s
        self.cells_run += 1
        cell.no, cell.attempt = self.cells_run, s.attempt
        cell.report.event("run", no=cell.no, attempt=s.attempt)
        cell.report.set_state("running")
        self._silence = Silence(last_activity=time.monotonic())
        if s.attempt > self._shown_attempt:
            # Whether or not it waited for them, the cell runs on new ranks: say why.
            cell.report.alert(
                "restart",
                "warning",
                f"the session restarted since its last cell ({s.restart_why}): attempt "
                f"{s.attempt}, restarts {s.attempt}/{s.spec.max_restarts}, "
                f"{self.journal.words(s.attempt) or 'nothing to replay'}",
            )
        self._shown_attempt = s.attempt
        links = await self._send(cell)
        outcome, reason, teardown_at, restarts = await cell.decide(links, s)
        if self.current is cell:
            self.current = None
        s.notify()
        if outcome == "succeeded":
            self.journal.add(cell)
        if restarts:
            # The restart and the replay show under this cell; it ends when the state is back
            # (or the kernel stops following it).
            assert self._tg is not None
            self._tg.start_soon(self._end_after_restart, cell, outcome, reason, teardown_at)
        else:
            self._end(cell, outcome, reason, teardown_at, restarts=False)

    async def _end_after_restart(
        self, cell: SessionCell, outcome: str, reason: str, teardown_at: float | None
    ) -> None:
        s = self._s
        await s.until(
            lambda: (
                s.ended() is not None
                or cell.stop_reason is not None
                or (s.attempt > cell.attempt and s.up() and self.replayed == s.attempt)
            )
        )
        self._end(cell, outcome, reason, teardown_at, restarts=True)

    def _end(
        self,
        cell: SessionCell,
        outcome: str,
        reason: str,
        teardown_at: float | None,
        restarts: bool,
    ) -> None:
        if not cell.running:
            return  # the session's end closed it
        s = self._s
        ranks = cell.ranks(s.book.of(cell.attempt))
        cell.oom_alerts(ranks)
        if restarts and s.ended() is None:
            cell.restarted_to = s.attempt
            words = self.journal.words(s.attempt)
            if words is None:
                reason += f"; the session restarts (attempt {s.attempt + 1}) and replays its cells"
            else:
                reason += f"; the session restarted (attempt {s.attempt}) and {words}"
        self._close(cell, outcome, reason, ranks, teardown_at)

    def _close(
        self,
        cell: SessionCell,
        outcome: str,
        reason: str,
        ranks: list[RankState],
        teardown_at: float | None = None,
    ) -> None:
        logs = self.followed.conclude(cell, outcome, reason, ranks, teardown_at, self.current)
        assert self._tg is not None
        self._tg.start_soon(self.followed.end, cell, logs, self._s.attempt)

    async def close_all(self, reason: str) -> None:
        """The session ended: every cell the kernel still follows ends with it."""
        s = self._s
        for cell in list(self.followed.cells):
            if cell.no is not None:
                why = ("failed", f"the session ended: {reason}")
            else:
                why = ("stopped", f"the session ended before the cell ran: {reason}")
            ranks = cell.ranks(s.book.of(cell.attempt)) if cell.no is not None else []
            logs = self.followed.conclude(cell, *why, ranks, time.time(), self.current)
            await self.followed.end(cell, logs, s.attempt)

    # ---- what a replay needs (journal.Replayer) ------------------------------------------------

    async def run_cell(self, cell: SessionCell) -> bool:
        """Run a journal's cell on every rank of the current attempt; False if the attempt
        ended first (a rank died: the next attempt replays again)."""
        s = self._s
        attempt = s.attempt
        links = await self._send(cell)
        await s.until(
            lambda: (
                len(cell.answers) == len(links)
                or s.attempt != attempt
                or s.attempt_failed(attempt)
                or s.ended() is not None
            )
        )
        self.current = None
        return len(cell.answers) == len(links)

    def alert(self, kind: str, severity: str, title: str, rank: int | None = None) -> None:
        self._s.alert(kind, severity, title, rank=rank)

    def on_watchdog(self, attempt: int, rank: int, line: str) -> None:
        """NCCL's watchdog line in a rank's log: the running cell's (a replayed cell's rank
        aborts, and the restart replays again)."""
        cell = self.current
        if cell is not None and cell.no is not None and cell.attempt == attempt:
            cell.on_watchdog(rank, line)

    # ---- --hang-after ------------------------------------------------------------------------

    async def _poll_hangs(self) -> None:
        s = self._s
        while True:
            await anyio.sleep(0.1)
            cell = self.current
            if cell is None or not cell.running or cell.spec.hang_after is None:
                continue
            lines = s.tailer.activity_total()
            if self._silence.due(time.monotonic(), lines, True, cell.spec.hang_after):
                assert self._tg is not None
                self._tg.start_soon(self._hang_alert, cell)

    async def _hang_alert(self, cell: SessionCell) -> None:
        s = self._s
        ev = await EvidenceCollector(s.rd, cell.source, cell.rd.cell).collect(s.book.of(s.attempt))
        title = f"no output from any rank for {cell.spec.hang_after:g} s (--hang-after)"
        cell.report.alert("hang", "warning", title, text=ev.stacks)

    def info(self) -> dict[str, Any]:
        return {
            "cells_run": self.cells_run,
            "journal": self.journal.info(),
            "replays": self.journal.replays,
        }
