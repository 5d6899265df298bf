"""One cell run on a session's ranks: a job of its own for the kernel (its updates, its end, a
run directory with its source, its records and its summary), whose ranks are the session's.

The cell is sent to every rank over the session's private channel; each rank answers ``ran``
once its records are in the cell's run directory. What decides the cell, first come first
served:

* every rank finished it                                        -> succeeded
* every rank answered and one raised                            -> failed, the session stays
* a rank raised while others still run it                       -> the others are interrupted
                                                                   (KeyboardInterrupt); failed
* a rank finished while another waits in a later collective     -> a desync: the waiting ones
  (the desync watch, as a job's)                                   are interrupted; failed
* a rank of the session died                                    -> failed; the session restarts
* `stop` from the kernel (interrupt, %elastic stop), --timeout  -> the ranks are interrupted;
                                                                   interrupted / timeout

A rank that does not come back from an interrupt within the grace (stuck inside a collective,
where no Python runs) is killed: torchelastic then restarts the group and the session replays.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from typing import TYPE_CHECKING, Any

import anyio

from elastic_nb import protocol
from elastic_nb.common.rundir import RunDir, read_json, write_json
from elastic_nb.common.spec import TEARS_DOWN
from elastic_nb.common.submission import Submission
from elastic_nb.supervisor.forensics.verdict import Verdict, analyze
from elastic_nb.supervisor.ranks.checkpoint_log import CheckpointLog
from elastic_nb.supervisor.ranks.evidence import EvidenceCollector
from elastic_nb.supervisor.ranks.memory_watch import Peaks
from elastic_nb.supervisor.ranks.rank_state import RankState
from elastic_nb.supervisor.runs import diagnosis, summary
from elastic_nb.supervisor.runs.diagnosis import DesyncWatch, Finding
from elastic_nb.supervisor.runs.rank_group import RankGroup
from elastic_nb.supervisor.runs.reporter import Reporter, Send

if TYPE_CHECKING:
    from elastic_nb.supervisor.ranks.rank_links import Link

__all__ = ["Decision", "SessionCell", "failure_words"]

# After the first failure, how long the other ranks' own answers may take before they are
# interrupted: a cell that raises on every rank (a typo) fails on each of them within
# milliseconds, and each should be reported with its own error, not as interrupted.
SETTLE_S = 0.1


# (outcome, reason, when interrupting began, whether the session restarts)
Decision = tuple[str, str, float | None, bool]


class SessionCell:
    def __init__(self, cell: Submission, send: Send) -> None:
        assert cell.session is not None
        self.id = cell.id
        self.spec = cell.spec
        self.rd = RunDir.of(cell.spec.log_dir, cell.id)
        self.session_id = cell.session
        self.created = time.time()
        self.source = cell.source
        self._cell = cell
        self.report = Reporter(cell.id, send)
        self.summary: protocol.records.Summary | None = None
        self.no: int | None = None  # its number in the session, once it runs
        self.stop_reason: str | None = None  # a stop request's key (summary.STOPS), or timeout
        self.changed = anyio.Event()  # an answer, a death or a stop: look again
        self.answers: dict[int, bool] = {}  # rank -> finished (True) or raised (False)
        self.attempt = 0
        self.finding: Finding | None = None  # a desync found while it ran
        self.standing: Finding | None = None  # its last hang alert's finding (`stopped` says it)
        # Where each rank stood at that alert (its chip says so until a rank speaks again), and
        # the session's line count then.
        self.places: tuple[dict[int, str], int] | None = None
        self.restarted_to: int | None = None  # the session's attempt after the restart it brought
        self.peaks = Peaks()  # its ranks' memory peaks while the kernel follows it
        self.checkpoints = CheckpointLog(self.rd.checkpoints)  # its session's, once submitted
        self.watchdog: tuple[int, str, float] | None = None  # NCCL's timeout line: rank, line, when
        self._oom_told: set[int] = set()  # ranks whose CUDA OOM has had its alert

    @property
    def running(self) -> bool:
        return self.summary is None

    @property
    def first_line(self) -> str:
        lines = [x for x in self.source.splitlines() if x.strip() and not x.startswith("#")]
        return lines[0].strip()[:60] if lines else ""

    def prepare(self) -> None:
        """Its run directory, as a one-off job's (the kernel reads the result from it)."""
        self._cell.write(self.rd)
        self.report.open(self.rd.events)
        self.report.event("created", session=self.session_id)

    def poke(self) -> None:
        self.changed.set()
        self.changed = anyio.Event()

    def request_stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
            self.report.event("stop", reason=reason)
            self.poke()

    def on_watchdog(self, rank: int, line: str) -> None:
        """NCCL's watchdog says this rank's collective timed out (its first such line)."""
        if self.watchdog is None:
            self.watchdog = (rank, line, time.time())
            self.report.event("rank.watchdog", rank=rank, line=line)
            self.poke()

    def answer(self, rank: int, ok: bool) -> None:
        self.answers[rank] = ok
        self.poke()

    # ---- deciding -----------------------------------------------------------------------------

    async def decide(self, links: list[Link], group: RankGroup) -> Decision:
        """Wait for the ranks' answers, interrupting them on a failure, a stop or --timeout."""
        grace = group.spec.stop_grace
        deadline = self.created + self.spec.timeout if self.spec.timeout else math.inf
        first_failure: float | None = None
        interrupted: float | None = None
        collector = EvidenceCollector(group.rd, group.book.node, self.source, self.rd.cell)
        watch = DesyncWatch(collector) if len(links) > 1 else None
        watchdog_seen = False
        told: set[int] = set()  # failed ranks whose records were read for an OOM alert
        while True:
            # Taken before anything below awaits: a rank's answer (or a death, a stop) that
            # lands while this pass looks or sends sets the event waited on at its end, not a
            # successor (poke replaces it). Waiting on self.changed there lost such a wake-up:
            # the cell's end then waited for the next look, 0.25-1 s, about one cell in six.
            changed = self.changed
            now = time.monotonic()
            ended = group.ended()
            if ended is not None:
                return "failed", f"the session ended: {ended}", interrupted, False
            # A rank's death is the group's decision core's to judge, with the evidence a job's
            # waits for (torch's agent's word, a lost machine's): the cell ends as it decides.
            if group.attempt_failed(self.attempt):
                r = group.core.pinned.get(self.attempt)
                why = f"rank {r.rank} {r.failure_summary()}" if r else "its attempt failed"
                return "failed", why, interrupted or time.time(), True
            if self.watchdog is not None and not watchdog_seen:
                watchdog_seen = True
                decision = await self._watchdog(links, collector, group)
                if decision is not None:
                    return decision
            failed = sorted(rank for rank, ok in self.answers.items() if not ok)
            missing = [link for link in links if link.r.rank not in self.answers]
            if not missing:
                if not failed:
                    return "succeeded", "every rank finished the cell", None, False
                if self.stop_reason is not None:
                    return (*self.stopped(), interrupted, False)
                return "failed", self._failed(failed), interrupted, False
            if time.time() >= deadline:
                self.request_stop("timeout")
            if failed and first_failure is None:
                first_failure = now
            new = set(failed) - told
            if new:
                # A CUDA OOM is told as it happens, not after the restart and replay it brings.
                self.oom_alerts(self.ranks([x.r for x in links if x.r.rank in new]))
                told |= new
            wake = now + (deadline - time.time())
            if interrupted is None and not failed and not self.stop_reason and watch:
                wake = min(wake, await self._look(watch, links))
            if interrupted is None and (self.stop_reason or failed or self.finding):
                settled = first_failure is not None and now >= first_failure + SETTLE_S
                if self.stop_reason or self.finding or settled:
                    interrupted = time.time()
                    self.report.event("interrupt", ranks=[x.r.rank for x in missing])
                    for link in missing:
                        await link.send(
                            protocol.sessions.Interrupt(
                                kind=protocol.sessions.INTERRUPT, cell=self.id
                            )
                        )
                    wake = now + grace
                else:
                    assert first_failure is not None
                    wake = first_failure + SETTLE_S
            elif interrupted is not None:
                if time.time() >= interrupted + grace:
                    return self._stuck(missing, failed, interrupted, group)
                wake = now + (interrupted + grace - time.time())
            with anyio.move_on_after(max(0.0, min(wake - now, 1.0))):
                await changed.wait()

    async def _look(self, watch: DesyncWatch, links: list[Link]) -> float:
        """The desync watch while ranks run the cell (`diagnosis.DesyncWatch`, as a job's);
        returns when to look next. A desync it confirms is the cell's finding: the ranks that
        wait are then interrupted."""
        if self.finding or len(self.answers) == len(links):
            return math.inf
        left = any(self.answers.values())
        ranks = self.ranks([link.r for link in links])
        certain = await watch.look(ranks, left)
        if certain is not None and (ev := await watch.confirm(ranks, certain)) is not None:
            self.finding = diagnosis.desync_finding(ev)
            self.report.alert(
                "desync", "error", self.finding.title, rank=self.finding.culprit, text=ev.stacks
            )
        return watch.next_look(left)

    async def _watchdog(
        self, links: list[Link], collector: EvidenceCollector, group: RankGroup
    ) -> Decision | None:
        """A NCCL collective timed out: where every rank is, while all still live. Where NCCL
        ends the rank after its dump (--async-error-handling 1, 3), the session restarts now
        (the rank would abort within a minute anyway); otherwise an alert, and the cell goes on
        (the error may reach it)."""
        assert self.watchdog is not None
        rank, line, when = self.watchdog
        views = self.ranks([link.r for link in links])
        for r in views:
            if r.rank == rank:
                r.watchdog = {"time": when, "line": line}
        ev = await collector.collect(views)
        mode = group.spec.async_error_handling
        if mode not in TEARS_DOWN:
            found = diagnosis.where_finding(diagnosis.watchdog_title(rank, line, mode), ev)
            self.report.alert(
                "collective_timeout", "warning", found.title, rank=found.culprit, text=ev.stacks
            )
            return None
        timed_out = next(r for r in views if r.rank == rank)
        paused = group.prompts.lines(timed_out.attempt)
        self.finding = diagnosis.timeout_finding(timed_out, ev, group.spec, paused)
        self.report.alert(
            "collective_timeout",
            "error",
            self.finding.title,
            rank=self.finding.culprit,
            text=ev.stacks,
        )
        group.signal([link.r for link in links if link.r.died_at is None], signal.SIGKILL)
        return "failed", self.finding.title, time.time(), True

    def _stuck(
        self, missing: list[Link], failed: list[int], interrupted: float, group: RankGroup
    ) -> Decision:
        """Ranks that did not come back from an interrupt: end them; torchelastic restarts."""
        stuck = [link.r.rank for link in missing]
        many = len(stuck) > 1
        note = (
            f"rank{'s' if many else ''} {', '.join(map(str, stuck))} could not be interrupted "
            f"within {group.spec.stop_grace:g} s (inside a collective?) and "
            f"{'were' if many else 'was'} ended"
        )
        group.alert("stuck", "error", note)
        group.signal([link.r for link in missing], signal.SIGKILL)
        if self.stop_reason:
            outcome, reason = self.stopped()
        elif self.finding:
            outcome, reason = "failed", self.finding.title
        else:
            outcome, reason = "failed", failure_words(self, self.attempt, failed)
        return outcome, f"{reason}; {note}", interrupted, True

    def stopped(self) -> tuple[str, str]:
        """The outcome a stop request gives: interrupted, stopped or timeout."""
        reason = self.stop_reason or "user"
        if reason == "timeout":
            outcome, said = "timeout", f"the --timeout of {self.spec.timeout:g} s passed"
        else:
            outcome, said = summary.STOPS.get(reason, ("stopped", reason))
        if self.standing is not None:
            said += f"; before that: {self.standing.title}"
        return outcome, said

    def _failed(self, failed: list[int]) -> str:
        words = self.finding.title if self.finding else failure_words(self, self.attempt, failed)
        return f"{words}; the session keeps its ranks and state"

    # ---- the verdict -------------------------------------------------------------------------

    def ranks(self, session_ranks: list[RankState]) -> list[RankState]:
        """The cell's view of each rank: its records in the cell's run directory, its death
        (if it died) from the session's book."""
        out = []
        for s in session_ranks:
            r = RankState(self.attempt, s.rank, pid=s.pid, started_at=s.started_at)
            r.done = read_json(self.rd.done(self.attempt, s.rank))
            if r.done is None:
                r.failure = read_json(self.rd.failure(self.attempt, s.rank))
            if s.died_at is not None and r.done is None and r.failure is None:
                r.died_at, r.exit_code, r.oom_killed = s.died_at, s.exit_code, s.oom_killed
                r.rss_peak = s.rss_peak
            out.append(r)
        return out

    def chips(self, ranks: list[RankState], teardown_at: float | None) -> None:
        """Each rank's chip: how it ended in the cell, or running (where it stands while a hang
        alert stands; a stop then keeps where it was: "stopped · waiting in all_reduce · line 8")."""
        places = self.places[0] if self.places else {}
        for r in ranks:
            if r.done is not None:
                label, state = "finished", "done"
            elif r.failure is None and r.died_at is None:
                label, state = places.get(r.rank, "running"), "running"
            else:
                kind = r.kind(teardown_at)
                state = "stopped" if kind in ("terminated", "peer") else "failed"
                label = r.label(teardown_at)
                if self.stop_reason and r.rank in places and state == "stopped":
                    label = f"stopped · {places[r.rank]}"
            chip = protocol.records.Chip(state=state, label=label, attempt=r.attempt, pid=r.pid)
            if state in ("failed", "stopped"):
                chip["detail"] = r.failure_summary()
            self.report.chip(r.rank, chip)

    def oom_alerts(self, ranks: list[RankState]) -> None:
        """An alert for each rank that ran out of CUDA memory, once per rank."""
        for r in ranks:
            if r.rank in self._oom_told:
                continue
            if r.failure is not None and r.kind(None) == "oom":
                self._oom_told.add(r.rank)
                title, text = diagnosis.oom_alert(r)
                self.report.alert("oom", "error", title, rank=r.rank, text=text)

    def conclude(
        self,
        outcome: str,
        reason: str,
        ranks: list[RankState],
        teardown_at: float | None,
        lines: int,
    ) -> protocol.records.Summary:
        """The cell's summary, written and returned (the closing alerts are queued)."""
        behind = self.finding.desync.behind if self.finding and self.finding.desync else None
        found = self.finding or (self.standing if self.stop_reason else None)
        verdict = analyze(ranks, teardown_at, behind, len(ranks)) if ranks else None
        result = summary.summarize(
            job_id=self.id,
            spec=self.spec,
            rd=self.rd,
            outcome=outcome,
            reason=reason,
            verdict=verdict or Verdict(None, None, []),
            attempt=self.attempt,
            created=self.created,
            zombie=False,
            diagnosis=found.record if found else None,
            leftovers=[],
            lines=lines,
            memory=self.peaks.record(),
            checkpoints=self.checkpoints,
        )
        result["session"] = self.session_id
        if self.restarted_to is not None:
            result["restarts"] = self.restarted_to  # the restart this cell's failure brought
        self.chips(ranks, teardown_at)
        for alert in summary.closing_alerts(result, ranks, []):
            self.report.alert(**alert)
        self.report.set_state(outcome)
        with contextlib.suppress(OSError):
            write_json(self.rd.summary, result)
        self.report.event("end", outcome=outcome)
        return result


def failure_words(cell: SessionCell, attempt: int, failed: list[int]) -> str:
    """The first of the `failed` ranks to raise in the cell: its error and its line."""
    records: list[tuple[int, dict[str, Any]]] = []
    for rank in failed:
        if f := read_json(cell.rd.failure(attempt, rank)):
            records.append((rank, f))
    if not records:
        return f"rank {failed[0]}"
    rank, f = min(records, key=lambda x: x[1]["time"])
    line = f" (cell line {f['cell_line']})" if f.get("cell_line") else ""
    return f"rank {rank}: {f['type']}: {f['message']}".rstrip(": ") + line
