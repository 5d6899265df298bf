"""One job in the supervisor: its launcher process, its ranks, its logs, and its end.

A job runs until one thing *decides* its outcome, then it tears its process tree down and
reports. What decides, first come first served:

* every rank of an attempt finished the cell and exited                  -> succeeded
* a rank failed in the last attempt the restart budget allows           -> failed
* the launcher exited (torchelastic gave up, or the launcher broke)     -> from its result
* `stop` from a client (interrupt, %elastic stop)                        -> interrupted / stopped
* the --timeout deadline                                                 -> timeout
* the supervisor shutting down (the kernel died)                         -> stopped

Deciding on our own observations rather than waiting for `elastic_launch` to return is what
makes failures fast: torchelastic notices a dead rank at its next monitor tick and formats its
report before stopping the others. Here the launcher and every process carrying the job's
marker get SIGTERM at once, the whole process group SIGKILL after the grace, and every process
of the job is accounted for before the kernel hears the end.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import psutil

from elastic_nb import procs, protocol, report
from elastic_nb.rundir import RunDir, read_json, write_atomic, write_json
from elastic_nb.spec import TEARS_DOWN, JobSpec
from elastic_nb.supervisor.desync import History
from elastic_nb.supervisor.evidence import Evidence, EvidenceCollector
from elastic_nb.supervisor.forensics import Desync
from elastic_nb.supervisor.launchers import Launcher, LauncherPool
from elastic_nb.supervisor.tailer import LogTailer
from elastic_nb.supervisor.verdict import (
    NCCL_TIMEOUT_MARKS,
    TORCH_LOG_NOISE,
    RankState,
    Verdict,
    analyze,
    watchdog_op,
    watchdog_summary,
)
from elastic_nb.supervisor.watchdogs import stuck_agent

__all__ = ["Job"]

POLL_S = 0.05  # log tail and record polling
FLUSH_S = 0.1  # one update per job per flush: at most 10 messages a second
KILL_WAIT_S = 5.0  # after SIGKILL, how long processes may take to vanish (D state)
LEFTOVER_GRACE_S = 0.5  # after a successful launcher exits, its helpers' time to follow it

Send = Callable[..., Awaitable[None]]

_STOPS = {
    "interrupt": ("interrupted", "interrupted from the kernel"),
    "user": ("stopped", "stopped with %elastic stop"),
    "handle": ("stopped", "stopped with job.stop()"),
    "button": ("stopped", "stopped with the dashboard's Stop button"),
    "shutdown": ("stopped", "the supervisor shut down (its kernel exited)"),
}
_FAILURES = (
    "exception",
    "oom",
    "host_oom",
    "collective_timeout",
    "peer",
    "exit",
    "exit0",
    "signal",
)
# The desync watch looks at the ranks' flight recorders this often once a rank has left the
# cell (a desync can become certain any moment then), and every LOOK_IDLE_S otherwise (two
# ranks stalled in different ops): a status look costs a rank 0.1 ms.
LOOK_LEFT_S = 0.25
LOOK_IDLE_S = 1.0
RELOOK_S = 1.0  # after a full look that did not confirm a finding
EXIT_WAIT_S = 0.5  # how long a forked rank's exit status may take to come from its launcher


class Job:
    def __init__(
        self,
        job_id: str,
        spec: JobSpec,
        source: str,
        meta: dict[str, Any],
        payload: bytes | None,
        env: dict[str, str],
        send: Send,
        reap: Callable[[], None],
        launchers: LauncherPool,
    ) -> None:
        self.id = job_id
        self.spec = spec
        self.rd = RunDir.of(spec.log_dir, job_id)
        self.state = "starting"
        self.attempt = 0
        self.created = time.time()
        self.last_tick: float | None = None  # the agent's monitor loop, as last heard
        self.summary: dict[str, Any] | None = None
        self._source, self._meta, self._payload, self._env = source, meta, payload, env
        self._send = send
        self._reap = reap
        self._launchers = launchers
        self._started_launcher: Launcher | None = None
        self._ranks: dict[tuple[int, int], RankState] = {}
        self._failed_attempts: set[int] = set()
        self._outcome: tuple[str, str] | None = None
        self._decided = anyio.Event()
        self._teardown_at: float | None = None
        self._launcher: subprocess.Popen[bytes] | None = None
        self._launcher_result: dict[str, Any] | None = None
        self._launcher_exits: dict[int, dict[int, int]] = {}
        self._leftovers: list[dict[str, Any]] = []
        self._tailer = LogTailer(marks=NCCL_TIMEOUT_MARKS, noise=TORCH_LOG_NOISE)
        self._tg: anyio.abc.TaskGroup | None = None
        self._pending_ranks: dict[int, dict[str, Any]] = {}
        self._pending_alerts: list[dict[str, Any]] = []
        self._state_dirty = True
        self._events: Any = None
        # forensics
        self._diagnosing: set[int] = set()  # attempts whose timeout is being diagnosed
        self._diagnosis_ended = anyio.Event()  # replaced after each end
        self._diagnosis: dict[str, Any] | None = None  # what the summary says about a desync
        self._behind: dict[int, list[int]] = {}  # attempt -> ranks a desync verdict blamed
        self._collector = EvidenceCollector(self.rd, source)
        self._last_activity = time.time()  # output, a start or an exit, by any rank
        self._lines_seen = 0
        self._hang_reported = False
        self._oom_base = procs.oom_kills()
        self._watchdog_alerts: set[int] = set()  # attempts whose NCCL timeouts end nothing
        self._deferred: list[tuple[RankState, str]] = []  # failures seen while diagnosing
        self._watchdog_fired = False
        self._zombies: set[tuple[int, int]] = set()  # (attempt, rank) dead and left unreaped
        self._exits: dict[tuple[int, int], anyio.Event] = {}  # forked ranks' reported ends

    # ---- for the server -----------------------------------------------------------------

    @property
    def launcher_pid(self) -> int | None:
        return self._launcher.pid if self._launcher else None

    @property
    def running(self) -> bool:
        return self.summary is None

    def request_stop(self, reason: str) -> None:
        self._decide(*_STOPS.get(reason, ("stopped", reason)))

    def info(self) -> dict[str, Any]:
        return {
            "job": self.id,
            "state": self.state,
            "attempt": self.attempt,
            "world_size": self.spec.world_size,
            "run_dir": str(self.rd),
            "created": self.created,
            "outcome": self.summary["outcome"] if self.summary else None,
            "wall_s": self.summary["wall_s"] if self.summary else time.time() - self.created,
        }

    async def run(self) -> None:
        try:
            if self._outcome is not None:
                return  # stopped before it started
            await self._start_launcher()
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._read_launcher)
                tg.start_soon(self._poll_loop)
                tg.start_soon(self._watch_desync)
                await self._decided.wait()
                # Rank watchers and the launcher reader keep running through the teardown:
                # they record how and when each process ended.
                await self._teardown()
                tg.cancel_scope.cancel()
        except Exception as e:  # a bug of ours must still end the job cleanly
            self._decide("failed", f"elastic_nb supervisor error: {type(e).__name__}: {e}")
            self._log_event("internal_error", error=repr(e))
        finally:
            with anyio.CancelScope(shield=True):
                self._decide(*_STOPS["shutdown"])
                if self._launcher is not None and self._alive():
                    await self._teardown()
                await self._finish()

    # ---- start ----------------------------------------------------------------------------

    def prepare(self) -> None:
        """Create the run directory; a failure here is the submitter's error, not a job's."""
        self.rd.path.mkdir(parents=True, exist_ok=False, mode=0o700)  # logs, env: owner only
        self._events = open(self.rd.events, "a", buffering=1)  # noqa: SIM115
        self.rd.spec.write_text(self.spec.to_json())
        self.rd.cell.write_text(self._source)
        write_json(self.rd.cell_meta, self._meta)
        if self._payload:
            write_atomic(self.rd.payload, self._payload)
            self._payload = None  # on disk now; a pushed model need not stay in our memory
        self._log_event("created", nproc=self.spec.nproc)

    async def _start_launcher(self) -> None:
        """Take a launcher (the warm one, or a new one) and give it this job."""
        env = dict(self._env)
        env[procs.MARKER] = self.id
        env["ELASTIC_NB_SUPERVISOR_PID"] = str(os.getpid())
        if "matplotlib_inline" in env.get("MPLBACKEND", ""):
            env["MPLBACKEND"] = "Agg"  # the kernel's inline backend means nothing in a rank
        launcher = self._launchers.take(self.spec, self._env)
        line = launcher.assign(self.id, str(self.rd), env)  # before any await: it is ours now
        self._started_launcher, self._launcher = launcher, launcher.proc
        self._log_event("launcher", pid=launcher.pid, warm=launcher.ready)
        if launcher.ready:
            self._set_state("rendezvous")
        await anyio.to_thread.run_sync(launcher.write_assignment, line)

    # ---- observing ------------------------------------------------------------------------

    async def _read_launcher(self) -> None:
        assert self._started_launcher is not None and self._launcher is not None
        await self._started_launcher.pipe_released()
        async for msg in self._started_launcher.messages():
            self._on_launcher(msg)
        # The pipe's write end lives only in the launcher: EOF means it is exiting.
        with anyio.move_on_after(KILL_WAIT_S):
            while self._launcher.poll() is None:
                await anyio.sleep(0.02)
        # torchelastic gives up the moment a rank fails; a diagnosis under way (stacks taken
        # while the others were still alive) decides first, or its verdict would be lost.
        while self._diagnosing:
            await self._diagnosis_ended.wait()
        self._decide_from_launcher()

    def _on_launcher(self, msg: dict[str, Any]) -> None:
        kind = msg["kind"]
        if kind == protocol.TICK:
            self.last_tick = time.time()
            return
        self._log_event(f"launcher.{kind}", **{k: v for k, v in msg.items() if k != "kind"})
        if kind == protocol.READY:
            assert self._started_launcher is not None
            self._started_launcher.ready = True
            self._set_state("rendezvous")
        elif kind == protocol.START:
            self._on_start(int(msg["attempt"]), int(msg["rank"]), int(msg["pid"]))
        elif kind == protocol.EXIT:
            r = self._ranks.get((int(msg["attempt"]), int(msg["rank"])))
            if r is not None and r.exit_code is None and msg.get("code") is not None:
                r.exit_code = int(msg["code"])
                self._exit_reported(r).set()  # _watch_rank waits for it
        elif kind == protocol.EXITS:
            attempt = int(msg["attempt"])
            codes = {int(r): c for r, c in msg["codes"].items() if c is not None}
            self._launcher_exits[attempt] = codes
            for rank, code in codes.items():
                r = self._ranks.get((attempt, rank))
                if r is not None and r.exit_code is None:
                    r.exit_code = code
                    self._exit_reported(r).set()
                    if r.died_at is not None:
                        self._evaluate(r)  # its exit was unknown when its pidfd fired
        elif kind == protocol.RESULT:
            self._launcher_result = msg

    def _on_start(self, attempt: int, rank: int, pid: int) -> None:
        if attempt > self.attempt:
            self._announce_restart(attempt)
            self.attempt = attempt
        r = RankState(attempt, rank, pid=pid, started_at=time.time())
        self._last_activity = self.last_tick = r.started_at  # a start is a sign of life
        self._ranks[(attempt, rank)] = r
        self._tailer.follow(
            attempt, rank, {s: self.rd.log(attempt, rank, s) for s in ("out", "err")}
        )
        self._pending_ranks[rank] = self._chip(r)
        self._set_state("running")
        assert self._tg is not None
        self._tg.start_soon(self._watch_rank, r)
        if attempt == 0 and len(self._attempt_ranks(0)) == self.spec.nproc:
            self._launchers.job_running(self.spec)

    def _announce_restart(self, attempt: int) -> None:
        verdict = analyze(self._attempt_ranks(attempt - 1), None, self._behind.get(attempt - 1))
        root = verdict.root
        if verdict.cause == "desync" and self._diagnosis:
            why = f"desync: {self._diagnosis['text']}"
        else:
            why = f"rank {root.rank} {root.failure_summary()}" if root else "it failed"
        self._alert(
            "restart",
            "warning",
            f"attempt {attempt - 1} failed: {why}; restarting as attempt {attempt} "
            f"(restart {attempt}/{self.spec.max_restarts})",
            rank=root.rank if root else None,
        )

    async def _watch_rank(self, r: RankState) -> None:
        assert r.pid is not None
        fd = procs.pidfd_open(r.pid)
        if fd is None:  # no pidfd (old kernel) or already gone
            while procs.zombie_exit_code(r.pid) is None and psutil.pid_exists(r.pid):
                await anyio.sleep(POLL_S)
        else:
            r.pidfd = fd
            try:
                await anyio.wait_readable(fd)
            finally:
                r.pidfd = None
                os.close(fd)
        died = self._last_activity = time.time()
        # A spawned rank is the agent's child: read its status now, before torchelastic reaps
        # it at its next monitor tick. A forked one is its fork server's, reaped at once: the
        # launcher says how it ended (protocol.EXIT), within milliseconds. Until then the rank
        # counts as alive (died_at unset), so that nothing evaluates it without its status.
        if r.exit_code is None:
            r.exit_code = procs.zombie_exit_code(r.pid)
        if r.exit_code is None and self.spec.start_method == "forkserver":
            with anyio.move_on_after(EXIT_WAIT_S):
                await self._exit_reported(r).wait()
        r.died_at = died
        r.oom_killed = procs.oom_kills() > self._oom_base
        self._read_records(r)
        self._log_event("rank.exit", attempt=r.attempt, rank=r.rank, code=r.exit_code)
        self._evaluate(r)

    def _exit_reported(self, r: RankState) -> anyio.Event:
        return self._exits.setdefault((r.attempt, r.rank), anyio.Event())

    def _read_records(self, r: RankState) -> None:
        if r.done is None:
            r.done = read_json(self.rd.done(r.attempt, r.rank))
        if r.failure is None and r.done is None:
            r.failure = read_json(self.rd.failure(r.attempt, r.rank))

    def _chip(self, r: RankState) -> dict[str, Any]:
        """What a dashboard shows for one rank: a state to colour it by, a few words, and the
        whole story for a failed or stopped one."""
        kind = r.kind(self._teardown_at)
        if kind == "running" or (kind == "done" and r.died_at is None):
            state = "running"
        else:
            state = {"done": "done", "terminated": "stopped"}.get(kind, "failed")
        label = r.label(self._teardown_at)
        if r.blame is not None:
            state, label = "failed", r.blame
        if (r.attempt, r.rank) in self._zombies:
            state, label = "zombie", f"zombie · {label}"
        chip: dict[str, Any] = {"state": state, "label": label, "attempt": r.attempt, "pid": r.pid}
        if state in ("failed", "stopped", "zombie"):
            chip["detail"] = r.failure_summary()
        return chip

    def _evaluate(self, r: RankState) -> None:
        if r.attempt == self.attempt:
            self._pending_ranks[r.rank] = self._chip(r)
        kind = r.kind(self._teardown_at)
        if kind in _FAILURES:
            self._on_rank_failed(r, kind)
        elif kind == "done":
            ranks = self._attempt_ranks(r.attempt)
            if len(ranks) == self.spec.nproc and all(x.done and x.died_at for x in ranks):
                self._decide("succeeded", "every rank finished the cell")

    def _on_rank_failed(self, r: RankState, kind: str) -> None:
        if kind == "oom" and r.failure is not None:
            self._alert_oom(r)
        self._decide_rank_failed(r, kind)

    def _decide_rank_failed(self, r: RankState, kind: str) -> None:
        if r.attempt in self._failed_attempts:
            return
        if r.attempt in self._diagnosing:
            self._deferred.append((r, kind))  # decided once the diagnosis under way has ended
            return
        if kind == "collective_timeout" and r.attempt == self.attempt:
            # Hold the decision until every live rank's stack is on disk: the teardown would
            # destroy the evidence of where the others were.
            self._diagnosing.add(r.attempt)
            assert self._tg is not None
            self._tg.start_soon(self._diagnose_timeout, r, kind)
            return
        self._fail_attempt(r, kind)

    def _fail_attempt(self, r: RankState, kind: str, reason: str | None = None) -> None:
        self._failed_attempts.add(r.attempt)
        self._log_event("attempt.failed", attempt=r.attempt, rank=r.rank, kind=kind)
        # An exit(0) without finishing leaves torchelastic waiting forever for a return value
        # (multiprocessing/api.py, _poll): no restart would come, so it ends the job.
        if r.attempt >= self.spec.max_restarts or kind == "exit0":
            self._decide("failed", reason or f"rank {r.rank} {r.failure_summary()}")
            return
        self._set_state("restarting")
        if kind == "desync":
            # In torch's eyes nothing has failed: the waiting ranks would sit in their
            # collective until its timeout. Ending them makes the agent restart the group now.
            for x in self._attempt_ranks(r.attempt):
                if x.pid is not None and x.died_at is None and x.done is None:
                    procs.send_signal(x.pid, x.pidfd, signal.SIGTERM)

    def _attempt_ranks(self, attempt: int) -> list[RankState]:
        return [r for (a, _), r in sorted(self._ranks.items()) if a == attempt]

    async def _poll_loop(self) -> None:
        next_flush = 0.0
        while True:
            self._tailer.poll()
            for attempt, rank, _, line in self._tailer.take_marked():
                self._on_watchdog(attempt, rank, line)
            for r in self._attempt_ranks(self.attempt):
                if r.died_at is None and r.failure is None and r.done is None:
                    # Records land before the process exits (torch and Python teardown can
                    # take a while): act on a failure at once. Read once a poll, for everyone.
                    self._read_records(r)
                    if r.failure is not None:
                        self._evaluate(r)
            if self.spec.timeout is not None and time.time() - self.created > self.spec.timeout:
                self._decide("timeout", f"the --timeout of {self.spec.timeout:g} s passed")
            self._watch_agent()
            self._watch_silence()
            if time.monotonic() >= next_flush:
                await self._flush()
                next_flush = time.monotonic() + FLUSH_S
            await anyio.sleep(POLL_S)

    def _on_watchdog(self, attempt: int, rank: int, line: str) -> None:
        """NCCL's watchdog says this rank's collective timed out. The rank lives on for a
        minute (the flight recorder's dump, then SIGABRT): diagnose now, while every rank can
        still show where it is."""
        r = self._ranks.get((attempt, rank))
        if r is None or r.watchdog is not None or r.failure is not None:
            return
        self._log_event("rank.watchdog", attempt=attempt, rank=rank, line=line)
        if self.spec.async_error_handling in TEARS_DOWN:
            r.watchdog = {"time": time.time(), "line": line}
            self._evaluate(r)
        elif attempt not in self._watchdog_alerts:
            # The rank lives on and the error may reach the cell, which may handle it: say
            # where every rank is (once an attempt: every rank's watchdog says it), end nothing.
            self._watchdog_alerts.add(attempt)
            what = watchdog_summary(line)
            title = f"rank {rank}: {what}; it lives on (--async-error-handling "
            title += f"{self.spec.async_error_handling})"
            assert self._tg is not None
            self._tg.start_soon(self._report_where, "collective_timeout", title)

    def _decide_from_launcher(self) -> None:
        assert self._launcher is not None
        result = self._launcher_result
        if result and result.get("ok"):
            self._decide("succeeded", "elastic_launch returned")
        elif result:
            self._decide("failed", f"torchelastic gave up: {result.get('error')}")
        else:
            how = procs.describe_exit(self._launcher.poll())
            self._decide("failed", f"the launcher {how} (see {self.rd.launcher_log})")

    # ---- forensics ------------------------------------------------------------------------

    @property
    def zombie_bound_s(self) -> float:
        """How long a dead rank may stay unreaped, or the agent's loop silent, before the
        watchdog calls the agent stuck: a few monitor passes and one tick period past 1 s."""
        return 1.0 + 3 * self.spec.monitor_interval + protocol.TICK_EVERY_S

    async def stacks(self) -> str:
        """Every rank's stack now (``%elastic stacks``); also shown as an alert."""
        ev = await self._evidence()
        title = f"stacks of every rank, attempt {self.attempt}"
        if ev.desync is not None and ev.desync.behind:
            title += f": {ev.desync.text}"
        self._alert("stacks", "info", title, text=ev.stacks)
        return f"{title}\n{ev.stacks}"

    async def _diagnose_timeout(self, r: RankState, kind: str) -> None:
        try:
            ev = await self._evidence()
            desync = ev.desync
            op = ev.where[r.rank].collective() if r.rank in ev.where else None
            timeout = self.spec.collective_timeout
            after = f" after {timeout:g} s" if timeout else ""
            if r.watchdog is not None:  # its own words: the op, and the timeout it had
                op, after = watchdog_op(r.watchdog["line"]) or op, ""
            title = f"rank {r.rank} timed out in {op or 'a collective'}{after}"
            if desync is not None:
                title += f": {desync.text}"
                self._blame(r.attempt, desync)
            self._diagnosis = {
                "text": desync.text if desync else None,
                "hint": desync.hint if desync else None,
                "stacks": ev.stacks,
            }
            culprit = desync.behind[0] if desync is not None and desync.behind else r.rank
            self._alert("collective_timeout", "error", title, rank=culprit, text=ev.stacks)
        finally:
            self._diagnosing.discard(r.attempt)
            self._fail_attempt(r, kind)
            self._decide_deferred()

    async def _watch_desync(self) -> None:
        """Find a desync the moment it can no longer resolve (`desync.find_certain`: a rank
        left the cell while another waits in a later collective of its group, or two ranks
        wait in different ops at the same number), not when the collective timeout ends it."""
        if self.spec.nproc < 2:
            return  # one rank cannot fall out of step with itself
        before: dict[int, History] = {}
        looked = 0.0
        unconfirmed: dict[str, float] = {}  # findings a full look did not bear out, and when
        while True:
            await anyio.sleep(LOOK_LEFT_S)
            ranks = self._attempt_ranks(self.attempt)
            left = any(r.done is not None for r in ranks)
            live = [r for r in ranks if r.died_at is None and r.done is None and r.failure is None]
            if (
                self._outcome is not None
                or self._diagnosing
                or self.state != "running"
                or len(ranks) < self.spec.nproc
                or self.attempt in self._failed_attempts
                or not live
            ):
                before = {}
                continue
            if not left and time.monotonic() - looked < LOOK_IDLE_S:
                continue
            looked = time.monotonic()
            before, certain = await self._collector.look(ranks, before)
            if certain is None or self._outcome is not None or self._diagnosing:
                continue
            # A look that did not bear a finding out (a rank too busy to answer in time) is
            # taken again, but not at every pass: each one dumps every rank's stack.
            key = repr((self.attempt, certain.kind, [(w.rank, w.seq) for w in certain.waiters]))
            if time.monotonic() - unconfirmed.get(key, -RELOOK_S) < RELOOK_S:
                continue
            if not await self._diagnose_desync(self.attempt):
                unconfirmed[key] = time.monotonic()

    async def _diagnose_desync(self, attempt: int) -> bool:
        """Take the stacks and a full look; if the desync holds, report it and end the attempt."""
        self._diagnosing.add(attempt)
        try:
            ev = await self._evidence()
            desync = ev.desync
            if (
                desync is None
                or not desync.certain
                or attempt != self.attempt
                or self._outcome is not None
            ):
                # The full look did not bear it out: keep watching (and keep the record).
                self._log_event(
                    "desync.unconfirmed",
                    looked={r: {"last": h.last, "left": h.left} for r, h in ev.histories.items()},
                    verdict=desync.text if desync else None,
                )
                return False
            self._blame(attempt, desync)
            self._diagnosis = {"text": desync.text, "hint": desync.hint, "stacks": ev.stacks}
            culprit = self._ranks[(attempt, desync.behind[0])]
            self._alert(
                "desync", "error", f"desync: {desync.text}", rank=culprit.rank, text=ev.stacks
            )
            self._fail_attempt(culprit, "desync", reason=f"desync: {desync.text}")
            return True
        finally:
            self._diagnosing.discard(attempt)
            self._decide_deferred()

    def _decide_deferred(self) -> None:
        """Failures that came while a diagnosis held the attempt: an unconfirmed desync must
        not swallow a rank's own exception."""
        self._diagnosis_ended.set()
        self._diagnosis_ended = anyio.Event()
        deferred, self._deferred = self._deferred, []
        for r, kind in deferred:
            self._decide_rank_failed(r, kind)

    def _blame(self, attempt: int, desync: Desync) -> None:
        """Say on each culprit's chip what it did: a rank that left early exited 0, but it is
        the one that broke the group."""
        self._behind[attempt] = desync.behind
        for rank, note in desync.notes.items():
            r = self._ranks.get((attempt, rank))
            if r is not None:
                r.blame = note
                self._pending_ranks[rank] = self._chip(r)

    async def _report_where(self, kind: str, title: str) -> None:
        """An alert with every rank's stack and what they say of a desync; nothing ends."""
        ev = await self._evidence()
        if ev.desync is not None:
            title += f": {ev.desync.text}"
        culprit = ev.desync.behind[0] if ev.desync is not None and ev.desync.behind else None
        self._alert(kind, "warning", title, rank=culprit, text=ev.stacks)

    async def _evidence(self) -> Evidence:
        """Where every rank of the current attempt is and what it ran, from fresh records."""
        ranks = self._attempt_ranks(self.attempt)
        for r in ranks:
            self._read_records(r)
        return await self._collector.collect(ranks)

    def _alert_oom(self, r: RankState) -> None:
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
        hint = (
            "if this rank's error is caught and it skips a collective (e.g. backward()), the "
            "other ranks wait in that collective until --collective-timeout: a desync"
        )
        text = "\n".join(x for x in (mem.get("summary"), mem.get("error"), hint) if x)
        self._alert("oom", "error", title, rank=r.rank, text=text)

    def _watch_silence(self) -> None:
        """--hang-after: no new line and no start or exit from any rank for that long, while
        the ranks run the cell. A rank still starting its interpreter is busy, not silent (and
        has no stack to show yet); ranks that all finished the cell are the agent's to reap
        (the zombie watchdog's business)."""
        now = time.time()
        lines = self._tailer.activity_total()
        if lines != self._lines_seen or not self._in_the_cell():
            self._lines_seen, self._last_activity, self._hang_reported = lines, now, False
        if (
            self.spec.hang_after is None
            or self._hang_reported
            or self._outcome is not None
            or self.state != "running"
            or self._diagnosing
            or now - self._last_activity < self.spec.hang_after
        ):
            return
        self._hang_reported = True  # once per silence; output re-arms it
        assert self._tg is not None
        silent_for = now - self._last_activity
        title = f"no output and no exit from any rank for {silent_for:.0f} s (--hang-after)"
        self._tg.start_soon(self._report_where, "hang", title)

    def _in_the_cell(self) -> bool:
        """Every live rank of this attempt runs our bootstrap (it arms its stack dump first
        thing) and one of them has yet to finish the cell."""
        live = [r for r in self._attempt_ranks(self.attempt) if r.died_at is None]
        for r in live:
            if not r.armed:
                r.armed = self.rd.stacks(r.attempt, r.rank).exists()
                if not r.armed:
                    return False
        return any(r.done is None and r.failure is None for r in live)

    def _watch_agent(self) -> None:
        """The zombie watchdog (`watchdogs.stuck_agent` judges): say so, and stop the launcher,
        SIGTERM breaks the agent's stuck wait."""
        launcher = self._launcher
        if self._watchdog_fired or launcher is None or launcher.poll() is not None:
            return
        state = procs.proc_state(launcher.pid)
        current = self._attempt_ranks(self.attempt)
        stuck = stuck_agent(
            self._ranks.values(),
            current,
            self.spec.nproc,
            time.time(),
            self.zombie_bound_s,
            self._teardown_at,
            self.last_tick,
            ticking=self._outcome is None and self.state == "running",
            launcher_stopped=state is not None and state[0] in "Tt",
            unreaped=lambda pid: procs.zombie_exit_code(pid) is not None,
        )
        if stuck is None:
            return
        why, zombie = stuck
        if zombie is not None:
            self._zombies.add((zombie.attempt, zombie.rank))
            self._pending_ranks[zombie.rank] = self._chip(zombie)
        self._watchdog_fired = True
        finished = [r.rank for r in current if r.done is not None]
        title = f"torchelastic's agent is stuck (zombie): {why}"
        if state is not None:
            title += f"; the launcher (pid {launcher.pid}) is {state[1]}"
        if finished:
            title += f"; rank{'s' if len(finished) > 1 else ''} "
            title += ", ".join(map(str, finished)) + " had finished the cell"
        self._alert("zombie", "error", title + "; stopping it")
        if len(finished) == self.spec.nproc:
            self._decide("succeeded", "every rank finished the cell; the agent then got stuck")
        else:
            self._decide("failed", f"torchelastic's agent got stuck: {why}")

    # ---- ending ---------------------------------------------------------------------------

    def _decide(self, outcome: str, reason: str) -> None:
        if self._outcome is not None:
            return
        self._outcome = (outcome, reason)
        if outcome != "succeeded":
            self._teardown_at = time.time()
        self._log_event("decided", outcome=outcome, reason=reason)
        self._decided.set()

    async def _teardown(self) -> None:
        """Leave nothing behind: SIGTERM the group, grace, SIGKILL, then account for every
        process with the job's marker (a rank may have started a session of its own)."""
        assert self._outcome is not None and self._launcher is not None
        if self._outcome[0] == "succeeded":
            # torch has joined the ranks; the launcher is on its way out. Whatever else still
            # carries the marker after that was left behind by the cell.
            with anyio.move_on_after(self.spec.stop_grace):
                while self._alive(leftovers_too=False) and not self._watchdog_fired:
                    await anyio.sleep(POLL_S)
            if self._launcher.poll() is not None:
                # Helpers of the launcher (multiprocessing's resource tracker, a fork server)
                # exit on their own once it has gone: give them a moment before blaming the cell.
                await self._wait_gone(LEFTOVER_GRACE_S)
                self._leftovers = [_describe(p) for p in procs.job_processes([self.id])]
        for sig, wait in ((signal.SIGTERM, self.spec.stop_grace), (signal.SIGKILL, KILL_WAIT_S)):
            if not self._alive():
                break
            if self._teardown_at is None:
                self._teardown_at = time.time()
            if sig == signal.SIGTERM:
                # The launcher and every process marked with the job, not the whole group: the
                # fork server lives on to tell the launcher how each forked rank ended, and exits
                # when the launcher does. SIGKILL, if it comes to that, takes the whole group.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self._launcher.pid, sig)
                procs.signal_group(self._launcher.pid, signal.SIGCONT)  # a stopped one too
            else:
                procs.signal_group(self._launcher.pid, sig)
            stray = procs.kill_job([self.id], sig)
            self._log_event("teardown", signal=signal.Signals(sig).name, stray=stray)
            await self._wait_gone(wait)
        survivors = [p.pid for p in procs.job_processes([self.id])]
        if self._launcher.poll() is None:
            survivors.insert(0, self._launcher.pid)
        if survivors:
            self._log_event("teardown_failed", pids=survivors)
            states = [(pid, procs.proc_state(pid)) for pid in survivors]
            self._alert(
                "unkillable",
                "error",
                f"{len(survivors)} process(es) of the job survived SIGKILL",
                text="\n".join(f"pid {pid}: {st[1] if st else 'gone'}" for pid, st in states),
            )
        self._reap()

    def _alive(self, leftovers_too: bool = True) -> bool:
        assert self._launcher is not None
        if self._launcher.poll() is None:
            return True
        return leftovers_too and bool(procs.job_processes([self.id]))

    async def _wait_gone(self, timeout: float, leftovers_too: bool = True) -> None:
        with anyio.move_on_after(timeout):
            while self._alive(leftovers_too):
                await anyio.sleep(POLL_S)

    async def _finish(self) -> None:
        assert self._outcome is not None
        outcome, reason = self._outcome
        try:
            self.summary = await self._final_summary(outcome, reason)
        except Exception as e:  # the kernel must hear the end whatever broke here
            self._log_event("internal_error", error=repr(e))
            self.summary = self._summarize(outcome, reason, Verdict(None, None, []))
            self.summary["reason"] += f" (elastic_nb could not analyse it: {e!r})"
        with contextlib.suppress(OSError):
            write_json(self.rd.summary, self.summary)
        self._log_event("end", outcome=outcome)
        launcher = self._started_launcher
        if launcher is not None:
            self._keep_launcher_log(launcher)
            self._launchers.job_ended(self.spec, started=launcher.ready)
        self._tailer.close()
        if self._events is not None:
            self._events.close()
        await self._send(protocol.END, job=self.id, summary=self.summary)

    async def _final_summary(self, outcome: str, reason: str) -> dict[str, Any]:
        if self._launcher is not None and self._launcher.stdout is not None:
            self._launcher.stdout.close()
        self._tailer.poll(final=True)
        for r in self._ranks.values():
            self._read_records(r)
            if r.died_at is None:
                r.died_at = time.time()  # gone by now: the teardown saw to it
            if r.exit_code is None:
                r.exit_code = self._launcher_exits.get(r.attempt, {}).get(r.rank)
            if r.attempt == self.attempt:
                self._pending_ranks[r.rank] = self._chip(r)
        if self._leftovers:
            pids = ", ".join(f"{p['pid']} ({p['cmd']})" for p in self._leftovers)
            self._alert(
                "leftovers",
                "warning",
                f"stopped {len(self._leftovers)} process(es) the cell left running: {pids}",
            )
        if outcome == "succeeded":
            # SIGTERM/SIGKILL after finishing is the agent closing the group, nothing more.
            stops = (0, None, -signal.SIGTERM, -signal.SIGKILL)
            for r in self._attempt_ranks(self.attempt):
                if r.exit_code not in stops:
                    self._alert(
                        "exit_after_done",
                        "warning",
                        f"rank {r.rank} finished the cell, then {procs.describe_exit(r.exit_code)} "
                        "while exiting",
                        rank=r.rank,
                    )
        verdict = analyze(
            self._attempt_ranks(self.attempt),
            self._teardown_at,
            self._behind.get(self.attempt),
            self.spec.nproc,
        )
        summary = self._summarize(outcome, reason, verdict)
        if outcome in ("failed", "timeout"):
            # The same words as the error the cell raises, for renderers that show alerts.
            f = summary["failure"]
            self._alert(
                "failure",
                "error",
                report.failure_headline(summary),
                rank=f["rank"] if f else None,
                text="\n".join(report.failure_report(summary)).strip("\n"),
            )
        self._set_state(outcome)
        await self._flush()
        return summary

    def _summarize(self, outcome: str, reason: str, verdict: Verdict) -> dict[str, Any]:
        root = verdict.root
        failure = None
        if outcome == "failed" and root is not None:
            cause = "zombie" if self._watchdog_fired else verdict.cause
            summary = root.failure_summary()
            if cause == "desync" and self._diagnosis and self._diagnosis["text"]:
                summary = self._diagnosis["text"]
            failure = {
                "rank": root.rank,
                "attempt": root.attempt,
                "cause": cause,
                "summary": summary,
                "hint": self._diagnosis.get("hint")
                if cause == "desync" and self._diagnosis
                else None,
                "record": root.failure,
                "exit_code": root.exit_code,
            }
        ended = time.time()
        return {
            "job": self.id,
            "outcome": outcome,
            "reason": reason,
            "cause": _cause(outcome, failure, self._watchdog_fired),
            "world_size": self.spec.world_size,
            "attempt": self.attempt,
            "restarts": self.attempt,
            "max_restarts": self.spec.max_restarts,
            "worst_case_s": self.spec.worst_case_s,
            "started": self.created,
            "ended": ended,
            "wall_s": ended - self.created,
            "run_dir": str(self.rd),
            "failure": failure,
            "diagnosis": self._diagnosis if outcome == "failed" else None,
            "others": verdict.others if outcome != "succeeded" else [],
            "launcher_log_tail": self._launcher_log_tail()
            if outcome == "failed" and failure is None
            else None,
            "leftovers": self._leftovers,
            "result": self.rd.result(self.attempt).exists(),
            "lines": self._tailer.lines_total(),
        }

    def _keep_launcher_log(self, launcher: Launcher) -> None:
        """A launcher that died before it took the job left its log where it was started."""
        with contextlib.suppress(OSError):
            text = launcher.log_path.read_bytes()
            with open(self.rd.launcher_log, "ab") as f:
                f.write(text)
            launcher.log_path.unlink()

    def _launcher_log_tail(self, n: int = 15) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(self.rd.launcher_log.read_text(errors="replace").splitlines()[-n:])
        return ""

    # ---- reporting ------------------------------------------------------------------------

    def _set_state(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self._state_dirty = True
            self._log_event("state", state=state)

    def _alert(
        self, kind: str, severity: str, title: str, rank: int | None = None, text: str | None = None
    ) -> None:
        """A typed event any renderer can show: what, how bad, which rank, optional detail."""
        alert = {
            "kind": kind,
            "severity": severity,
            "title": title,
            "rank": rank,
            "text": text,
            "time": time.time(),
        }
        self._pending_alerts.append(alert)
        self._log_event("alert", **alert)

    async def _flush(self) -> None:
        update: dict[str, Any] = {}
        if self._state_dirty:
            update.update(state=self.state, attempt=self.attempt)
            self._state_dirty = False
        if self._pending_ranks:
            update["ranks"] = {str(k): v for k, v in self._pending_ranks.items()}
            self._pending_ranks = {}
        if self._pending_alerts:
            update["alerts"], self._pending_alerts = self._pending_alerts, []
        logs = [
            [b.attempt, b.rank, b.stream, b.lines, b.skipped, b.progress]
            for b in self._tailer.take()
        ]
        if logs:
            update["logs"] = logs
        if update:
            # Taken from the pending lists above: a cancellation mid-send would lose it.
            with anyio.CancelScope(shield=True):
                await self._send(protocol.UPDATE, job=self.id, **update)

    def _log_event(self, event: str, **fields: Any) -> None:
        if self._events is not None:
            self._events.write(
                json.dumps({"t": time.time(), "event": event, **fields}, default=str) + "\n"
            )


def _cause(outcome: str, failure: dict[str, Any] | None, zombie: bool) -> str | None:
    """The job's cause class (report.CAUSE_HINTS explains each)."""
    if failure is not None:
        return failure["cause"]
    if outcome == "timeout":
        return "deadline"
    if outcome in ("interrupted", "stopped"):
        return "interrupted"
    if outcome == "failed":
        return "zombie" if zombie else "launcher"
    return None


def _describe(p: psutil.Process) -> dict[str, Any]:
    try:
        return {"pid": p.pid, "cmd": " ".join(p.cmdline())[:80]}
    except psutil.Error:
        return {"pid": p.pid, "cmd": "?"}
