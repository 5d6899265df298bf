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
import logging
import signal
import time
from collections.abc import Callable
from typing import Any

import anyio
import psutil

from elastic_nb.common import procs, protocol
from elastic_nb.common.rundir import RunDir, write_json
from elastic_nb.common.spec import JobSpec
from elastic_nb.supervisor.forensics.verdict import (
    FAILED,
    NCCL_TIMEOUT_MARKS,
    TORCH_LOG_NOISE,
    RankState,
    Verdict,
    analyze,
)
from elastic_nb.supervisor.forensics.watchdogs import agent_stuck
from elastic_nb.supervisor.processes.launcher_pool import Launcher, LauncherPool
from elastic_nb.supervisor.processes.process_tree import ProcessTree
from elastic_nb.supervisor.ranks.evidence import EvidenceCollector
from elastic_nb.supervisor.ranks.log_tailer import LogTailer
from elastic_nb.supervisor.ranks.rank_book import RankBook
from elastic_nb.supervisor.runs import summary
from elastic_nb.supervisor.runs.diagnosis import Diagnosis, oom_alert
from elastic_nb.supervisor.runs.reporter import Reporter, Send

__all__ = ["Job"]

log = logging.getLogger(__name__)

POLL_S = 0.05  # log tail and record polling
FLUSH_S = 0.1  # one update per job per flush: at most 10 messages a second


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
        orphans: Callable[[], list[psutil.Process]],
        launchers: LauncherPool,
    ) -> None:
        self.id = job_id
        self.spec = spec
        self.rd = RunDir.of(spec.log_dir, job_id)
        self.attempt = 0
        self.created = time.time()
        self._created_mono = time.monotonic()
        self.summary: dict[str, Any] | None = None
        self._source, self._meta, self._payload, self._env = source, meta, payload, env
        self._reap, self._orphans = reap, orphans
        self._launchers = launchers
        self._launcher: Launcher | None = None
        self._tree: ProcessTree | None = None  # the launcher's, once it has the job
        self.book = RankBook(self.rd)
        self.report = Reporter(job_id, send)
        self._tailer = LogTailer(marks=NCCL_TIMEOUT_MARKS, noise=TORCH_LOG_NOISE)
        self._outcome: tuple[str, str] | None = None
        self._decided = anyio.Event()
        self._heard = anyio.Event()  # every message of the launcher taken in (book.hear_out)
        self._teardown_at: float | None = None
        self._leftovers: list[dict[str, Any]] = []
        self._tg: anyio.abc.TaskGroup | None = None
        self._oom_base = procs.oom_kills()
        self._watchdog_fired = False  # the zombie watchdog stopped the agent
        self._diagnosis = Diagnosis(
            self, self.book, self.report, EvidenceCollector(self.rd, source)
        )

    # ---- for the server -----------------------------------------------------------------

    @property
    def state(self) -> str:
        return self.report.state

    @property
    def decided(self) -> bool:
        return self._outcome is not None

    @property
    def launcher_pid(self) -> int | None:
        return self._tree.launcher.pid if self._tree else None

    @property
    def running(self) -> bool:
        return self.summary is None

    def request_stop(self, reason: str) -> None:
        self._decide(*summary.STOPS.get(reason, ("stopped", reason)))

    async def run(self) -> None:
        try:
            if self._outcome is not None:
                return  # stopped before it started
            await self._start_launcher()
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._read_launcher)
                tg.start_soon(self._poll_loop)
                tg.start_soon(self._diagnosis.watch_desync)
                if self.spec.timeout is not None:
                    tg.start_soon(self._deadline, self.spec.timeout)
                await self._decided.wait()
                # Rank watchers and the launcher reader keep running through the teardown, and
                # until the launcher's last word is heard: they record how and when each ended.
                await self._teardown()
                if self._launcher is not None and not self._launcher.alive:
                    await self.book.hear_out(self._heard)
                tg.cancel_scope.cancel()
        except Exception as e:  # a bug of ours must still end the job cleanly
            log.exception("job %s: supervisor error", self.id)
            self._decide("failed", f"elastic_nb supervisor error: {type(e).__name__}: {e}")
            self.report.event("internal_error", error=repr(e))
        finally:
            with anyio.CancelScope(shield=True):
                self._decide(*summary.STOPS["shutdown"])
                if self._tree is not None and self._tree.alive():
                    await self._teardown()
                await self._finish()

    async def _deadline(self, timeout: float) -> None:
        """--timeout, counted from the job's creation on the monotonic clock."""
        # Past already when a cell's own zygote took longer than the deadline (anyio refuses a
        # negative delay).
        await anyio.sleep(max(0.0, timeout - (time.monotonic() - self._created_mono)))
        self._decide("timeout", f"the --timeout of {timeout:g} s passed")

    async def stacks(self) -> str:
        """Every rank's stack now (``%elastic stacks``); also shown as an alert."""
        return await self._diagnosis.stacks()

    # ---- start ----------------------------------------------------------------------------

    def prepare(self) -> None:
        """Create the run directory; a failure here is the submitter's error, not a job's."""
        self.rd.create(self.spec.to_json(), self._source, self._meta, self._payload)
        self._payload = None  # on disk now; a pushed model need not stay in our memory
        self.report.open(self.rd.events)
        self.report.event("created", nproc=self.spec.nproc)

    async def _start_launcher(self) -> None:
        """Take a launcher (the warm one, or a new one) and give it this job."""
        launcher = await self._launchers.take(self.spec, self._env)
        line = launcher.assign(self.id, str(self.rd), self._env)  # before any await: ours now
        self._launcher, self._tree = launcher, ProcessTree(self.id, launcher.proc, self._orphans)
        self.report.event("launcher", pid=launcher.pid, warm=launcher.ready)
        if launcher.ready:
            self.report.set_state("rendezvous")
        await anyio.to_thread.run_sync(launcher.write_assignment, line)

    # ---- observing ------------------------------------------------------------------------

    async def _read_launcher(self) -> None:
        launcher = self._launcher
        assert launcher is not None
        async for msg in launcher.messages:
            self._on_launcher(msg)
        self._heard.set()
        # The pipe's write end lives only in the launcher: EOF means it is exiting.
        with anyio.move_on_after(procs.KILL_WAIT_S):
            await launcher.exited()
        # torchelastic gives up the moment a rank fails; a diagnosis under way (stacks taken
        # while the others were still alive) decides first, or its verdict would be lost.
        await self._diagnosis.idle()
        self._decide(*launcher.outcome(self.rd.launcher_log))

    def _on_launcher(self, msg: dict[str, Any]) -> None:
        kind = msg["kind"]
        self.report.event(f"launcher.{kind}", **{k: v for k, v in msg.items() if k != "kind"})
        if kind == protocol.READY:
            self.report.set_state("rendezvous")
        elif kind == protocol.START:
            self._on_start(int(msg["attempt"]), int(msg["rank"]), int(msg["pid"]))
        for r in self.book.take_exits(msg):
            self.evaluate(r)  # its exit was unknown when its pidfd fired

    def _on_start(self, attempt: int, rank: int, pid: int) -> None:
        if attempt > self.attempt:
            found = self._diagnosis.finding
            desync = found.desync.text if found and found.desync else None
            self.report.alert(**summary.restart_alert(self.book, attempt - 1, desync, self.spec))
            self.attempt = attempt
        r = self.book.add(attempt, rank, pid, time.time())
        assert self._launcher is not None
        self._launcher.last_tick = time.monotonic()  # a start is a sign of life
        self._diagnosis.silence.activity(time.monotonic())
        self._tailer.follow(
            attempt, rank, {s: self.rd.log(attempt, rank, s) for s in ("out", "err")}
        )
        self.show(r)
        self.report.set_state("running")
        assert self._tg is not None
        self._tg.start_soon(self._watch_rank, r)
        if attempt == 0 and len(self.book.of(0)) == self.spec.nproc:
            self._launchers.job_running(self.spec)

    async def _watch_rank(self, r: RankState) -> None:
        forked = self.spec.start_method == "forkserver"
        # Until its exit status came (or its bound passed) the rank counted as alive (died_at
        # unset): nothing judged it without it; it died when it was seen gone.
        r.died_at, r.gone_at = await self.book.wait_exit(r, forked)
        self._diagnosis.silence.activity(r.gone_at)
        kills, base = procs.oom_kills(), self._oom_base  # None: no cgroup memory events here
        r.oom_killed = kills is not None and base is not None and kills > base
        self.book.read_records(r)
        self.report.event("rank.exit", attempt=r.attempt, rank=r.rank, code=r.exit_code)
        self.evaluate(r)

    def show(self, r: RankState) -> None:
        if r.attempt == self.attempt:
            self.report.chip(r.rank, self.book.chip(r, self._teardown_at))

    def evaluate(self, r: RankState) -> None:
        self.show(r)
        kind = r.kind(self._teardown_at)
        if kind in FAILED:
            if kind == "oom" and r.failure is not None:
                title, text = oom_alert(r)
                self.report.alert("oom", "error", title, rank=r.rank, text=text)
            self.decide_rank_failed(r, kind)
        elif kind == "done":
            ranks = self.book.of(r.attempt)
            if len(ranks) == self.spec.nproc and all(x.done and x.died_at for x in ranks):
                self._decide("succeeded", "every rank finished the cell")

    def decide_rank_failed(self, r: RankState, kind: str) -> None:
        if r.attempt in self.book.failed_attempts:
            return
        if self._diagnosis.holds(r, kind):
            return  # decided once the diagnosis under way has ended
        if kind == "collective_timeout" and r.attempt == self.attempt:
            assert self._tg is not None
            self._diagnosis.start_timeout(r, kind, self._tg)
            return
        self.fail_attempt(r, kind)

    def fail_attempt(self, r: RankState, kind: str, reason: str | None = None) -> None:
        self.book.failed_attempts.add(r.attempt)
        self.report.event("attempt.failed", attempt=r.attempt, rank=r.rank, kind=kind)
        # An exit(0) without finishing leaves torchelastic waiting forever for a return value
        # (multiprocessing/api.py, _poll): no restart would come, so it ends the job.
        if r.attempt >= self.spec.max_restarts or kind == "exit0":
            self._decide("failed", reason or f"rank {r.rank} {r.failure_summary()}")
            return
        self.report.set_state("restarting")
        if kind == "desync":
            # In torch's eyes nothing has failed: the waiting ranks would sit in their
            # collective until its timeout. Ending them makes the agent restart the group now.
            for x in self.book.of(r.attempt):
                if x.pid is not None and x.died_at is None and x.done is None:
                    procs.send_signal(x.pid, x.pidfd, signal.SIGTERM)

    async def _poll_loop(self) -> None:
        next_flush = 0.0
        while True:
            self._tailer.poll()
            assert self._tg is not None
            for attempt, rank, _, line in self._tailer.take_marked():
                r = self.book.get(attempt, rank)
                if r is not None:
                    self._diagnosis.on_watchdog(r, line, self._tg)
            # Records land before the process exits (torch and Python teardown can take a
            # while): act on a failure at once.
            for r in self.book.new_failures(self.attempt):
                self.evaluate(r)
            self._watch_agent()
            self._diagnosis.watch_silence(self._tailer.activity_total(), self._tg)
            if time.monotonic() >= next_flush:
                await self.report.flush(self.attempt, self._tailer)
                next_flush = time.monotonic() + FLUSH_S
            await anyio.sleep(POLL_S)

    # ---- watchdogs --------------------------------------------------------------------------

    def _watch_agent(self) -> None:
        """The zombie watchdog (`watchdogs.agent_stuck` judges): say so, and stop the launcher,
        SIGTERM breaks the agent's stuck wait."""
        launcher = self._launcher
        if self._watchdog_fired or launcher is None or not launcher.alive:
            return
        ticking = self._outcome is None and self.state == "running"
        current, teardown_at = self.book.of(self.attempt), self._teardown_at
        stuck = agent_stuck(self.book.all(), current, self.spec, launcher, teardown_at, ticking)
        if stuck is None:
            return
        self._watchdog_fired = True
        if stuck.zombie is not None:
            self.book.zombies.add((stuck.zombie.attempt, stuck.zombie.rank))
            self.show(stuck.zombie)
        self.report.alert("zombie", "error", stuck.title)
        self._decide(stuck.outcome, stuck.reason)

    # ---- ending ---------------------------------------------------------------------------

    def _decide(self, outcome: str, reason: str) -> None:
        if self._outcome is not None:
            return
        self._outcome = (outcome, reason)
        if outcome != "succeeded":
            self._teardown_at = time.time()
        self.report.event("decided", outcome=outcome, reason=reason)
        self._decided.set()

    async def _teardown(self) -> None:
        """Leave nothing behind (`teardown.ProcessTree`): after a success, name what the cell
        left running; then SIGTERM, grace, SIGKILL, and say what survived."""
        assert self._outcome is not None and self._tree is not None
        tree = self._tree
        if self._outcome[0] == "succeeded":
            self._leftovers = await tree.leftovers_after_success(
                self.spec.stop_grace, lambda: self._watchdog_fired
            )
        if tree.alive() and self._teardown_at is None:
            self._teardown_at = time.time()
        await tree.stop_reported(self.spec.stop_grace, self.report)
        self._reap()

    async def _finish(self) -> None:
        assert self._outcome is not None
        outcome, reason = self._outcome
        try:
            self.summary = await self._final_summary(outcome, reason)
        except Exception as e:  # the kernel must hear the end whatever broke here
            log.exception("job %s: could not analyse its end", self.id)
            self.report.event("internal_error", error=repr(e))
            self.summary = self._summarize(outcome, reason, Verdict(None, None, []))
            self.summary["reason"] += f" (elastic_nb could not analyse it: {e!r})"
        with contextlib.suppress(OSError):
            write_json(self.rd.summary, self.summary)
        self.report.event("end", outcome=outcome)
        launcher = self._launcher
        if launcher is not None:
            summary.keep_launcher_log(self.rd, launcher.log_path)
            self._launchers.job_ended(self.spec, started=launcher.ready)
        self._tailer.close()
        self.report.close()
        await self.report.end(self.summary)

    async def _final_summary(self, outcome: str, reason: str) -> dict[str, Any]:
        self._tailer.poll(final=True)
        self.book.settle()
        current = self.book.of(self.attempt)
        behind = self.book.behind.get(self.attempt)
        verdict = analyze(current, self._teardown_at, behind, self.spec.nproc)
        for r in current:
            self.report.chip(r.rank, self.book.chip(r, self._teardown_at, verdict.root))
        result = self._summarize(outcome, reason, verdict)
        for alert in summary.closing_alerts(result, current, self._leftovers):
            self.report.alert(**alert)
        self.report.set_state(outcome)
        await self.report.flush(self.attempt, self._tailer)
        return result

    def _summarize(self, outcome: str, reason: str, verdict: Verdict) -> dict[str, Any]:
        return summary.summarize(
            job_id=self.id,
            spec=self.spec,
            rd=self.rd,
            outcome=outcome,
            reason=reason,
            verdict=verdict,
            attempt=self.attempt,
            created=self.created,
            zombie=self._watchdog_fired,
            diagnosis=self._diagnosis.finding.record if self._diagnosis.finding else None,
            leftovers=self._leftovers,
            lines=self._tailer.lines_total(),
        )
