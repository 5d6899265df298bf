"""Diagnosis: when a collective times out, the ranks desync, or they fall silent, take the evidence
(`evidence.EvidenceCollector`: every stack, every flight recorder) while the ranks still live, and
say what it shows. The job decides what happens; this module finds and words.

The desync watch runs for the whole job: it looks at the ranks' flight recorders this often once
a rank has left the cell (a desync can become certain any moment then), and every LOOK_IDLE_S
otherwise (two ranks stalled in different ops): a status look costs a rank 0.1 ms.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Protocol

import anyio

from elastic_nb.common.spec import TEARS_DOWN, JobSpec
from elastic_nb.supervisor.forensics.collectives import History
from elastic_nb.supervisor.forensics.stacks import Desync
from elastic_nb.supervisor.forensics.verdict import RankState, watchdog_op, watchdog_summary
from elastic_nb.supervisor.forensics.watchdogs import Silence
from elastic_nb.supervisor.ranks.evidence import Evidence, EvidenceCollector
from elastic_nb.supervisor.ranks.rank_book import RankBook
from elastic_nb.supervisor.runs.reporter import Reporter

__all__ = [
    "Diagnosis",
    "Finding",
    "oom_alert",
    "timeout_finding",
    "watchdog_title",
    "where_finding",
]

LOOK_LEFT_S = 0.25
LOOK_IDLE_S = 1.0
RELOOK_S = 1.0  # after a full look that did not confirm a finding

OOM_HINT = (
    "if this rank's error is caught and it skips a collective (e.g. backward()), the "
    "other ranks wait in that collective until --collective-timeout: a desync"
)


@dataclass
class Finding:
    """A diagnosis the summary keeps: the alert's title, whom it blames, what the summary says."""

    title: str
    culprit: int | None
    desync: Desync | None
    stacks: str

    @property
    def record(self) -> dict[str, Any]:
        """What summary.json keeps as "diagnosis"."""
        return {
            "text": self.desync.text if self.desync else None,
            "hint": self.desync.hint if self.desync else None,
            "stacks": self.stacks,
        }


def timeout_finding(r: RankState, ev: Evidence, spec: JobSpec) -> Finding:
    """Rank `r` timed out in a collective: in which op, after how long, and whose fault."""
    op = ev.where[r.rank].collective() if r.rank in ev.where else None
    after = f" after {spec.collective_timeout:g} s" if spec.collective_timeout else ""
    if r.watchdog is not None:  # its own words: the op, and the timeout it had
        op, after = watchdog_op(r.watchdog["line"]) or op, ""
    title = f"rank {r.rank} timed out in {op or 'a collective'}{after}"
    desync = ev.desync
    if desync is not None:
        title += f": {desync.text}"
    culprit = desync.behind[0] if desync is not None and desync.behind else r.rank
    return Finding(title, culprit, desync, ev.stacks)


def where_finding(title: str, ev: Evidence) -> Finding:
    """Nothing ended (a hang, stacks on request, a watchdog that keeps the rank): where
    everyone is, and what they say of a desync."""
    if ev.desync is not None:
        title += f": {ev.desync.text}"
    culprit = ev.desync.behind[0] if ev.desync is not None and ev.desync.behind else None
    return Finding(title, culprit, ev.desync, ev.stacks)


def watchdog_title(rank: int, line: str, mode: int) -> str:
    """NCCL's watchdog fired in a mode that keeps the rank alive (0 or 2)."""
    return f"rank {rank}: {watchdog_summary(line)}; it lives on (--async-error-handling {mode})"


def oom_alert(r: RankState) -> tuple[str, str]:
    """The title and text of a CUDA OOM alert, from the worker's memory report."""
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
    text = "\n".join(x for x in (mem.get("summary"), mem.get("error"), OOM_HINT) if x)
    return title, text


