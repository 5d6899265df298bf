"""One cell run on a session's ranks: a job of its own for the kernel (its updates, its end, a
run directory with its source, its records and its summary), whose ranks are the session's.

The cell is sent to every rank over the session's private channel; each rank answers ``ran``
once its records are in the cell's run directory. What decides the cell is the group's decision
core (`runs.cell_rules`: its rules, and the group's judgment of a death as it makes it); this is
its shell: what the cell hears becomes the core's events (`inbox`), what the core decides for
the cell is carried out here (interrupts, kills, alerts), and the desync watch and NCCL's
watchdog take their evidence while it runs.
"""

from __future__ import annotations

import contextlib
import math
import signal
import time
from typing import TYPE_CHECKING

import anyio

from elastic_nb import protocol
from elastic_nb.common.rank_state import RankState
from elastic_nb.common.rundir import RunDir, read_json, write_json
from elastic_nb.common.spec import TEARS_DOWN
from elastic_nb.common.submission import Submission
from elastic_nb.supervisor.forensics.verdict import Verdict, analyze
from elastic_nb.supervisor.ranks.checkpoint_log import CheckpointLog
from elastic_nb.supervisor.ranks.evidence import EvidenceCollector
from elastic_nb.supervisor.ranks.memory_watch import Peaks
from elastic_nb.supervisor.runs import cell_rules, diagnosis, summary
from elastic_nb.supervisor.runs.diagnosis import DesyncWatch, Finding
from elastic_nb.supervisor.runs.rank_group import RankGroup
from elastic_nb.supervisor.runs.reporter import Reporter, Send

if TYPE_CHECKING:
    from elastic_nb.supervisor.ranks.rank_links import Link

