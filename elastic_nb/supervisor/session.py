"""A session (``%elastic up``): one elastic job whose ranks stay up and run cell after cell, and
come back after a restart with the state the cells built.

The session owns a launcher whose ranks run `session_worker.serve`. Each rank connects to the
session's Unix socket (owner-only directory; the peer's pid is checked against the pid the
agent reported), says hello, and runs the cells it is sent. Cells are `SessionCell`s, one at a
time, in the order they came; the journal keeps the ones that succeeded.

When a rank of the current attempt dies (an exception outside a cell, os._exit, SIGKILL, an OOM
kill, NCCL's abort, or our kill of a rank stuck past an interrupt), torchelastic restarts the
whole group within the restart budget; once every new rank has said hello, the session replays
its journal (minus the ``--no-replay`` cells) before any other cell runs. A cell whose failure
brought the restart stays open, showing the restart and the replay as they happen, and ends once
the state is back. With no restart left, the session ends and says why.

States: starting, ready, running (a cell), restarting, replaying; then ended, failed or stopped.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import signal
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
import psutil
from anyio.abc import TaskGroup

from elastic_nb import procs, protocol
from elastic_nb.rundir import RunDir, write_json
from elastic_nb.session_worker import SOCKET_ENV
from elastic_nb.spec import JobSpec
from elastic_nb.supervisor import summary
from elastic_nb.supervisor.evidence import EvidenceCollector
from elastic_nb.supervisor.followed import Followed
from elastic_nb.supervisor.journal import Journal
from elastic_nb.supervisor.launchers import Launcher, LauncherPool
from elastic_nb.supervisor.rankbook import RankBook
from elastic_nb.supervisor.reporter import Reporter, Send
from elastic_nb.supervisor.session_cell import SessionCell
from elastic_nb.supervisor.session_ranks import Link, RankLinks
from elastic_nb.supervisor.tailer import LogTailer
from elastic_nb.supervisor.teardown import KILL_WAIT_S, ProcessTree, unkillable
from elastic_nb.supervisor.verdict import NCCL_TIMEOUT_MARKS, TORCH_LOG_NOISE, RankState
from elastic_nb.supervisor.watchdogs import Silence

__all__ = ["Session"]

log = logging.getLogger(__name__)

POLL_S = 0.05
FLUSH_S = 0.1
EXIT_WAIT_S = 0.5


class Session:
    def __init__(
        self,
        session_id: str,
        spec: JobSpec,
        env: dict[str, str],
        send: Send,
        reap: Callable[[], None],
        orphans: Callable[[], list[psutil.Process]],
        launchers: LauncherPool,
        socket_dir: Path,
    ) -> None:
        self.id = session_id
        self.spec = replace(spec, session=True)
        self.rd = RunDir.of(spec.log_dir, session_id)
        self.created = time.time()
        self.attempt = 0
        self.summary: dict[str, Any] | None = None
        self.journal = Journal()
        self.cells_run = 0
        self.socket_path = socket_dir / f"session-{session_id}.sock"
        self._env, self._send, self._reap, self._orphans = env, send, reap, orphans
        self._launchers = launchers
        self._launcher: Launcher | None = None
        self._tree: ProcessTree | None = None
        self._book = RankBook(self.rd)
        self._report = Reporter(session_id, send)
        self._tailer = LogTailer(marks=NCCL_TIMEOUT_MARKS, noise=TORCH_LOG_NOISE)
        self._ranks = RankLinks(session_id, self._book, self._until, self._notify, self._on_ran)
        self._cells_in, self._cells = anyio.create_memory_object_stream[SessionCell](math.inf)
        self._followed = Followed(self._tailer)
        self.cells: dict[str, SessionCell] = {}
        self._current: SessionCell | None = None  # the cell the ranks run (a replay's too)
        self._replayed = -1  # the attempt whose replay is over
        self._outcome: tuple[str, str] | None = None
        self._ended = anyio.Event()
        self._changed = anyio.Event()
        self._tg: TaskGroup | None = None
        self._silence = Silence(last_activity=time.monotonic())
        self._shown_attempt = 0  # the attempt the last cell ran on
        self._restart_why = "torchelastic restarted the group"

    # ---- for the server -------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self.summary is None

    @property
    def state(self) -> str:
        if self._outcome is not None:
            return self._outcome[0] if self.summary else "ending"
        if not self._up():
            return "starting" if self.attempt == 0 else "restarting"
        if self._replayed != self.attempt:
            return "replaying"
        return "running" if self._current is not None else "ready"

    @property
    def launcher_pid(self) -> int | None:
        return self._tree.launcher.pid if self._tree else None

    def prepare(self) -> None:
        self.rd.path.mkdir(parents=True, exist_ok=False, mode=0o700)
        self._report.open(self.rd.events)
        self.rd.spec.write_text(self.spec.to_json())
        self._report.event("created", nproc=self.spec.nproc)

    def submit(self, cell: SessionCell) -> None:
        """Queue a cell (its run directory is ready); it runs once the ones before it have."""
        if self._outcome is not None:
            raise RuntimeError(f"session {self.id} has ended: {self._outcome[1]}")
        self.cells[cell.id] = cell
        self._followed.add(cell)
        self._cells_in.send_nowait(cell)

    def stop_cell(self, cell_id: str, reason: str) -> None:
        cell = self.cells[cell_id]
        if cell.running:
            cell.request_stop(reason)
            if cell is not self._current and cell.no is None:  # still waiting its turn
                self._close_cell(cell, *cell.stopped(), ranks=[])
            self._notify()

    def down(self, reason: str = "ended with %elastic down") -> None:
        self._end("ended", reason)

    def request_stop(self, reason: str) -> None:
        self._end(*summary.STOPS.get(reason, ("stopped", reason)))

    def info(self) -> dict[str, Any]:
        """What ``%elastic session`` shows."""
        ranks = []
        for r in self._book.of(self.attempt):
            linked = self._ranks.linked(r)
            state = "gone" if r.died_at else ("up" if linked else "starting")
            ranks.append({"rank": r.rank, "pid": r.pid, "state": state})
        return {
            "session": self.id,
            "state": self.state,
            "world_size": self.spec.world_size,
            "attempt": self.attempt,
            "restarts": self.attempt,
            "max_restarts": self.spec.max_restarts,
            "cells_run": self.cells_run,
            "ranks": ranks,
            "journal": self.journal.info(),
            "replays": self.journal.replays,
            "run_dir": str(self.rd),
            "created": self.created,
            "reason": self._outcome[1] if self._outcome else None,
        }

    async def stacks(self) -> str:
        """Every rank's stack now, shown to the cell that runs (if one) too."""
        cell = self._current
        ranks = self._book.of(self.attempt)
        collector = EvidenceCollector(
            self.rd, cell.source if cell else "", cell.rd.cell if cell else None
        )
        ev = await collector.collect(ranks)
        title = f"stacks of every rank of session {self.id}, attempt {self.attempt}"
        if cell is not None:
            cell.report.alert("stacks", "info", title, text=ev.stacks)
        return f"{title}\n{ev.stacks}"

    # ---- the session's life ------------------------------------------------------------------

    async def run(self) -> None:
        try:
            listener = await anyio.create_unix_listener(self.socket_path)
            os.chmod(self.socket_path, 0o600)
            launcher = self._launchers.take(self.spec, self._env)
            env = {**self._env, SOCKET_ENV: str(self.socket_path)}
            line = launcher.assign(self.id, str(self.rd), env)
            self._launcher = launcher
            self._tree = ProcessTree(self.id, launcher.proc, self._orphans)
            self._report.event("launcher", pid=launcher.pid, warm=launcher.ready)
            await anyio.to_thread.run_sync(launcher.write_assignment, line)
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(listener.serve, self._ranks.serve, tg)
                tg.start_soon(self._read_launcher, launcher)
                tg.start_soon(self._poll_loop)
                tg.start_soon(self._serve_cells)
                tg.start_soon(self._keep_replayed)
                await self._ended.wait()
                await self._teardown()
                tg.cancel_scope.cancel()
        except Exception as e:
            log.exception("session %s: supervisor error", self.id)
            self._end("failed", f"elastic_nb supervisor error: {type(e).__name__}: {e}")
        finally:
            with anyio.CancelScope(shield=True):
                self._end(*summary.STOPS["shutdown"])
                if self._tree is not None and self._tree.alive():
                    await self._teardown()
                with contextlib.suppress(OSError):
                    self.socket_path.unlink()
                await self._finish()

    def _end(self, outcome: str, reason: str) -> None:
        if self._outcome is None:
            self._outcome = (outcome, reason)
            self._report.event("decided", outcome=outcome, reason=reason)
            self._ended.set()
            self._notify()

    def _notify(self) -> None:
        """Something changed (a rank, a cell, the attempt): waiters look again."""
        self._changed.set()
        self._changed = anyio.Event()
        self._report.set_state(self.state)

    async def _until(self, ready: Callable[[], bool], timeout: float = math.inf) -> bool:
        with anyio.move_on_after(timeout):
            while not ready():
                await self._changed.wait()
            return True
        return False

    def _up(self) -> bool:
        """Every rank of the current attempt is connected and alive."""
        return self.attempt not in self._book.failed_attempts and self._ranks.up(
            self.attempt, self.spec.nproc
        )

    # ---- what a cell needs of its session (session_cell.Host) ----------------------------------

    def ended(self) -> str | None:
        return self._outcome[1] if self._outcome is not None else None

    def attempt_failed(self, attempt: int) -> bool:
        return attempt in self._book.failed_attempts

    def alert(self, kind: str, severity: str, title: str, rank: int | None = None) -> None:
        """About the session: to its own stream and to every cell the kernel follows."""
        self._report.alert(kind, severity, title, rank=rank)
        self._followed.alert(kind, severity, title, rank=rank)

    # ---- ranks --------------------------------------------------------------------------------

    async def _read_launcher(self, launcher: Launcher) -> None:
        async for msg in launcher.messages:
            kind = msg["kind"]
            self._report.event(f"launcher.{kind}", **{k: v for k, v in msg.items() if k != "kind"})
            if kind == protocol.START:
                self._on_start(int(msg["attempt"]), int(msg["rank"]), int(msg["pid"]))
            elif kind == protocol.EXIT:
                self._book.report_exit(int(msg["attempt"]), int(msg["rank"]), msg.get("code"))
            elif kind == protocol.EXITS:
                codes = {int(r): c for r, c in msg["codes"].items() if c is not None}
                for r in self._book.record_exits(int(msg["attempt"]), codes):
                    self._rank_died(r)
        with anyio.move_on_after(KILL_WAIT_S):
            await launcher.exited()
        outcome, reason = launcher.outcome(self.rd.launcher_log)
        if outcome == "failed" and self.attempt >= self.spec.max_restarts:
            reason = (
                f"no restarts left ({self.spec.max_restarts}/{self.spec.max_restarts}): {reason}"
            )
        self._end("ended" if outcome == "succeeded" else outcome, reason)

    def _on_start(self, attempt: int, rank: int, pid: int) -> None:
        if attempt > self.attempt:
            # torchelastic restarted the group (its monitor can see a death before we do).
            self._book.failed_attempts.add(self.attempt)
            self.attempt = attempt
        r = self._book.add(attempt, rank, pid, time.time())
        self._tailer.follow(
            attempt, rank, {s: self.rd.log(attempt, rank, s) for s in ("out", "err")}
        )
        assert self._tg is not None
        self._tg.start_soon(self._watch_rank, r)
        self._notify()

    async def _watch_rank(self, r: RankState) -> None:
        await self._book.wait_exit(r, self.spec.start_method == "forkserver", EXIT_WAIT_S)
        r.died_at, r.gone_at = time.time(), time.monotonic()
        self._book.read_records(r)  # a rank that failed before its loop (session run dir)
        self._report.event("rank.exit", attempt=r.attempt, rank=r.rank, code=r.exit_code)
        self._rank_died(r)

    def _rank_died(self, r: RankState) -> None:
        self._ranks.drop(r)
        book = self._book
        if (
            self._outcome is not None
            or r.attempt != self.attempt
            or r.attempt in book.failed_attempts
        ):
            self._notify()
            return
        book.failed_attempts.add(r.attempt)
        if self._current is not None:
            self._current.poke()  # it ran on this attempt: its end is decided now
        why = self._restart_why = f"rank {r.rank} {r.failure_summary()}"
        if r.attempt >= self.spec.max_restarts:
            m = self.spec.max_restarts
            self._end("failed", f"{why}; no restarts are left ({m}/{m})")
            return
        replays = len(self.journal.to_replay())
        self.alert(
            "restart",
            "warning",
            f"{why}: the session restarts its ranks as attempt {r.attempt + 1} "
            f"(restart {r.attempt + 1}/{self.spec.max_restarts}), then replays "
            f"{replays} cell{'s' if replays != 1 else ''}",
            rank=r.rank,
        )
        if r.kind(None) == "exit0":
            # torchelastic waits forever for the return value of a rank that exited 0
            # (multiprocessing/api.py, _poll): the others' deaths make it restart the group.
            self.kill([x for x in book.of(r.attempt) if x.died_at is None])
        self._notify()

    def kill(self, ranks: list[RankState]) -> None:
        for x in ranks:
            if x.pid is not None:
                procs.send_signal(x.pid, x.pidfd, signal.SIGKILL)

    def _on_ran(self, link: Link, cell_id: str, ok: bool) -> None:
        cell = self._current
        if cell is not None and cell.id == cell_id:
            cell.answer(link.r.rank, ok)
            self._notify()  # a replay waits on the session

    # ---- cells -------------------------------------------------------------------------------

    def _ready(self) -> bool:
        """The ranks wait for a cell: all up, the journal replayed, nothing running."""
        return self._up() and self._replayed == self.attempt and self._current is None

    async def _keep_replayed(self) -> None:
        """Each new attempt gets the journal before any other cell."""
        while True:
            await self._until(
                lambda: self._up() and self._replayed != self.attempt and self._current is None
            )
            await self._replay()

    async def _serve_cells(self) -> None:
        """The cells, one at a time, in the order they came."""
        async for cell in self._cells:
            await self._until(lambda cell=cell: self._ready() or not cell.running)  # type: ignore[misc]
            if cell.running:  # not stopped while it waited
                await self._run(cell)

    async def _send_cell(self, cell: SessionCell) -> list[Link]:
        cell.answers = {}
        self._current = cell
        links = self._ranks.of(self.attempt)
        for link in links:
            await link.send(protocol.RUN, cell=cell.id, run_dir=str(cell.rd))
        self._notify()
        return links

    async def _run(self, cell: SessionCell) -> None:
        self.cells_run += 1
        cell.no, cell.attempt = self.cells_run, self.attempt
        cell.report.event("run", no=cell.no, attempt=self.attempt)
        cell.report.set_state("running")
        self._silence = Silence(last_activity=time.monotonic())
        if self.attempt > self._shown_attempt:
            # Whether or not it waited for them, the cell runs on new ranks: say why.
            cell.report.alert(
                "restart",
                "warning",
                f"the session restarted since its last cell ({self._restart_why}): attempt "
                f"{self.attempt}, restarts {self.attempt}/{self.spec.max_restarts}, "
                f"{self.journal.words(self.attempt) or 'nothing to replay'}",
            )
        self._shown_attempt = self.attempt
        links = await self._send_cell(cell)
        outcome, reason, teardown_at, restarts = await cell.decide(links, self)
        if self._current is cell:
            self._current = None
        self._notify()
        if outcome == "succeeded":
            self.journal.add(cell)
        if restarts:
            # The restart and the replay (run by `_serve_cells`) show under this cell; it
            # ends when the state is back (or the kernel stops following it).
            assert self._tg is not None
            self._tg.start_soon(self._end_after_restart, cell, outcome, reason, teardown_at)
        else:
            self._end_run(cell, outcome, reason, teardown_at, restarts=False)

    async def _end_after_restart(
        self, cell: SessionCell, outcome: str, reason: str, teardown_at: float | None
    ) -> None:
        await self._until(lambda: self._settled(cell))
        self._end_run(cell, outcome, reason, teardown_at, restarts=True)

    def _end_run(
        self,
        cell: SessionCell,
        outcome: str,
        reason: str,
        teardown_at: float | None,
        restarts: bool,
    ) -> None:
        if not cell.running:
            return  # the session's end closed it
        ranks = cell.ranks(self._book.of(cell.attempt))
        cell.oom_alerts(ranks)
        if restarts and self._outcome is None:
            reason += self._restart_note()
        self._close_cell(cell, outcome, reason, ranks, teardown_at)

    def _settled(self, cell: SessionCell) -> bool:
        return (
            self._outcome is not None
            or cell.stop_reason is not None
            or (self.attempt > cell.attempt and self._up() and self._replayed == self.attempt)
        )

    def _restart_note(self) -> str:
        words = self.journal.words(self.attempt)
        if words is None:
            return f"; the session restarts (attempt {self.attempt + 1}) and replays its cells"
        return f"; the session restarted (attempt {self.attempt}) and {words}"

    async def _replay(self) -> None:
        """The journal on the new ranks, before any other cell."""
        attempt = self.attempt
        await self.journal.replay(attempt, self)
        self._replayed = attempt
        self._notify()

    # ---- what a replay needs of its session (journal.Replayer) --------------------------------

    async def run_cell(self, cell: SessionCell) -> bool:
        """Run a journal's cell on every rank of the current attempt; False if the attempt
        ended first (a rank died: the next attempt replays again)."""
        attempt = self.attempt
        links = await self._send_cell(cell)
        await self._until(
            lambda: (
                len(cell.answers) == len(links)
                or self.attempt != attempt
                or self.attempt_failed(attempt)
                or self._outcome is not None
            )
        )
        self._current = None
        return len(cell.answers) == len(links)

    def _close_cell(
        self,
        cell: SessionCell,
        outcome: str,
        reason: str,
        ranks: list[RankState],
        teardown_at: float | None = None,
    ) -> None:
        logs = self._followed.conclude(cell, outcome, reason, ranks, teardown_at, self._current)
        assert self._tg is not None
        self._tg.start_soon(self._followed.end, cell, logs, self.attempt)

    # ---- the poll loop: logs, --hang-after --------------------------------------------------

    async def _poll_loop(self) -> None:
        next_flush = 0.0
        while True:
            self._tailer.poll()
            cell = self._current
            if cell is not None and cell.running and cell.spec.hang_after is not None:
                now = time.monotonic()
                if self._silence.due(
                    now, self._tailer.activity_total(), True, cell.spec.hang_after
                ):
                    assert self._tg is not None
                    self._tg.start_soon(self._hang_alert, cell)
            if time.monotonic() >= next_flush:
                await self._followed.flush(self.attempt, self._current)
                await self._report.flush(self.attempt, None)
                next_flush = time.monotonic() + FLUSH_S
            await anyio.sleep(POLL_S)

    async def _hang_alert(self, cell: SessionCell) -> None:
        collector = EvidenceCollector(self.rd, cell.source, cell.rd.cell)
        ev = await collector.collect(self._book.of(self.attempt))
        title = f"no output from any rank for {cell.spec.hang_after:g} s (--hang-after)"
        cell.report.alert("hang", "warning", title, text=ev.stacks)

    # ---- the end ------------------------------------------------------------------------------

    async def _teardown(self) -> None:
        assert self._outcome is not None and self._tree is not None
        if self._outcome[0] == "ended":
            for link in self._ranks.of(self.attempt):
                await link.send(protocol.BYE)  # the ranks return; elastic_launch returns
            await self._tree.wait_gone(self.spec.stop_grace, leftovers_too=False)
        survivors = await self._tree.stop(
            self.spec.stop_grace,
            lambda sig, stray: self._report.event("teardown", signal=sig, stray=stray),
        )
        if survivors:
            self._report.alert(**unkillable(survivors))
        self._reap()

    async def _finish(self) -> None:
        assert self._outcome is not None
        outcome, reason = self._outcome
        self._tailer.poll(final=True)
        for cell in list(self._followed.cells):
            if cell.no is not None:
                why = ("failed", f"the session ended: {reason}")
            else:
                why = ("stopped", f"the session ended before the cell ran: {reason}")
            ranks = cell.ranks(self._book.of(cell.attempt)) if cell.no is not None else []
            logs = self._followed.conclude(cell, *why, ranks, time.time(), self._current)
            await self._followed.end(cell, logs, self.attempt)
        ended = time.time()
        self.summary = dict(
            protocol.summary(
                self.id,
                outcome,
                reason,
                world_size=self.spec.world_size,
                attempt=self.attempt,
                restarts=self.attempt,
                max_restarts=self.spec.max_restarts,
                started=self.created,
                ended=ended,
                wall_s=ended - self.created,
                run_dir=str(self.rd),
                lines=self._tailer.lines_total(),
                session=self.id,
            )
        )
        with contextlib.suppress(OSError):
            write_json(self.rd.summary, {**self.summary, "journal": self.journal.info()})
        self._report.set_state(outcome)
        await self._report.flush(self.attempt, None)
        self._report.event("end", outcome=outcome)
        if self._launcher is not None:
            summary.keep_launcher_log(self.rd, self._launcher.log_path)
            self._launchers.job_ended(self.spec, started=self._launcher.ready)
        self._tailer.close()
        self._report.close()
        await self._report.end(self.summary)