class Decider(Protocol):
    """What a diagnosis needs of its job: where it stands, and the decisions it may ask for."""

    spec: JobSpec
    attempt: int
    state: str

    @property
    def decided(self) -> bool: ...

    def fail_attempt(self, r: RankState, kind: str, reason: str | None = None) -> None: ...

    def decide_rank_failed(self, r: RankState, kind: str) -> None: ...

    def show(self, r: RankState) -> None: ...

    def evaluate(self, r: RankState) -> None: ...


class Diagnosis:
    """A job's diagnoses: at most one per attempt at a time; a failure that comes while one is
    under way waits for it (an unconfirmed desync must not swallow a rank's own exception)."""

    def __init__(
        self, job: Decider, book: RankBook, report: Reporter, collector: EvidenceCollector
    ) -> None:
        self._job, self._book, self._report, self._collector = job, book, report, collector
        self._under_way: set[int] = set()  # attempts being diagnosed
        self._ended = anyio.Event()  # replaced after each end
        self._deferred: list[tuple[RankState, str]] = []
        self.finding: Finding | None = None  # what the summary says about a timeout or desync
        self.silence = Silence(last_activity=time.monotonic())  # --hang-after's clock
        self._watchdog_alerts: set[int] = set()  # attempts whose NCCL timeouts end nothing

    @property
    def busy(self) -> bool:
        return bool(self._under_way)

    def holds(self, r: RankState, kind: str) -> bool:
        """Keep a failure of an attempt under diagnosis for when the diagnosis ends."""
        if r.attempt not in self._under_way:
            return False
        self._deferred.append((r, kind))
        return True

    async def idle(self) -> None:
        while self._under_way:
            await self._ended.wait()

    async def evidence(self) -> Evidence:
        """Where every rank of the current attempt is and what it ran, from fresh records."""
        ranks = self._book.of(self._job.attempt)
        for r in ranks:
            self._book.read_records(r)
        return await self._collector.collect(ranks)

    async def report_where(self, kind: str, title: str) -> None:
        """An alert with every rank's stack and what they say of a desync; nothing ends."""
        found = where_finding(title, await self.evidence())
        self._report.alert(kind, "warning", found.title, rank=found.culprit, text=found.stacks)

    async def stacks(self) -> str:
        """Every rank's stack now (``%elastic stacks``); also shown as an alert."""
        ev = await self.evidence()
        title = f"stacks of every rank, attempt {self._job.attempt}"
        if ev.desync is not None and ev.desync.behind:
            title += f": {ev.desync.text}"
        self._report.alert("stacks", "info", title, text=ev.stacks)
        return f"{title}\n{ev.stacks}"

    def on_watchdog(self, r: RankState, line: str, tg: anyio.abc.TaskGroup) -> None:
        """NCCL's watchdog says this rank's collective timed out. The rank lives on for a
        minute (the flight recorder's dump, then SIGABRT): diagnose now, while every rank can
        still show where it is."""
        if r.watchdog is not None or r.failure is not None:
            return
        self._report.event("rank.watchdog", attempt=r.attempt, rank=r.rank, line=line)
        mode = self._job.spec.async_error_handling
        if mode in TEARS_DOWN:
            r.watchdog = {"time": time.time(), "line": line}
            self._job.evaluate(r)  # a collective timeout: start_timeout, from the job
        elif r.attempt not in self._watchdog_alerts:
            # The rank lives on and the error may reach the cell, which may handle it: say
            # where every rank is (once an attempt: every rank's watchdog says it), end nothing.
            self._watchdog_alerts.add(r.attempt)
            tg.start_soon(
                self.report_where, "collective_timeout", watchdog_title(r.rank, line, mode)
            )

    def watch_silence(self, lines: int, tg: anyio.abc.TaskGroup) -> None:
        """--hang-after (`watchdogs.Silence` judges): an alert with every stack, nothing ends."""
        job = self._job
        quiet = not job.decided and job.state == "running" and not self.busy
        now = time.monotonic()
        hang_after = job.spec.hang_after if quiet else None
        if self.silence.due(now, lines, self._book.in_the_cell(job.attempt), hang_after):
            silent_for = now - self.silence.last_activity
            title = f"no output and no exit from any rank for {silent_for:.0f} s (--hang-after)"
            tg.start_soon(self.report_where, "hang", title)

    def start_timeout(self, r: RankState, kind: str, tg: anyio.abc.TaskGroup) -> None:
        """Rank `r` timed out: hold the attempt's decision until every live rank's stack is on
        disk (the teardown would destroy the evidence of where the others were)."""
        self._under_way.add(r.attempt)
        tg.start_soon(self._timeout, r, kind)

    async def _timeout(self, r: RankState, kind: str) -> None:
        try:
            found = timeout_finding(r, await self.evidence(), self._job.spec)
            if found.desync is not None:
                self._blame(r.attempt, found.desync)
            self.finding = found
            self._report.alert(
                "collective_timeout", "error", found.title, rank=found.culprit, text=found.stacks
            )
        finally:
            self._end(r.attempt)
            self._job.fail_attempt(r, kind)
            self._decide_deferred()

    async def watch_desync(self) -> None:
        """Find a desync the moment it can no longer resolve (`desync.find_certain`: a rank
        left the cell while another waits in a later collective of its group, or two ranks
        wait in different ops at the same number), not when the collective timeout ends it."""
        job = self._job
        if job.spec.nproc < 2:
            return  # one rank cannot fall out of step with itself
        before: dict[int, History] = {}
        looked = 0.0
        unconfirmed: dict[str, float] = {}  # findings a full look did not bear out, and when
        while True:
            await anyio.sleep(LOOK_LEFT_S)
            ranks = self._book.of(job.attempt)
            left = any(r.done is not None for r in ranks)
            live = [r for r in ranks if r.died_at is None and r.done is None and r.failure is None]
            if (
                job.decided
                or self.busy
                or job.state != "running"
                or len(ranks) < job.spec.nproc
                or job.attempt in self._book.failed_attempts
                or not live
            ):
                before = {}
                continue
            if not left and time.monotonic() - looked < LOOK_IDLE_S:
                continue
            looked = time.monotonic()
            before, certain = await self._collector.look(ranks, before)
            if certain is None or job.decided or self.busy:
                continue
            # A look that did not bear a finding out (a rank too busy to answer in time) is
            # taken again, but not at every pass: each one dumps every rank's stack.
            key = repr((job.attempt, certain.kind, [(w.rank, w.seq) for w in certain.waiters]))
            if time.monotonic() - unconfirmed.get(key, -RELOOK_S) < RELOOK_S:
                continue
            if not await self._desync(job.attempt):
                unconfirmed[key] = time.monotonic()

    async def _desync(self, attempt: int) -> bool:
        """Take the stacks and a full look; if the desync holds, report it and end the attempt."""
        self._under_way.add(attempt)
        try:
            ev = await self.evidence()
            desync = ev.desync
            if (
                desync is None
                or not desync.certain
                or attempt != self._job.attempt
                or self._job.decided
            ):
                # The full look did not bear it out: keep watching (and keep the record).
                self._report.event(
                    "desync.unconfirmed",
                    looked={r: {"last": h.last, "left": h.left} for r, h in ev.histories.items()},
                    verdict=desync.text if desync else None,
                )
                return False
            culprit = self._book.ranks[(attempt, desync.behind[0])]
            self.finding = Finding(f"desync: {desync.text}", culprit.rank, desync, ev.stacks)
            self._blame(attempt, desync)
            self._report.alert(
                "desync", "error", self.finding.title, rank=culprit.rank, text=ev.stacks
            )
            self._job.fail_attempt(culprit, "desync", reason=self.finding.title)
            return True
        finally:
            self._end(attempt)
            self._decide_deferred()

    def _end(self, attempt: int) -> None:
        self._under_way.discard(attempt)
        self._ended.set()
        self._ended = anyio.Event()

    def _decide_deferred(self) -> None:
        deferred, self._deferred = self._deferred, []
        for r, kind in deferred:
            self._job.decide_rank_failed(r, kind)

    def _blame(self, attempt: int, desync: Desync) -> None:
        for r in self._book.blame(attempt, desync):
            self._job.show(r)
