"""A session (``%elastic up``): one elastic job whose ranks stay up and run cell after cell, and
come back after a restart with the state the cells built.

The session owns a launcher whose ranks run `session_worker.serve` and connect to the session's
Unix socket (`session_ranks`); `session_runner` gives them the cells, one at a time.

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

from elastic_nb.common import procs, protocol
from elastic_nb.common.rundir import RunDir, write_json
from elastic_nb.common.spec import JobSpec
from elastic_nb.supervisor.forensics.verdict import NCCL_TIMEOUT_MARKS, TORCH_LOG_NOISE, RankState
from elastic_nb.supervisor.processes.launcher_pool import Launcher, LauncherPool
from elastic_nb.supervisor.processes.process_tree import ProcessTree
from elastic_nb.supervisor.ranks.evidence import EvidenceCollector
from elastic_nb.supervisor.ranks.log_tailer import LogTailer
from elastic_nb.supervisor.ranks.rank_book import RankBook
from elastic_nb.supervisor.ranks.rank_links import Link, RankLinks
from elastic_nb.supervisor.runs import summary
from elastic_nb.supervisor.runs.reporter import Reporter, Send
from elastic_nb.supervisor.sessions.cell_runner import CellRunner
from elastic_nb.supervisor.sessions.session_cell import SessionCell

__all__ = ["Session"]

log = logging.getLogger(__name__)

# What a session's fork server imports besides torch: DDP imports torch._dynamo on first use
# (about 800 modules, 2 s here), and every replay of a cell that builds a DDP model would pay
# for it again in the new ranks (measured in benchmarks/session.py, P9: 2.9 s -> 0.3 s).
SESSION_PRELOAD = ("torch._dynamo",)
POLL_S = 0.05
FLUSH_S = 0.1


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
        preload = tuple(dict.fromkeys((*spec.preload, *SESSION_PRELOAD)))
        self.spec = replace(spec, session=True, preload=preload)
        self.rd = RunDir.of(spec.log_dir, session_id)
        self.created = time.time()
        self.attempt = 0
        self.summary: dict[str, Any] | None = None
        self.socket_path = socket_dir / f"session-{session_id}.sock"
        self._env, self._reap, self._orphans = env, reap, orphans
        self._launchers = launchers
        self._launcher: Launcher | None = None
        self._tree: ProcessTree | None = None
        self.book = RankBook(self.rd)
        self.report = Reporter(session_id, send)
        self.tailer = LogTailer(marks=NCCL_TIMEOUT_MARKS, noise=TORCH_LOG_NOISE)
        self._ranks = RankLinks(session_id, self.book, self.until, self.notify, self._on_ran)
        self._outcome: tuple[str, str] | None = None
        self._ended = anyio.Event()
        self._heard = anyio.Event()  # every message of the launcher taken in (book.hear_out)
        self._changed = anyio.Event()
        self._tg: TaskGroup | None = None
        self.restart_why = "torchelastic restarted the group"  # the last restart's cause
        self.runner = CellRunner(self)

    # ---- for the server -------------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self.summary is None

    @property
    def state(self) -> str:
        if self._outcome is not None:
            return self._outcome[0] if self.summary else "ending"
        if not self.up():
            return "starting" if self.attempt == 0 else "restarting"
        if self.runner.replayed != self.attempt:
            return "replaying"
        return "running" if self.runner.current is not None else "ready"

    @property
    def launcher_pid(self) -> int | None:
        return self._tree.launcher.pid if self._tree else None

    def prepare(self) -> None:
        self.rd.path.mkdir(parents=True, exist_ok=False, mode=0o700)
        self.report.open(self.rd.events)
        self.rd.spec.write_text(self.spec.to_json())
        self.report.event("created", nproc=self.spec.nproc)

    def submit(self, cell: SessionCell) -> None:
        """Queue a cell (its run directory is ready); it runs once the ones before it have."""
        if self._outcome is not None:
            raise RuntimeError(f"session {self.id} has ended: {self._outcome[1]}")
        self.runner.submit(cell)

    def stop_cell(self, cell_id: str, reason: str) -> None:
        self.runner.stop(cell_id, reason)

    def down(self, reason: str = "user") -> None:
        self._end("ended", summary.DOWNS.get(reason, reason))

    def request_stop(self, reason: str) -> None:
        self._end(*summary.STOPS.get(reason, ("stopped", reason)))

    def info(self) -> dict[str, Any]:
        """What ``%elastic session`` shows."""
        ranks = []
        for r in self.book.of(self.attempt):
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
            "ranks": ranks,
            **self.runner.info(),
            "run_dir": str(self.rd),
            "created": self.created,
            "reason": self._outcome[1] if self._outcome else None,
        }

    async def stacks(self) -> str:
        """Every rank's stack now, shown to the cell that runs (if one) too."""
        cell = self.runner.current
        ranks = self.book.of(self.attempt)
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
            launcher = await self._launchers.take(self.spec, self._env)
            env = {**self._env, protocol.SESSION_SOCKET_ENV: str(self.socket_path)}
            line = launcher.assign(self.id, str(self.rd), env)
            self._launcher = launcher
            self._tree = ProcessTree(self.id, launcher.proc, self._orphans)
            self.report.event("launcher", pid=launcher.pid, warm=launcher.ready)
            await anyio.to_thread.run_sync(launcher.write_assignment, line)
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(listener.serve, self._ranks.serve, tg)
                tg.start_soon(self._read_launcher, launcher)
                tg.start_soon(self._poll_loop)
                tg.start_soon(self.runner.run, tg)
                await self._ended.wait()
                await self._teardown()
                if not launcher.alive:
                    await self.book.hear_out(self._heard)
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
            self.report.event("decided", outcome=outcome, reason=reason)
            self._ended.set()
            self.notify()

    def notify(self) -> None:
        """Something changed (a rank, a cell, the attempt): waiters look again."""
        self._changed.set()
        self._changed = anyio.Event()
        self.report.set_state(self.state)

    async def until(self, ready: Callable[[], bool], timeout: float = math.inf) -> bool:
        with anyio.move_on_after(timeout):
            while not ready():
                await self._changed.wait()
            return True
        return False

    def up(self) -> bool:
        """Every rank of the current attempt is connected and alive."""
        return self.attempt not in self.book.failed_attempts and self._ranks.up(
            self.attempt, self.spec.nproc
        )

    # ---- what a cell needs of its session (session_cell.Host) ----------------------------------

    def ended(self) -> str | None:
        return self._outcome[1] if self._outcome is not None else None

    def attempt_failed(self, attempt: int) -> bool:
        return attempt in self.book.failed_attempts

    def alert(self, kind: str, severity: str, title: str, rank: int | None = None) -> None:
        """About the session: to its own stream and to every cell the kernel follows."""
        self.report.alert(kind, severity, title, rank=rank)
        self.runner.followed.alert(kind, severity, title, rank=rank)

    # ---- ranks --------------------------------------------------------------------------------

    async def _read_launcher(self, launcher: Launcher) -> None:
        async for msg in launcher.messages:
            kind = msg["kind"]
            self.report.event(f"launcher.{kind}", **{k: v for k, v in msg.items() if k != "kind"})
            if kind == protocol.START:
                self._on_start(int(msg["attempt"]), int(msg["rank"]), int(msg["pid"]))
            for r in self.book.take_exits(msg):
                self._rank_died(r)
        self._heard.set()
        with anyio.move_on_after(procs.KILL_WAIT_S):
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
            self.book.failed_attempts.add(self.attempt)
            self.attempt = attempt
        r = self.book.add(attempt, rank, pid, time.time())
        self.tailer.follow(
            attempt, rank, {s: self.rd.log(attempt, rank, s) for s in ("out", "err")}
        )
        assert self._tg is not None
        self._tg.start_soon(self._watch_rank, r)
        self.notify()

    async def _watch_rank(self, r: RankState) -> None:
        forked = self.spec.start_method == "forkserver"
        r.died_at, r.gone_at = await self.book.wait_exit(r, forked)
        self.book.read_records(r)  # a rank that failed before its loop (session run dir)
        self.report.event("rank.exit", attempt=r.attempt, rank=r.rank, code=r.exit_code)
        self._rank_died(r)

    def _rank_died(self, r: RankState) -> None:
        self._ranks.drop(r)
        book = self.book
        if (
            self._outcome is not None
            or r.attempt != self.attempt
            or r.attempt in book.failed_attempts
        ):
            self.notify()
            return
        book.failed_attempts.add(r.attempt)
        if self.runner.current is not None:
            self.runner.current.poke()  # it ran on this attempt: its end is decided now
        why = self.restart_why = f"rank {r.rank} {r.failure_summary()}"
        if r.attempt >= self.spec.max_restarts:
            m = self.spec.max_restarts
            self._end("failed", f"{why}; no restarts are left ({m}/{m})")
            return
        replays = len(self.runner.journal.to_replay())
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
        self.notify()

    def kill(self, ranks: list[RankState]) -> None:
        for x in ranks:
            if x.pid is not None:
                procs.send_signal(x.pid, x.pidfd, signal.SIGKILL)

    def links(self) -> list[Link]:
        """The current attempt's ranks on the line."""
        return self._ranks.of(self.attempt)

    def _on_ran(self, link: Link, cell_id: str, ok: bool) -> None:
        cell = self.runner.current
        if cell is not None and cell.id == cell_id:
            cell.answer(link.r.rank, ok)
            self.notify()  # a replay waits on the session

    # ---- the poll loop: the ranks' lines to the cells that follow --------------------------------------------------

    async def _poll_loop(self) -> None:
        next_flush = 0.0
        while True:
            self.tailer.poll()
            for attempt, rank, _, line in self.tailer.take_marked():
                self.runner.on_watchdog(attempt, rank, line)
            if time.monotonic() >= next_flush:
                await self.runner.followed.flush(self.attempt, self.runner.current)
                await self.report.flush(self.attempt, None)
                next_flush = time.monotonic() + FLUSH_S
            await anyio.sleep(POLL_S)

    # ---- the end ------------------------------------------------------------------------------

    async def _teardown(self) -> None:
        assert self._outcome is not None and self._tree is not None
        if self._outcome[0] == "ended":
            for link in self._ranks.of(self.attempt):
                await link.send(protocol.BYE)  # the ranks return; elastic_launch returns
            await self._tree.wait_gone(self.spec.stop_grace, leftovers_too=False)
        await self._tree.stop_reported(self.spec.stop_grace, self.report)
        self._reap()

    async def _finish(self) -> None:
        assert self._outcome is not None
        outcome, reason = self._outcome
        self.tailer.poll(final=True)
        await self.runner.close_all(reason)
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
                lines=self.tailer.lines_total(),
                session=self.id,
            )
        )
        with contextlib.suppress(OSError):
            write_json(self.rd.summary, {**self.summary, "journal": self.runner.journal.info()})
        self.report.set_state(outcome)
        await self.report.flush(self.attempt, None)
        self.report.event("end", outcome=outcome)
        if self._launcher is not None:
            summary.keep_launcher_log(self.rd, self._launcher.log_path)
            self._launchers.job_ended(self.spec, started=self._launcher.ready)
        self.tailer.close()
        self.report.close()
        await self.report.end(self.summary)
