"""A session (``%elastic up``): a rank group whose ranks stay up and run cell after cell, and come
back after a restart with the state the cells built.

The session's launcher runs `rank.session_loop.serve` in every rank; each rank connects to the
session's Unix socket (`rank_links`), and the session gives the ranks its cells, one at a time,
in the order they came, each decided by `SessionCell.decide`. The cells the kernel follows get
the session's news and the ranks' lines (`followed.Followed`).

When a rank of the current attempt dies (an exception outside a cell, os._exit, SIGKILL, an OOM
kill, NCCL's abort, or our kill of a rank stuck past an interrupt), torchelastic restarts the
whole group within the restart budget; once every new rank has said hello, the session replays
its journal (`replay`) before any other cell runs. A cell whose failure brought the restart stays
open, showing the restart and the replay as they happen, and ends once the state is back. With no
restart left, the session ends and says why. Its states and their moves: `session_state`.
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import SocketListener, TaskGroup

from elastic_nb import protocol
from elastic_nb.common.rank_state import RankState
from elastic_nb.common.spec import JobSpec
from elastic_nb.supervisor.forensics.watchdogs import Silence
from elastic_nb.supervisor.processes.site import Site
from elastic_nb.supervisor.ranks.checkpoint_log import cost_words
from elastic_nb.supervisor.ranks.evidence import EvidenceCollector
from elastic_nb.supervisor.ranks.rank_links import Link, RankLinks
from elastic_nb.supervisor.runs import cell_rules, decider, summary
from elastic_nb.supervisor.runs.rank_group import RankGroup
from elastic_nb.supervisor.runs.reporter import Reporter, Send
from elastic_nb.supervisor.runs.rounds import Machines
from elastic_nb.supervisor.sessions.followed import Followed
from elastic_nb.supervisor.sessions.hang_watch import watch_hangs
from elastic_nb.supervisor.sessions.journal import Journal, cells
from elastic_nb.supervisor.sessions.replay import replay
from elastic_nb.supervisor.sessions.session_cell import SessionCell
from elastic_nb.supervisor.sessions.session_state import LIVE, REPLAYED, State, move

__all__ = ["Session"]

# What a session's fork server imports besides torch: DDP imports torch._dynamo on first use
# (about 800 modules, 2 s here), and every replay of a cell that builds a DDP model would pay
# for it again in the new ranks (measured in benchmarks/session.py, P9: 2.9 s -> 0.3 s).
SESSION_PRELOAD = ("torch._dynamo",)


class Session(RankGroup):
    kind = "session"
    restarts_from = frozenset({"exit0"})  # its others ended: torch restarts the group

    def __init__(
        self,
        session_id: str,
        spec: JobSpec,
        env: dict[str, str],
        site: Site | None,
        send: Send,
        socket_dir: Path,
        machines: Machines | None = None,
    ) -> None:
        preload = tuple(dict.fromkeys((*spec.preload, *SESSION_PRELOAD)))
        spec = replace(spec, session=True, preload=preload)
        super().__init__(session_id, spec, site, send, machines)
        self.socket_path = socket_dir / f"session-{session_id}.sock"
        self._env = env
        self._listener: SocketListener | None = None
        self._ranks = RankLinks(
            session_id, self.book, self.until, self._ranks_changed, self._on_ran
        )
        self._changed = anyio.Event()
        self._state = State.STARTING
        self.restart_why = "torchelastic restarted the group"  # the last restart's cause
        # its cells
        self.journal = Journal()
        self.followed = Followed(self.tailer, self.memory)
        self.cells: dict[str, SessionCell] = {}
        self.cells_run = 0
        self.current: SessionCell | None = None  # the cell the ranks run (a replay's too)
        self._in, self._queue = anyio.create_memory_object_stream[SessionCell](math.inf)
        self._shown_attempt = 0  # the attempt the last cell ran on

    # ---- for the service -------------------------------------------------------------------

    @property
    def state(self) -> str:
        """The state's word; once the summary is out, the outcome's (it says more: ended,
        failed, stopped or interrupted)."""
        if self._state is State.ENDED:
            assert self.core.outcome is not None
            return self.core.outcome[0]
        word: str = self._state.value  # mypy 2.4 types a narrowed enum's value as Any
        return word

    def prepare(self) -> None:
        self.rd.make()
        self.report.open(self.rd.events)
        self.rd.spec.write_text(self.spec.to_json())
        self.report.event("created", nproc=self.spec.nproc)

    def submit(self, cell: SessionCell) -> None:
        """Queue a cell (its run directory is ready); it runs once the ones before it have."""
        if self.core.outcome is not None:
            raise RuntimeError(f"session {self.id} has ended: {self.core.outcome[1]}")
        self.cells[cell.id] = cell
        self.followed.add(cell, self.attempt)
        cell.checkpoints = self.checkpoints
        self._in.send_nowait(cell)

    def stop_cell(self, cell_id: str, reason: str) -> None:
        cell = self.cells[cell_id]
        if cell.running:
            cell.request_stop(reason)
            if cell is not self.current and cell.no is None:  # still waiting its turn
                self._close_cell(cell, *cell.stopped(), ranks=[])
            self.notify()

    def down(self, reason: str = "user") -> None:
        self._decide("ended", summary.DOWNS.get(reason, reason))

    def request_stop(self, reason: str) -> None:
        self._decide(*summary.STOPS.get(reason, ("stopped", reason)))

    def info(self) -> protocol.kernel.SessionState:
        """What ``%elastic session`` shows."""
        self.poll_checkpoints()
        ranks = []
        for r in self.book.of(self.attempt):
            linked = self._ranks.linked(r)
            state = "gone" if r.died_at else ("up" if linked else "starting")
            ranks.append(protocol.kernel.SessionRank(rank=r.rank, pid=r.pid, state=state))
        return protocol.kernel.SessionState(
            session=self.id,
            state=self.state,
            world_size=self.world_size,
            attempt=self.attempt,
            restarts=self.restarts,
            max_restarts=self.spec.max_restarts,
            ranks=ranks,
            cells_run=self.cells_run,
            journal=self.journal.info(),
            replays=self.journal.replays,
            run_dir=str(self.rd),
            checkpoint=self.checkpoint_info(),
            created=self.created,
            reason=self.ended(),
        )

    async def stacks(self) -> str:
        """Every rank's stack now, shown to the cell that runs (if one) too."""
        cell = self.current
        ranks = self.book.of(self.attempt)
        collector = EvidenceCollector(
            self.rd, self.book.site, cell.source if cell else "", cell.rd.cell if cell else None
        )
        ev = await collector.collect(ranks)
        title = f"stacks of every rank of session {self.id}, attempt {self.attempt}"
        if cell is not None:
            cell.report.alert("stacks", "info", title, text=ev.stacks)
        return f"{title}\n{ev.stacks}"

    def alert(self, kind: str, severity: str, title: str, **about: Any) -> None:
        """About the session: to its own stream and to every cell the kernel follows (`about`:
        Reporter.alert's rank, key or ends)."""
        self.report.alert(kind, severity, title, **about)
        self.followed.alert(kind, severity, title, **about)

    # ---- its state ---------------------------------------------------------------------------

    def _move(self, to: State) -> None:
        """Every change of state, and only this, moves the session (session_state.MOVES)."""
        self._state = move(self._state, to, f"session {self.id}")
        self.notify()

    def _ranks_changed(self) -> None:
        """A rank connected: once every rank of the attempt is up, the journal comes first."""
        if self._state in (State.STARTING, State.RESTARTING) and self.up():
            self._move(State.REPLAYING)
        else:
            self.notify()

    def _restarting(self) -> None:
        """The current attempt's ranks go: the next attempt's come, then the replay."""
        if self._state in LIVE:
            self._move(State.RESTARTING)
        else:
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
        """Every rank of the current attempt is connected and alive, looked at now: a death its
        watcher has not told yet counts too (a cell sent now would meet a dead rank)."""
        return self.attempt not in self.core.failed and self._ranks.up(
            self.attempt, self.world_size
        )

    def ready(self) -> bool:
        """The ranks wait for a cell."""
        return self._state is State.READY and self.up()

    # ---- the rank group's hooks ---------------------------------------------------------------

    async def _open(self) -> None:
        self._listener = await anyio.create_unix_listener(self.socket_path)
        os.chmod(self.socket_path, 0o600)

    def _launch_env(self) -> dict[str, str]:
        return {**self._env, protocol.sessions.SESSION_SOCKET_ENV: str(self.socket_path)}

    def _start_tasks(self, tg: TaskGroup) -> None:
        assert self._listener is not None
        tg.start_soon(self._listener.serve, self._ranks.serve, tg)
        tg.start_soon(self._serve_cells)
        tg.start_soon(self._keep_replayed)
        tg.start_soon(watch_hangs, self, lambda: self.current)

    def _new_attempt(self, attempt: int) -> None:
        # torchelastic restarted the group (its monitor can see a death before we do).
        self.hear(decider.AttemptOver(time.time(), self.attempt))
        self._restarting()

    def _on_rank_started(self, r: RankState) -> None:
        self.notify()

    def _rank_ended(self, r: RankState) -> None:
        """A rank of the current attempt died: the decision core says restart (within the
        budget, as a job's) or fail (`_on_restart`, `_on_decided`)."""
        self._ranks.drop(r)
        if self._state not in LIVE or r.attempt != self.attempt or r.attempt in self.core.failed:
            self.notify()
            return
        if r.attempt in self.core.replaced:  # a new round ends the attempt: no failure of its own
            self._restarting()
            return
        self.poll_checkpoints()  # a save committed just before the failure counts
        self.hear(decider.RankExited(time.time(), r))

    def _cell_act(self, action: cell_rules.CellAction) -> None:
        cell = self.cells.get(action.cell)
        if cell is not None:
            cell.act(action)

    def _on_restart(self, action: decider.Restart) -> None:
        if action.r is None and action.kind != decider.CELL_ENDED:
            # Its round failed: the round's alert says why (placement.InRounds).
            self.restart_why = action.why
            self._restarting()
            return
        why = action.why
        cost = cost_words(self.checkpoints, *self.last_failure) if self.last_failure else None
        self.restart_why = f"{why}; {cost}" if cost else why
        replays = len(self.journal.to_replay())
        self.alert(
            "restart",
            "warning",
            f"{why}: the session restarts its ranks as attempt {action.attempt + 1} "
            f"(restart {self.restarts + 1}/{self.spec.max_restarts}), then replays "
            f"{cells(replays)}" + (f"; {cost}" if cost else ""),
            rank=action.r.rank if action.r is not None else None,
            ends=action.attempt,
        )
        self._restarting()

    def _on_watchdog_line(self, attempt: int, rank: int, line: str) -> None:
        """NCCL's watchdog line in a rank's log: the running cell's (a replayed cell's rank
        aborts, and the restart replays again)."""
        cell = self.current
        if cell is not None and cell.no is not None and cell.attempt == attempt:
            cell.on_watchdog(rank, line)

    def _followers(self) -> list[Reporter]:
        return [c.report for c in self.followed.cells]

    def _asker(self) -> Reporter | None:
        cell = self.current
        return cell.report if cell is not None and cell in self.followed.cells else None

    async def _flush(self) -> None:
        await self.followed.flush(self.attempt, self.current)
        await self.report.flush(self.attempt, None)

    async def _launcher_ended(self, outcome: tuple[str, str]) -> tuple[str, str]:
        how, reason = outcome
        if how == "failed" and not self.restarts_left(self.attempt):
            m = self.spec.max_restarts
            reason = f"no restarts left ({m}/{m}): {reason}"
        return ("ended" if how == "succeeded" else how), reason

    def _on_decided(self, outcome: str) -> None:
        self._move(State.ENDING)

    async def _before_teardown(self, outcome: str) -> None:
        if outcome == "ended":
            for link in self._ranks.of(self.attempt):
                await link.send(
                    protocol.sessions.Bye(kind=protocol.sessions.BYE)
                )  # elastic_launch returns
            async with anyio.create_task_group() as tg:
                for site in self.sites:
                    tg.start_soon(site.wait_stopped, self.spec.stop_grace, False)

    def _close(self) -> None:
        with contextlib.suppress(OSError):
            self.socket_path.unlink()

    async def _relayed_rank(self, stream: Any, peer: int | None, site: Site) -> None:
        await self._ranks.serve(stream, peer, site)

    async def _summarize(self, outcome: str, reason: str) -> protocol.records.Summary:
        self.tailer.poll(final=True)
        await self.followed.end_all(reason, self.book, self.attempt, self.current)
        result = self._plain_summary(outcome, reason)
        result["session"] = self.id
        self._move(State.ENDED)
        await self.report.flush(self.attempt, None)
        return result

    def _summary_record(self, summary: protocol.records.Summary) -> dict[str, Any]:
        return {**summary, "journal": self.journal.info()}

    # ---- cells ----------------------------------------------------------------------------

    async def _serve_cells(self) -> None:
        """The cells, in the order they came, each once the ranks are ready for it."""
        async for cell in self._queue:
            await self._serve_cell(cell)

    async def _serve_cell(self, cell: SessionCell) -> None:
        while True:
            await self.until(functools.partial(self._ready_for, cell))
            if not cell.running:  # stopped while it waited
                return
            attempt = self.attempt
            dirs = await self._cell_dirs(cell)
            if dirs is not None:
                await self._run(cell, dirs)
                return
            # A machine went as the cell came, before any rank had it: it runs on the ranks of
            # the round that follows, once they have replayed the journal.
            await self.until(functools.partial(self._moved_on, attempt, cell))

    def _ready_for(self, cell: SessionCell) -> bool:
        """The ranks can take this cell, or it need not run any more (stopped while waiting)."""
        return self.ready() or not cell.running

    def _moved_on(self, attempt: int, cell: SessionCell) -> bool:
        """Past `attempt` (its ranks restarted), or the cell need not run any more."""
        return self.attempt != attempt or not cell.running

    async def _cell_dirs(self, cell: SessionCell) -> dict[int, str] | None:
        """The cell's run directory as each site's ranks see it (another machine's receives the
        cell's files first), by site; None when a machine has gone meanwhile."""
        dirs: dict[int, str] = {}
        for link in self._ranks.of(self.attempt):
            site = self.book.site(link.r)
            if id(site) not in dirs:
                where = await site.cell_dir(cell.id, cell.rd)
                if where is None:
                    return None
                dirs[id(site)] = where
        return dirs

    async def _send(self, cell: SessionCell, dirs: dict[int, str]) -> list[Link]:
        cell.sent()
        self.current = cell
        links = self._ranks.of(self.attempt)
        for link in links:
            run_dir = dirs[id(self.book.site(link.r))]
            await link.send(
                protocol.sessions.Run(kind=protocol.sessions.RUN, cell=cell.id, run_dir=run_dir)
            )
        self.notify()
        return links

    async def _run(self, cell: SessionCell, dirs: dict[int, str]) -> None:
        self.cells_run += 1
        cell.no, cell.attempt = self.cells_run, self.attempt
        if self._state is State.READY:  # else a rank went (or the session ended) meanwhile
            self._move(State.RUNNING)
        cell.report.event("run", no=cell.no, attempt=self.attempt)
        cell.report.set_state("running")
        if self.process_group_made == self.attempt:
            cell.report.process_group_made()  # an earlier cell made the ranks' process group
        self.silence = Silence(last_activity=time.monotonic())
        if self.attempt > self._shown_attempt:
            # Whether or not it waited for them, the cell runs on new ranks: say why.
            cell.report.alert(
                "restart",
                "warning",
                f"the session restarted since its last cell ({self.restart_why}): attempt "
                f"{self.attempt}, restarts {self.attempt}/{self.spec.max_restarts}, "
                f"{self.journal.words(self.attempt) or 'nothing to replay'}",
            )
        self._shown_attempt = self.attempt
        links = await self._send(cell, dirs)
        for link in links:  # its ranks run it now (their ends are its conclusion's to say)
            cell.report.chip(
                link.r.rank,
                protocol.records.Chip(
                    state="running", label="running", attempt=cell.attempt, pid=link.r.pid
                ),
            )
        outcome, reason, teardown_at, restarts = await cell.decide(links, self)
        if self.current is cell:
            self.current = None
        if self._state is State.RUNNING:
            self._move(State.READY)
        else:
            self.notify()
        if outcome == "succeeded":
            self.journal.add(cell)
        if restarts:
            # The restart and the replay show under this cell; it ends when the state is back
            # (or the kernel stops following it).
            self.task_group.start_soon(self._end_after_restart, cell, outcome, reason, teardown_at)
        else:
            self._end_cell(cell, outcome, reason, teardown_at, restarts=False)
            # Its ranks' last lines are its own: the next cell runs once they are out.
            await cell.ended.wait()

    async def _end_after_restart(
        self, cell: SessionCell, outcome: str, reason: str, teardown_at: float | None
    ) -> None:
        await self.until(
            lambda: (
                self._state not in LIVE
                or cell.stop_reason is not None
                or (self.attempt > cell.attempt and self._state in REPLAYED and self.up())
            )
        )
        self._end_cell(cell, outcome, reason, teardown_at, restarts=True)

    def _end_cell(
        self,
        cell: SessionCell,
        outcome: str,
        reason: str,
        teardown_at: float | None,
        restarts: bool,
    ) -> None:
        if not cell.running:
            return  # the session's end closed it
        self.poll_checkpoints()  # what the cell saved reaches it before its end
        ranks = cell.ranks(self.book.of(cell.attempt))
        cell.oom_alerts(ranks)
        if restarts and self._state in LIVE:
            cell.restarted_to = self.attempt
            words = self.journal.words(self.attempt)
            if words is None:
                reason += (
                    f"; the session restarts (attempt {self.attempt + 1}) and replays its cells"
                )
            else:
                reason += f"; the session restarted (attempt {self.attempt}) and {words}"
        self._close_cell(cell, outcome, reason, ranks, teardown_at)

    def _close_cell(
        self,
        cell: SessionCell,
        outcome: str,
        reason: str,
        ranks: list[RankState],
        teardown_at: float | None = None,
    ) -> None:
        logs = self.followed.conclude(cell, outcome, reason, ranks, teardown_at, self.current)
        self.task_group.start_soon(self.followed.end, cell, logs, self.attempt)

    # ---- the replay ---------------------------------------------------------------------------

    async def _keep_replayed(self) -> None:
        """Each new attempt gets the journal before any other cell (once the cell that ran on
        the attempt before has been decided)."""
        while True:
            await self.until(
                lambda: self._state is State.REPLAYING and self.current is None and self.up()
            )
            attempt = self.attempt
            await replay(self.journal, attempt, self._replay_cell, self.alert)
            if self._state is State.REPLAYING and self.attempt == attempt:
                self._move(State.READY)  # a failed replay too: the session goes on from there

    async def _replay_cell(self, cell: SessionCell) -> bool:
        """Run a journal's cell on every rank of the current attempt; False if the attempt
        ended first (a rank died: the next attempt replays again)."""
        attempt = self.attempt
        dirs = await self._cell_dirs(cell)
        if dirs is None:
            return False  # a machine went: its loss ends the attempt
        links = await self._send(cell, dirs)
        await self.until(
            lambda: (
                len(cell.answers) == len(links)
                or self.attempt != attempt
                or self._state is not State.REPLAYING
            )
        )
        self.current = None
        return len(cell.answers) == len(links)

    def _on_ran(self, link: Link, msg: protocol.sessions.Ran) -> None:
        cell = self.current
        if cell is not None and cell.id == msg["cell"]:
            cell.answer(link.r.rank, msg["ok"], {"out": msg["out"], "err": msg["err"]})
            self.notify()  # a replay waits on the session