__all__ = ["Decision", "SessionCell", "failure_words"]


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
        self.ended = anyio.Event()  # its END is sent (Followed.end)
        self.answers: dict[int, bool] = {}  # rank -> finished (True) or raised (False)
        # rank -> its output's bytes when it answered ("out", "err"): the cell ends after them
        self.written: dict[int, dict[str, int]] = {}
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
        # The decision core's side (`decide`): what the cell heard, for the core; what the core
        # decided, to carry out; when it asked to look again; its end.
        self.inbox: list[cell_rules.CellEvent] = []
        self.todo: list[cell_rules.CellAction] = []
        self.wake = math.inf
        self.done: cell_rules.CellDone | None = None

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

    def hear(self, event: cell_rules.CellEvent) -> None:
        """An event for the decision core, heard at `decide`'s next pass."""
        self.inbox.append(event)
        self.poke()

    def request_stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
            self.report.event("stop", reason=reason)
            self.hear(cell_rules.StopAsked(time.time(), self.id, reason))

    def on_watchdog(self, rank: int, line: str) -> None:
        """NCCL's watchdog says this rank's collective timed out (its first such line)."""
        if self.watchdog is None:
            self.watchdog = (rank, line, time.time())
            self.report.event("rank.watchdog", rank=rank, line=line)
            self.poke()

    def sent(self) -> None:
        """The cell was sent to the ranks (to run, or to replay): their answers come anew."""
        self.answers, self.written, self.inbox = {}, {}, []

    def answer(self, rank: int, ok: bool, written: dict[str, int] | None = None) -> None:
        """A rank ran the cell (`written`: the bytes of its stdout and stderr by then)."""
        self.answers[rank] = ok
        if written is not None:
            self.written[rank] = written
        if self.running:  # not a replay's: the core decides it
            said = None if ok else raised(self, self.attempt, rank)
            at, words = said if said is not None else (None, None)
            self.hear(cell_rules.Answered(time.time(), self.id, rank, ok, at, words))
        else:
            self.poke()

    # ---- deciding -----------------------------------------------------------------------------

    async def decide(self, links: list[Link], group: RankGroup) -> Decision:
        """Run the core's rules for the cell until they say it is done: its ranks' answers,
        stops and deadlines heard as they come, the core's interrupts and kills carried out."""
        self.done, self.todo, self.wake = None, [], math.inf
        deadline = self.created + self.spec.timeout if self.spec.timeout else None
        ranks = tuple(link.r.rank for link in links)
        self.inbox[:0] = [
            cell_rules.CellBegan(
                time.time(),
                self.id,
                self.attempt,
                ranks,
                deadline,
                self.spec.timeout,
                group.spec.stop_grace,
            )
        ]
        collector = EvidenceCollector(group.rd, group.book.site, self.source, self.rd.cell)
        watch = DesyncWatch(collector) if len(links) > 1 else None
        look_at = math.inf
        watchdog_seen = False
        while True:
            # Taken before anything below awaits: what lands while this pass hears or sends
            # sets the event waited on at its end, not a successor (poke replaces it).
            changed = self.changed
            inbox, self.inbox = self.inbox, []
            for event in inbox:
                group.hear(event)
            if time.time() >= self.wake:
                self.wake = math.inf
                group.hear(cell_rules.Tick(time.time(), self.id))
            await self._carry_out(links, group)
            if self.done is not None:
                d = self.done
                return d.outcome, d.reason, d.interrupted_at, d.restarts
            if self.watchdog is not None and not watchdog_seen:
                watchdog_seen = True
                await self._watchdog(links, collector, group)
                continue
            rules = group.core.cell
            if watch is not None and rules is not None and rules.watching:
                look_at = await self._look(watch, links)
            wait = min(self.wake - time.time(), look_at - time.monotonic(), 1.0)
            with anyio.move_on_after(max(0.0, wait)):
                await changed.wait()

    def act(self, action: cell_rules.CellAction) -> None:
        """The core decided for this cell: carried out at the next pass of `decide`."""
        self.todo.append(action)
        self.poke()

    async def _carry_out(self, links: list[Link], group: RankGroup) -> None:
        todo, self.todo = self.todo, []
        by_rank = {link.r.rank: link for link in links}
        for action in todo:
            if isinstance(action, cell_rules.Interrupt):
                self.report.event("interrupt", ranks=list(action.ranks))
                for rank in action.ranks:
                    await by_rank[rank].send(
                        protocol.sessions.Interrupt(kind=protocol.sessions.INTERRUPT, cell=self.id)
                    )
            elif isinstance(action, cell_rules.KillRanks):
                if action.note is not None:
                    group.alert("stuck", "error", action.note)
                live = [by_rank[x].r for x in action.ranks if by_rank[x].r.died_at is None]
                group.signal(live, signal.SIGKILL)
            elif isinstance(action, cell_rules.TellOom):
                self.oom_alerts(self.ranks([by_rank[x].r for x in action.ranks]))
            elif isinstance(action, cell_rules.StopCell):
                self.request_stop(action.reason)
            elif isinstance(action, cell_rules.WakeAt):
                self.wake = action.t
            elif isinstance(action, cell_rules.CellDone):
                self.done = action

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
            self.hear(cell_rules.Found(time.time(), self.id, self.finding.title))
        return watch.next_look(left)

    async def _watchdog(
        self, links: list[Link], collector: EvidenceCollector, group: RankGroup
    ) -> None:
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
            return
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
        self.hear(cell_rules.Found(time.time(), self.id, self.finding.title, ends=True))

    def stopped(self) -> tuple[str, str]:
        """The outcome a stop request gives a cell that never ran: interrupted or stopped."""
        return cell_rules.stop_words(self.stop_reason or "user", self.spec.timeout)

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


def raised(cell: SessionCell, attempt: int, rank: int) -> tuple[float, str] | None:
    """When the rank raised in the cell, and its error and line in words (its failure record's)."""
    f = read_json(cell.rd.failure(attempt, rank))
    if f is None:
        return None
    line = f" (cell line {f['cell_line']})" if f.get("cell_line") else ""
    return f["time"], f"rank {rank}: {f['type']}: {f['message']}".rstrip(": ") + line


def failure_words(cell: SessionCell, attempt: int, failed: list[int]) -> str:
    """The first of the `failed` ranks to raise in the cell: its error and its line."""
    records = [said for rank in failed if (said := raised(cell, attempt, rank)) is not None]
    return min(records)[1] if records else f"rank {failed[0]}"
