"""The rank book: every rank of every attempt of a job, what each left on disk, how it ended,
and the few words a dashboard chip shows for it.

The supervisor learns a rank's end from several places (its site, which sees it go; its failure
or done record; the launcher's EXIT and EXITS messages); the book is where they meet.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import anyio

from elastic_nb.common.rank_state import RankState
from elastic_nb.common.rundir import RunDir, read_json
from elastic_nb.protocol.records import Chip
from elastic_nb.supervisor.forensics.desync import Desync
from elastic_nb.supervisor.processes.site import Site

__all__ = ["RankBook"]

# How long a forked rank's exit status may take to come from its launcher: milliseconds as a
# rule; 0.5 s was passed once on a 2-core machine running two test suites (its rank was then
# described with no exit status).
EXIT_WAIT_S = 2.0
HEAR_OUT_POLL_S = 0.005  # a rank watcher woken by the launcher's word runs within a loop turn


class RankBook:
    def __init__(self, rd: RunDir, kill_window: float = 0.0) -> None:
        self.rd = rd
        self.kill_window = kill_window
        self._sites: dict[tuple[int, int], Site] = {}  # where each rank runs
        self.ranks: dict[tuple[int, int], RankState] = {}
        self.failed_attempts: set[int] = set()
        self.zombies: set[tuple[int, int]] = set()  # (attempt, rank) dead and left unreaped
        self.behind: dict[int, list[int]] = {}  # attempt -> ranks a desync verdict blamed
        self.launcher_exits: dict[int, dict[int, int]] = {}  # attempt -> rank -> code (EXITS)
        self._exits: dict[tuple[int, int], anyio.Event] = {}  # forked ranks' reported ends
        self._records: dict[tuple[int, int], tuple[Path, Path]] = {}  # done, failure

    def add(self, attempt: int, rank: int, pid: int, started_at: float, site: Site) -> RankState:
        r = RankState(attempt, rank, pid=pid, started_at=started_at, kill_window=self.kill_window)
        self.ranks[(attempt, rank)] = r
        self._sites[(attempt, rank)] = site
        return r

    def site(self, r: RankState) -> Site:
        """The site the rank runs at: everything done to it goes through its site."""
        return self._sites[(r.attempt, r.rank)]

    def get(self, attempt: int, rank: int) -> RankState | None:
        return self.ranks.get((attempt, rank))

    def of(self, attempt: int) -> list[RankState]:
        return [r for (a, _), r in sorted(self.ranks.items()) if a == attempt]

    def all(self) -> list[RankState]:
        return list(self.ranks.values())

    def exit_reported(self, r: RankState) -> anyio.Event:
        """Set once the launcher has said how a forked rank ended (its fork server reaps it)."""
        return self._exits.setdefault((r.attempt, r.rank), anyio.Event())

    def report_exit(self, attempt: int, rank: int, code: int | None) -> RankState | None:
        """The launcher's word on a rank's exit code; returns the rank if that was news."""
        r = self.ranks.get((attempt, rank))
        if r is None or r.exit_code is not None or code is None:
            return None
        r.exit_code = int(code)
        self.exit_reported(r).set()
        return r

    def record_exits(self, attempt: int, codes: dict[int, int]) -> list[RankState]:
        """The launcher's EXITS: every rank's code as torch saw it; returns the ranks already
        seen gone without a status (they can be judged now)."""
        self.launcher_exits[attempt] = codes
        news = [self.report_exit(attempt, rank, code) for rank, code in codes.items()]
        return [r for r in news if r is not None and r.died_at is not None]

    async def wait_exit(
        self, r: RankState, forked: bool, wait_s: float = EXIT_WAIT_S
    ) -> tuple[float, float]:
        """Until the rank's process has ended, with its exit code when it can be had; returns
        when it was seen gone (time.time(), time.monotonic()), before its status was awaited:
        who failed first is judged by that moment, not by how long the status took.

        A forked rank is its fork server's, reaped at once: the launcher says how it ended
        (protocol.launcher.EXIT), within milliseconds, or up to `wait_s` on a loaded machine."""
        gone = await self.site(r).wait_gone(r)
        if r.exit_code is None and forked and r.lost is None:
            with anyio.move_on_after(wait_s):
                await self.exit_reported(r).wait()
        return gone

    async def hear_out(self, heard: anyio.Event, wait_s: float = EXIT_WAIT_S) -> None:
        """After the teardown, before the end is judged. A launcher that dies at once says how
        its ranks ended (and its result) just before: when the teardown sees it gone, that can
        still be in its pipe, and the rank watchers not yet woken by it. Wait until the job has
        taken in every message (`heard`) and seen every rank gone, `wait_s` at most."""
        with anyio.move_on_after(wait_s):
            await heard.wait()
            while any(r.died_at is None for r in self.ranks.values()):
                await anyio.sleep(HEAR_OUT_POLL_S)

    def in_the_cell(self, attempt: int) -> bool:
        """Every live rank of the attempt runs our bootstrap (it arms its stack dump first
        thing) and one of them has yet to finish the cell."""
        live = [r for r in self.of(attempt) if r.died_at is None]
        for r in live:
            if not r.armed:
                r.armed = self.site(r).armed(r)
                if not r.armed:
                    return False
        return any(r.done is None and r.failure is None for r in live)

    def settle(self) -> None:
        """At the end: every rank is gone (the teardown saw to it); fill in what is missing."""
        for r in self.ranks.values():
            self.read_records(r)
            if r.died_at is None:
                r.died_at = time.time()
            if r.exit_code is None:
                r.exit_code = self.launcher_exits.get(r.attempt, {}).get(r.rank)

    def new_failures(self, attempt: int) -> list[RankState]:
        """Live ranks of the attempt whose failure record has just appeared (read once a poll),
        in the order they failed: a poll that reads a timeout and the peer error it caused
        must act on the timeout (its diagnosis takes every stack), not on the lower rank."""
        found: list[RankState] = []
        for r in self.of(attempt):
            if r.died_at is None and r.failure is None and r.done is None:
                self.read_records(r)
                if r.failure is not None:
                    found.append(r)
        return sorted(found, key=lambda r: r.failed_at or 0.0)

    def read_records(self, r: RankState) -> None:
        """The rank's done or failure record, once it has left one (looked for every poll of
        a running rank: the paths are made once)."""
        key = (r.attempt, r.rank)
        paths = self._records.get(key)
        if paths is None:
            paths = self._records[key] = (
                self.rd.done(r.attempt, r.rank),
                self.rd.failure(r.attempt, r.rank),
            )
        site = self._sites.get(key)
        shift = site.clock_offset if site is not None else 0.0
        if r.done is None:
            r.done = _on_our_clock(read_json(paths[0]), shift)
        if r.failure is None and r.done is None:
            r.failure = _on_our_clock(read_json(paths[1]), shift)

    def blame(self, attempt: int, desync: Desync) -> list[RankState]:
        """Write on each culprit what it did (a rank that left early exited 0, but it is the one
        that broke the group); returns the ranks whose chip changed."""
        self.behind[attempt] = desync.behind
        changed = []
        for rank, note in desync.notes.items():
            r = self.ranks.get((attempt, rank))
            if r is not None:
                r.blame = note
                changed.append(r)
        return changed

    def chip(self, r: RankState, teardown_at: float | None, root: RankState | None = None) -> Chip:
        """What a dashboard shows for one rank: a state to colour it by, a few words, and the
        whole story for a failed or stopped one. A rank that only saw its peer go is a victim
        (stopped), unless the verdict (`root`, at the end) finds no one else to blame."""
        kind = r.kind(teardown_at)
        if kind == "running" or (kind == "done" and r.died_at is None):
            state = "running"
        else:
            state = {"done": "done", "terminated": "stopped", "peer": "stopped"}.get(kind, "failed")
            if r is root:
                state = "failed"
        label = r.label(teardown_at)
        if r.blame is not None:
            state, label = "failed", r.blame
        if (r.attempt, r.rank) in self.zombies:
            state, label = "zombie", f"zombie · {label}"
        chip = Chip(state=state, label=label, attempt=r.attempt, pid=r.pid)
        if state in ("failed", "stopped", "zombie"):
            chip["detail"] = r.failure_summary()
        if r.where is not None:
            chip["node"] = r.where
        return chip


def _on_our_clock(record: dict[str, Any] | None, shift: float) -> dict[str, Any] | None:
    """A record a rank stamped with its machine's clock, on ours (who failed first is judged by
    these stamps across machines)."""
    if record is not None and shift and isinstance(record.get("time"), (int, float)):
        record["time"] = float(record["time"]) + shift
    return record
