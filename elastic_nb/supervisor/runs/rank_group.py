"""A rank group: ranks that torchelastic starts, restarts and ends together, under one run
directory, on a node. A one-off job (`job.Job`: its ranks run one cell) and a session
(`sessions.session.Session`: its ranks run cell after cell) are rank groups; this is what they
share, from the launcher's start to the kernel hearing the end:

* start: a launcher from the node, given the group's run directory, spec and environment;
* observe: the launcher's messages (each rank's start and exit), a watcher per rank (its node
  says when it went, its records how), a poll loop that tails the ranks' logs and flushes the
  group's news to the kernel (at most every FLUSH_S) and follows the checkpoints its cells save
  and load, and each rank's memory once a second;
* end: once the group's outcome is decided, the teardown of every process of it, a wait for the
  launcher's last word, the summary, and the END message.

What decides the outcome is each kind's own business (the hooks below); the group keeps the
mechanics in one place, so that a job and a session see ranks, logs and their end alike.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any

import anyio
from anyio.abc import TaskGroup

from elastic_nb.common import protocol
from elastic_nb.common.report import checkpoint_words, duration
from elastic_nb.common.rundir import write_json
from elastic_nb.common.spec import JobSpec
from elastic_nb.supervisor.forensics.watchdogs import Silence
from elastic_nb.supervisor.processes.node import Node
from elastic_nb.supervisor.ranks.checkpoint_log import CheckpointLog
from elastic_nb.supervisor.ranks.log_tailer import LogTailer
from elastic_nb.supervisor.ranks.memory_watch import SAMPLE_S, MemoryWatch
from elastic_nb.supervisor.ranks.rank_book import RankBook
from elastic_nb.supervisor.ranks.rank_state import NCCL_TIMEOUT_MARKS, TORCH_LOG_NOISE, RankState
from elastic_nb.supervisor.runs import summary
from elastic_nb.supervisor.runs.reporter import Reporter, Send

__all__ = ["RankGroup"]

log = logging.getLogger(__name__)

POLL_S = 0.05  # log tail and record polling
FLUSH_S = 0.1  # one update per group per flush: at most 10 messages a second
CUDA_WAIT_S = 0.5  # for a rank's allocator figures (its probe thread answers in milliseconds)


class RankGroup:
    kind = "job"  # what the logs and errors call it

    def __init__(self, group_id: str, spec: JobSpec, node: Node, send: Send) -> None:
        self.id = group_id
        self.spec = spec
        self.node = node
        self.rd = node.rd
        self.created = time.time()
        self.attempt = 0
        self.summary: protocol.Summary | None = None
        self.book = RankBook(self.rd, node)
        self.report = Reporter(group_id, send)
        self.tailer = LogTailer(marks=NCCL_TIMEOUT_MARKS, noise=TORCH_LOG_NOISE)
        self.silence = Silence(last_activity=time.monotonic())  # --hang-after's clock
        self.memory = MemoryWatch()
        self.checkpoints = CheckpointLog(self.rd.checkpoints)
        # The latest failure that ended an attempt (when, and who: "rank 2"), for the words of
        # the resume that follows it.
        self.last_failure: tuple[float, str] | None = None
        self.teardown_at: float | None = None  # when ending the ranks began (our clock)
        self._outcome: tuple[str, str] | None = None
        self._decided = anyio.Event()
        self._heard = anyio.Event()  # every message of the launcher taken in (book.hear_out)
        self._oom_base: int | None = None
        self._tg: TaskGroup | None = None

    # ---- for the service ----------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self.summary is None

    @property
    def decided(self) -> bool:
        return self._outcome is not None

    @property
    def launcher_pid(self) -> int | None:
        return self.node.launcher_pid

    def ended(self) -> str | None:
        """Why the group ended, once its outcome is decided."""
        return self._outcome[1] if self._outcome is not None else None

    def attempt_failed(self, attempt: int) -> bool:
        return attempt in self.book.failed_attempts

    def alert(self, kind: str, severity: str, title: str, rank: int | None = None) -> None:
        """About the group, to whoever follows it."""
        self.report.alert(kind, severity, title, rank=rank)

    def memory_now(self) -> dict[str, dict[str, Any]]:
        """Each rank's latest memory sample, its peak and its growth per minute (host memory):
        what %elastic status prints."""
        a = self.attempt
        return {
            str(rank): {
                "sample": s,
                "rss_peak": self.memory.rss_peak(a, rank),
                "growth": self.memory.growth(a, rank, "rss"),
            }
            for rank, s in sorted(self.memory.latest(a).items())
        }

    def signal(self, ranks: list[RankState], sig: int) -> None:
        for r in ranks:
            self.node.signal(r, sig)

    @property
    def task_group(self) -> TaskGroup:
        assert self._tg is not None, "the group is not running"
        return self._tg

    # ---- its life ---------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            if self._outcome is not None:
                return  # stopped before it started
            self._oom_base = self.node.oom_kills()
            await self._open()
            warm = await self.node.start(self.id, self.spec, self._launch_env())
            self.report.event("launcher", pid=self.node.launcher_pid, warm=warm)
            if warm:
                self._on_ready()
            async with anyio.create_task_group() as tg:
                self._tg = tg
                tg.start_soon(self._read_launcher)
                tg.start_soon(self._poll_loop)
                tg.start_soon(self._sample_memory)
                self._start_tasks(tg)
                await self._decided.wait()
                # Rank watchers and the launcher reader keep running through the teardown, and
                # until the launcher's last word is heard: they record how and when each ended.
                await self._teardown()
                if not self.node.launcher_alive():
                    await self.book.hear_out(self._heard)
                tg.cancel_scope.cancel()
        except Exception as e:  # a bug of ours must still end the group cleanly
            log.exception("%s %s: supervisor error", self.kind, self.id)
            self._decide("failed", f"elastic_nb supervisor error: {type(e).__name__}: {e}")
            self.report.event("internal_error", error=repr(e))
        finally:
            with anyio.CancelScope(shield=True):
                self._decide(*summary.STOPS["shutdown"])
                if self.node.running():
                    await self._teardown()
                self._close()
                await self._finish()

    def _decide(self, outcome: str, reason: str) -> None:
        """The group's outcome, first come first served."""
        if self._outcome is not None:
            return
        self._outcome = (outcome, reason)
        self.report.event("decided", outcome=outcome, reason=reason)
        self._on_decided(outcome)
        self._decided.set()

    async def _read_launcher(self) -> None:
        async for msg in self.node.messages():
            fields = {k: v for k, v in msg.items() if k != "kind"}
            self.report.event(f"launcher.{msg['kind']}", **fields)
            if msg["kind"] == protocol.READY:
                self._on_ready()
            elif msg["kind"] == protocol.START:
                self._on_start(msg["attempt"], msg["rank"], msg["pid"])
            for r in self.book.take_exits(msg):
                self._rank_ended(r)  # its exit was unknown when it was seen gone
        self._heard.set()
        # The pipe's write end lives only in the launcher: EOF means it is exiting.
        await self.node.launcher_exited()
        self._decide(*await self._launcher_ended(self.node.launcher_outcome(self.rd.launcher_log)))

    def _on_start(self, attempt: int, rank: int, pid: int) -> None:
        if attempt > self.attempt:
            self.memory.forget(self.attempt)
            self._new_attempt(attempt)
            self.attempt = attempt
        r = self.book.add(attempt, rank, pid, time.time())
        self.silence.activity(time.monotonic())
        self.tailer.follow(
            attempt, rank, {s: self.rd.log(attempt, rank, s) for s in ("out", "err")}
        )
        self.task_group.start_soon(self._watch_rank, r)
        self._on_rank_started(r)

    async def _watch_rank(self, r: RankState) -> None:
        forked = self.spec.start_method == "forkserver"
        # Until its exit status came (or its bound passed) the rank counted as alive (died_at
        # unset): nothing judged it without it; it died when it was seen gone.
        r.died_at, r.gone_at = await self.book.wait_exit(r, forked)
        self.silence.activity(r.gone_at)
        kills, base = self.node.oom_kills(), self._oom_base  # None: no OOM count where it ran
        r.oom_killed = kills is not None and base is not None and kills > base
        r.rss_peak = self.memory.rss_peak(r.attempt, r.rank)
        self.book.read_records(r)
        self.report.event("rank.exit", attempt=r.attempt, rank=r.rank, code=r.exit_code)
        self._rank_ended(r)

    async def _poll_loop(self) -> None:
        next_flush = 0.0
        while True:
            self.tailer.poll()
            for attempt, rank, _, line in self.tailer.take_marked():
                self._on_watchdog_line(attempt, rank, line)
            self.poll_checkpoints()
            self._poll()
            if time.monotonic() >= next_flush:
                await self._flush()
                next_flush = time.monotonic() + FLUSH_S
            await anyio.sleep(POLL_S)

    def poll_checkpoints(self) -> None:
        """What the cells' checkpoints did since the last poll: a save to the header, a resume
        said with what the failure before it cost."""
        for record in self.checkpoints.poll():
            fields = {k: v for k, v in record.items() if k != "event"}
            self.report.event(f"checkpoint.{record['event']}", **fields)
            if record["event"] == "saved":
                for report in self._followers():
                    report.checkpoint(record)
            elif record.get("step") is not None:
                title = self._resume_words(record)
                for report in self._followers():
                    report.alert("checkpoint", "info", title)

    def _resume_words(self, loaded: dict[str, Any]) -> str:
        """'resumed from step 1200, saved 14 s before rank 2 failed: about 14 s of work
        redone (loaded in 0.4 s, from rank 0's copy)'."""
        saved_at = loaded.get("saved_time")
        words = f"resumed from step {loaded['step']}"
        failure = self.last_failure
        if saved_at is not None and failure is not None and saved_at <= failure[0]:
            lost = duration(failure[0] - saved_at)
            words += f", saved {lost} before {failure[1]} failed: about {lost} of work redone"
        elif saved_at is not None:
            words += f", saved {duration(max(0.0, loaded['time'] - saved_at))} earlier"
        source = loaded.get("from")
        how = f"loaded in {duration(loaded['seconds'])}"
        if source and source != "shared":
            how += f", from {source}'s copy"
        if loaded.get("saved_world_size") not in (None, loaded.get("world_size")):
            how += (
                f"; saved by {loaded['saved_world_size']} ranks, loaded by {loaded['world_size']}"
            )
        return f"{words} ({how})"

    def checkpoint_info(self) -> dict[str, Any] | None:
        """The latest saved checkpoint, with its words (%elastic session, the summary)."""
        latest = self.checkpoints.latest
        return {**latest, "words": checkpoint_words(latest)} if latest else None

    async def _sample_memory(self) -> None:
        """Each live rank's memory once a second, to the dashboard (batched into the next
        update) and against its limits. Read by the node, at no cost to the ranks; a rank's
        CUDA allocator is asked only where the node has GPUs."""
        while True:
            attempt = self.attempt
            ranks = [r for r in self.book.of(attempt) if r.died_at is None and r.pid is not None]
            if ranks:
                reading = self.node.read_memory(ranks)
                cuda = await self._cuda_memory(ranks) if reading.gpus else {}
                t = time.time()
                for r in ranks:
                    sample = protocol.MemorySample(
                        attempt=attempt,
                        rank=r.rank,
                        t=t,
                        rss=reading.rss.get(r.rank),
                        cuda=cuda.get(r.rank),
                        gpu=reading.gpu.get(r.rank),
                    )
                    self.memory.add(sample)
                    for report in self._followers():
                        report.memory(sample)
                for rank, title in self.memory.alerts(attempt, reading.limit):
                    self.alert("memory", "warning", title, rank=rank)
            await anyio.sleep(SAMPLE_S)

    async def _cuda_memory(self, ranks: list[RankState]) -> dict[int, protocol.CudaMemory | None]:
        """Each rank's CUDA allocator figures, asked all at once (None: no CUDA in it yet)."""
        out: dict[int, protocol.CudaMemory | None] = {}

        async def ask(r: RankState) -> None:
            answer = await self.node.probe(r, protocol.PROBE_MEMORY, CUDA_WAIT_S)
            out[r.rank] = (answer or {}).get("cuda")

        async with anyio.create_task_group() as tg:
            for r in ranks:
                tg.start_soon(ask, r)
        return out

    async def _teardown(self) -> None:
        """Leave nothing behind: what the kind does first (`_before_teardown`), then SIGTERM,
        grace, SIGKILL to every process of the group on its node, and what survived said."""
        assert self._outcome is not None
        await self._before_teardown(self._outcome[0])
        if self.node.running() and self.teardown_at is None:
            self.teardown_at = time.time()
        survivors = await self.node.stop(
            self.spec.stop_grace,
            lambda sig, stray: self.report.event("teardown", signal=sig, stray=stray),
        )
        if survivors:  # no process of a group may outlive it unsaid
            self.report.event("teardown_failed", pids=[s.pid for s in survivors])
            self.report.alert(**summary.unkillable(survivors))

    async def _finish(self) -> None:
        assert self._outcome is not None
        outcome, reason = self._outcome
        try:
            self.summary = await self._summarize(outcome, reason)
        except Exception as e:  # the kernel must hear the end whatever broke here
            log.exception("%s %s: could not analyse its end", self.kind, self.id)
            self.report.event("internal_error", error=repr(e))
            self.summary = self._plain_summary(outcome, reason)
            self.summary["reason"] += f" (elastic_nb could not analyse it: {e!r})"
        with contextlib.suppress(OSError):
            write_json(self.rd.summary, self._summary_record(self.summary))
        self.report.event("end", outcome=outcome)
        self.node.close()
        self.tailer.close()
        self.report.close()
        await self.report.end(self.summary)

    def _plain_summary(self, outcome: str, reason: str) -> protocol.Summary:
        """A summary without a verdict (a session's; a job's whose analysis broke)."""
        ended = time.time()
        return protocol.summary(
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
        )

    # ---- what each kind does (hooks) ------------------------------------------------------

    async def _open(self) -> None:
        """Before the launcher starts."""

    def _launch_env(self) -> dict[str, str]:
        """The ranks' environment."""
        raise NotImplementedError

    def _start_tasks(self, tg: TaskGroup) -> None:
        """Tasks of the kind's own, beside the launcher's reader and the poll loop."""

    def _on_ready(self) -> None:
        """The launcher has torch imported and the job in hand: the rendezvous comes next."""

    def _new_attempt(self, attempt: int) -> None:
        """torchelastic restarted the group: `attempt` starts (self.attempt is the last)."""

    def _on_rank_started(self, r: RankState) -> None: ...

    def _rank_ended(self, r: RankState) -> None:
        """A rank has gone (or its exit status came after it was seen gone)."""

    def _on_watchdog_line(self, attempt: int, rank: int, line: str) -> None:
        """NCCL's watchdog says a collective of this rank timed out."""

    def _poll(self) -> None:
        """Each poll (every POLL_S)."""

    def _followers(self) -> list[Reporter]:
        """Who is sent the ranks' news (memory samples, checkpoints)."""
        return [self.report]

    async def _flush(self) -> None:
        await self.report.flush(self.attempt, self.tailer)

    async def _launcher_ended(self, outcome: tuple[str, str]) -> tuple[str, str]:
        """The launcher exited, and said (or not) how: the outcome that gives the group."""
        return outcome

    def _on_decided(self, outcome: str) -> None: ...

    async def _before_teardown(self, outcome: str) -> None: ...

    def _close(self) -> None:
        """After the teardown, before the summary."""

    async def _summarize(self, outcome: str, reason: str) -> protocol.Summary:
        raise NotImplementedError

    def _summary_record(self, summary: protocol.Summary) -> dict[str, Any]:
        """What summary.json keeps."""
        return dict(summary)
