"""One job in the supervisor: a rank group whose ranks run one cell, and what tells its end.

A job runs until its outcome is decided (the decision core, `decider.Decider`, from the events
the job hears), then it tears its process tree down and reports (the rank group's mechanics,
`rank_group.RankGroup`). What the job adds to the group's events:

* each rank's failure record as it appears, and NCCL's watchdog line       -> RankFailed, Watchdog
* a desync the flight recorders make certain                              -> LookBegan, Diagnosed
* torchelastic's agent stuck (the zombie watchdog)                        -> Ended: failed, or
                                                                             succeeded if every
                                                                             rank had finished
* `stop` from a client (interrupt, %elastic stop)                          -> Ended: interrupted
* the --timeout deadline                                                   -> Ended: timeout

Deciding on our own observations rather than waiting for `elastic_launch` to return is what
makes failures fast: torchelastic notices a dead rank at its next monitor tick and formats its
report before stopping the others. Here the launcher and every process carrying the job's
marker get SIGTERM at once, the whole process group SIGKILL after the grace, and every process
of the job is accounted for before the kernel hears the end.

Diagnoses are the job's too: when a rank times out in a collective, the ranks desync or fall
silent, the evidence (every stack, every flight recorder) is taken while they still live, and
the attempt's decision waits for it (an unconfirmed desync must not swallow a rank's own
exception, nor a teardown destroy the evidence of where the others were): the core asks for the
evidence (`Diagnose`) and the job takes it (`_diagnose`).
"""

from __future__ import annotations

import time
from typing import Any

import anyio
from anyio.abc import TaskGroup

from elastic_nb import protocol
from elastic_nb.common.rank_state import RankState
from elastic_nb.common.spec import TEARS_DOWN
from elastic_nb.common.submission import Submission
from elastic_nb.supervisor.forensics.desync import Desync
from elastic_nb.supervisor.forensics.verdict import Verdict, analyze
from elastic_nb.supervisor.forensics.watchdogs import agent_stuck
from elastic_nb.supervisor.processes.site import Site
from elastic_nb.supervisor.ranks.evidence import Evidence, EvidenceCollector
from elastic_nb.supervisor.runs import decider, diagnosis, summary
from elastic_nb.supervisor.runs.diagnosis import DesyncWatch, Finding
from elastic_nb.supervisor.runs.rank_group import RankGroup
from elastic_nb.supervisor.runs.reporter import Reporter, Send
from elastic_nb.supervisor.runs.rounds import Machines

__all__ = ["Job"]

WATCH_S = 0.25  # the zombie watchdog and --hang-after look this often
RELEASE_WAIT_S = 1.0  # for a held rank's word that it was released (it goes in any case)
STOPPED = ("timeout", "interrupted", "stopped")  # outcomes that end a job from outside it


class Job(RankGroup):
    def __init__(
        self,
        cell: Submission,
        env: dict[str, str],
        site: Site | None,
        send: Send,
        machines: Machines | None = None,
    ) -> None:
        super().__init__(cell.id, cell.spec, site, send, machines)
        self._cell, self._env = cell, env
        self._created_mono = time.monotonic()
        self._leftovers: list[protocol.records.Leftover] = []
        self._watchdog_fired = False  # the zombie watchdog stopped the agent
        self._next_watch = 0.0  # monotonic: the watchdogs' next look
        self._collector = EvidenceCollector(self.rd, self.book.site, cell.source)
        self.finding: Finding | None = None  # what the summary says about a timeout or desync
        # The last hang or kept-alive watchdog alert's finding, by attempt: a job stopped while it
        # stood (--timeout, an interrupt, Stop) ends with it, not with "stopped" on every rank.
        self.standing: tuple[int, Finding] | None = None
        # Where each rank was at that alert (its chip says so until a rank speaks again, and
        # after a stop): attempt, rank -> words, the lines counted then.
        self._places: tuple[int, dict[int, str], int] | None = None
        self._watchdog_alerts: set[int] = set()  # attempts whose NCCL timeouts end nothing

    # ---- for the service -----------------------------------------------------------------

    @property
    def state(self) -> str:
        return self.report.state

    def request_stop(self, reason: str) -> None:
        self._decide(*summary.STOPS.get(reason, ("stopped", reason)))

    def prepare(self) -> None:
        """Create the run directory; a failure here is the submitter's error, not a job's."""
        self._cell.write(self.rd)
        self.report.open(self.rd.events)
        self.report.event("created", nproc=self.spec.nproc)

    async def stacks(self) -> str:
        """Every rank's stack now (``%elastic stacks``); also shown as an alert."""
        ev = await self._evidence()
        title = f"stacks of every rank, attempt {self.attempt}"
        if ev.desync is not None and ev.desync.behind:
            title += f": {ev.desync.text}"
        self.report.alert("stacks", "info", title, text=ev.stacks)
        return f"{title}\n{ev.stacks}"

    # ---- the rank group's hooks -----------------------------------------------------------

    def _launch_env(self) -> dict[str, str]:
        return self._env

    def _start_tasks(self, tg: TaskGroup) -> None:
        tg.start_soon(self._watch_desync)
        if self.spec.timeout is not None:
            tg.start_soon(self._deadline, self.spec.timeout)

    def _on_ready(self) -> None:
        self.report.set_state("rendezvous")

    def _new_attempt(self, attempt: int) -> None:
        if self.multi_node:
            return  # its round said why it began (rounds.Rounds)
        found = self.finding
        desync = found.desync.text if found and found.desync else None
        self.poll_checkpoints()  # a save committed just before the failure counts
        self.report.alert(
            **summary.restart_alert(self.book, attempt - 1, desync, self.spec, self.checkpoints)
        )

    def _on_rank_started(self, r: RankState) -> None:
        self.report.set_state("running")  # its chip: the decision core's (decider.Show)
        # Every rank runs: a moment for each site to ready its next launcher (a multi-node job's
        # next round takes one on every node).
        if (r.attempt == 0 or self.multi_node) and len(self.book.of(r.attempt)) == self.world_size:
            for site in self.sites:
                site.ranks_up(self.spec)

    def _rank_ended(self, r: RankState) -> None:
        self.hear(decider.RankExited(time.time(), r))

    def _on_watchdog_line(self, attempt: int, rank: int, line: str) -> None:
        r = self.book.get(attempt, rank)
        if r is not None:
            self._on_watchdog(r, line)

    def _asker(self) -> Reporter | None:
        return self.report

    def _poll(self) -> None:
        # Records land before the process exits (torch and Python teardown can take a while):
        # act on a failure at once.
        if self.attempt not in self.core.replaced:
            for r in self.book.new_failures(self.attempt):
                self.hear(decider.RankFailed(time.time(), r))
        # The watchdogs' bounds are seconds: a look every WATCH_S (each reads the launcher's
        # /proc entries) is all they need.
        now = time.monotonic()
        if now >= self._next_watch:
            self._next_watch = now + WATCH_S
            self._watch_agent()
            self._watch_silence()

    async def _before_teardown(self, outcome: str) -> None:
        # After a success, name what the cell left running before the teardown ends it.
        if outcome == "succeeded":
            for site in self.sites:
                self._leftovers += await site.leftovers_after_success(
                    self.spec.stop_grace, lambda: self._watchdog_fired
                )

    async def _deadline(self, timeout: float) -> None:
        """--timeout, counted from the job's creation on the monotonic clock."""
        # Past already when a cell's own zygote took longer than the deadline (anyio refuses a
        # negative delay).
        await anyio.sleep(max(0.0, timeout - (time.monotonic() - self._created_mono)))
        self._decide("timeout", f"the --timeout of {timeout:g} s passed")

    # ---- deciding ---------------------------------------------------------------------------

    def show(self, r: RankState) -> None:
        if r.attempt == self.attempt:
            self.report.chip(r.rank, self.book.chip(r, self.teardown_at))

    # ---- watchdogs ----------------------------------------------------------------------------

    def _watch_agent(self) -> None:
        """The zombie watchdog (`watchdogs.agent_stuck` judges), for each site's agent: say so,
        and stop the launcher, SIGTERM breaks the agent's stuck wait."""
        if self.decided and self.multi_node:
            # Across machines the teardown ends every node's processes by order of their agents:
            # a launcher waits there for its last word, not stuck. On one machine an agent stuck
            # after every result was read is still one to name (and stop).
            return
        for site in self.sites:
            if self._watchdog_fired or not site.launcher_alive():
                continue
            stuck = agent_stuck(
                [r for r in self.book.all() if self.book.site(r) is site],
                [r for r in self.book.of(self.attempt) if self.book.site(r) is site],
                self.spec,
                site.torch_agent(),
                self.teardown_at,
                ticking=not self.decided and self.state == "running",
                unreaped=site.unreaped,
                exit_barrier=self.multi_node,
            )
            if stuck is not None:
                self._agent_stuck(stuck)

    def _agent_stuck(self, stuck: Any) -> None:
        self._watchdog_fired = True
        if stuck.zombie is not None:
            self.book.zombies.add((stuck.zombie.attempt, stuck.zombie.rank))
            self.show(stuck.zombie)
        self.report.alert("zombie", "error", stuck.title)
        self._decide(stuck.outcome, stuck.reason)

    def _watch_silence(self) -> None:
        """--hang-after (`watchdogs.Silence` judges): an alert with every stack, nothing ends."""
        quiet = not self.decided and self.state == "running" and not self.core.under_way
        now = time.monotonic()
        hang_after = self.spec.hang_after if quiet else None
        in_cell = self.book.in_the_cell(self.attempt)
        if self._places is not None and self._places[2] != self.tailer.activity_total():
            self._places = None  # a rank spoke: the chips say "running" again
            self._show_places()
        if self.silence.due(now, self.tailer.activity_total(), in_cell, hang_after):
            silent_for = now - self.silence.last_activity
            title = f"no output and no exit from any rank for {silent_for:.0f} s (--hang-after)"
            self.task_group.start_soon(self._report_where, "hang", title)

    def _on_watchdog(self, r: RankState, line: str) -> None:
        """NCCL's watchdog says this rank's collective timed out. The rank lives on for a
        minute (the flight recorder's dump, then SIGABRT): diagnose now, while every rank can
        still show where it is."""
        if r.watchdog is not None or r.failure is not None:
            return
        self.report.event("rank.watchdog", attempt=r.attempt, rank=r.rank, line=line)
        mode = self.spec.async_error_handling
        if mode in TEARS_DOWN:
            # a collective timeout: diagnosed, then the attempt fails
            self.hear(decider.Watchdog(time.time(), r, line))
        elif r.attempt not in self._watchdog_alerts:
            # The rank lives on and the error may reach the cell, which may handle it: say
            # where every rank is (once an attempt: every rank's watchdog says it), end nothing.
            self._watchdog_alerts.add(r.attempt)
            self.task_group.start_soon(
                self._report_where,
                "collective_timeout",
                diagnosis.watchdog_title(r.rank, line, mode),
            )

    # ---- diagnoses ----------------------------------------------------------------------------

    async def _evidence(self) -> Evidence:
        """Where every rank of the current attempt is and what it ran, from fresh records."""
        ranks = self.book.of(self.attempt)
        for r in ranks:
            self.book.read_records(r)
        return await self._collector.collect(ranks)

    async def _report_where(self, kind: str, title: str) -> None:
        """An alert with every rank's stack and what they say of a desync; nothing ends."""
        ev = await self._evidence()
        found = diagnosis.where_finding(title, ev, self.held_memory())
        self.standing = (self.attempt, found)
        self.report.alert(kind, "warning", found.title, rank=found.culprit, text=found.stacks)
        self._places = (self.attempt, self.places(ev.places), self.tailer.activity_total())
        self._show_places()

    def _show_places(self) -> None:
        """Each live rank's chip: where it is (the last alert's places), or running again."""
        places = self._places[1] if self._places and self._places[0] == self.attempt else {}
        for r in self.book.of(self.attempt):
            if r.died_at is None and not self.decided:
                chip = self.book.chip(r, self.teardown_at)
                chip["label"] = places.get(r.rank, chip["label"])
                self.report.chip(r.rank, chip)

    def _diagnose(self, what: str, r: RankState) -> None:
        diagnose = self._diagnose_timeout if what == "timeout" else self._diagnose_peer
        self.task_group.start_soon(diagnose, r)

    async def _diagnose_timeout(self, r: RankState) -> None:
        try:
            ev = await self._evidence()
            self._release_held(r.attempt)
            found = diagnosis.timeout_finding(r, ev, self.spec, self.prompts.lines(r.attempt))
            if found.desync is not None:
                self._blame(r.attempt, found.desync)
            self.finding = found
            self.report.alert(
                "collective_timeout", "error", found.title, rank=found.culprit, text=found.stacks
            )
        finally:
            self.hear(decider.Diagnosed(time.time(), r.attempt, "timeout", r))

    def _release_held(self, attempt: int) -> None:
        """The evidence is taken: the ranks whose collective timed out, holding their exit for it
        (rank/recorder.hold_for_evidence), may go, and torch's agent then ends or restarts the
        group as it would have."""
        for x in self.book.of(attempt):
            if x.died_at is None and x.kind(None) == "collective_timeout" and x.failure:
                site = self.book.site(x)
                release = protocol.rank_probes.PROBE_RELEASE
                self.task_group.start_soon(site.probe, x, release, RELEASE_WAIT_S)

    async def _diagnose_peer(self, r: RankState) -> None:
        """A peer of `r` went while `r` waited in a collective (the core waited for it to be
        seen gone): if the one that went had finished the cell (its records and the others'
        flight recorders say so), a desync."""
        culprit, reason = None, None
        try:
            ev = await self._evidence()
            if ev.desync is not None and ev.desync.certain and ev.desync.behind:
                culprit, reason = self._desync_found(r.attempt, ev)
        finally:
            self.hear(decider.Diagnosed(time.time(), r.attempt, "peer", r, culprit, reason))

    def _desync_found(self, attempt: int, ev: Evidence) -> tuple[RankState, str]:
        """A confirmed desync: its finding, its culprit's chip and its alert; the culprit."""
        self.finding = diagnosis.desync_finding(ev)
        assert ev.desync is not None and self.finding.culprit is not None
        self._blame(attempt, ev.desync)
        self.report.alert(
            "desync", "error", self.finding.title, rank=self.finding.culprit, text=ev.stacks
        )
        return self.book.ranks[(attempt, self.finding.culprit)], self.finding.title

    async def _watch_desync(self) -> None:
        """The desync watch (`diagnosis.DesyncWatch`), one per attempt, while every rank of it
        has started and one still runs the cell."""
        if self.spec.nproc < 2 and not self.multi_node:
            return  # one rank cannot fall out of step with itself
        attempt, watch = -1, DesyncWatch(self._collector)
        while True:
            await anyio.sleep(diagnosis.LOOK_LEFT_S)
            if attempt != self.attempt:
                attempt, watch = self.attempt, DesyncWatch(self._collector)
            ranks = self.book.of(attempt)
            live = [r for r in ranks if r.died_at is None and r.done is None and r.failure is None]
            if (
                self.decided
                or self.core.under_way
                or self.state != "running"
                or len(ranks) < self.world_size
                or attempt in self.core.failed
                or not live
            ):
                watch.forget()
                continue
            certain = await watch.look(ranks, left=any(r.done is not None for r in ranks))
            if certain is not None and not self.decided and not self.core.under_way:
                await self._desync(attempt, watch, certain)

    async def _desync(self, attempt: int, watch: DesyncWatch, certain: Any) -> None:
        """Take the stacks and a full look; if the desync holds, report it and end the attempt."""
        self.hear(decider.LookBegan(time.time(), attempt))
        culprit, reason = None, None
        try:
            ranks = self.book.of(attempt)
            for r in ranks:
                self.book.read_records(r)
            ev = await watch.confirm(ranks, certain)
            if ev is None or attempt != self.attempt or self.decided:
                # The full look did not bear it out: keep watching (and keep the record).
                last = watch.last
                self.report.event(
                    "desync.unconfirmed",
                    looked={r: {"last": h.last, "left": h.left} for r, h in last.histories.items()}
                    if last
                    else {},
                    verdict=last.desync.text if last and last.desync else None,
                )
                return
            culprit, reason = self._desync_found(attempt, ev)
        finally:
            self.hear(decider.Diagnosed(time.time(), attempt, "look", None, culprit, reason))

    def _blame(self, attempt: int, desync: Desync) -> None:
        for r in self.book.blame(attempt, desync):
            self.show(r)

    # ---- the end ---------------------------------------------------------------------------

    async def _summarize(self, outcome: str, reason: str) -> protocol.records.Summary:
        self.tailer.poll(final=True)
        self.poll_checkpoints()
        self.book.settle()
        current = self.book.of(self.attempt)
        behind = self.book.behind.get(self.attempt)
        verdict = analyze(current, self.teardown_at, behind, self.world_size)
        reason = self._as_the_verdict_says(outcome, reason, verdict)
        standing = self._places if self._places and self._places[0] == self.attempt else None
        for r in current:
            chip = self.book.chip(r, self.teardown_at, verdict.root)
            if standing and outcome in STOPPED and r.kind(self.teardown_at) == "terminated":
                # Stopped while a hang alert stood: where it was, not only how it ended.
                chip["label"] = f"stopped · {standing[1].get(r.rank, chip['label'])}"
            self.report.chip(r.rank, chip)
        result = self._verdict_summary(outcome, reason, verdict)
        for alert in summary.closing_alerts(result, current, self._leftovers):
            self.report.alert(**alert)
        self.report.set_state(outcome)
        await self.report.flush(self.attempt, self.tailer)
        return result

    def _as_the_verdict_says(self, outcome: str, reason: str, verdict: Verdict) -> str:
        """A peer's error decided the job before the death it reports was seen (a site that sees
        it only at the teardown): the reason names the rank the verdict, with every end in hand,
        found failed first, as the failure does."""
        pinned, root = self.core.pinned.get(self.attempt), verdict.root
        if outcome != "failed" or pinned is None or root is None or root is pinned:
            return reason
        if pinned.kind(self.teardown_at) != "peer":
            return reason
        return reason.replace(
            f"{pinned.name} {pinned.failure_summary()}", f"{root.name} {root.failure_summary()}"
        )

    def _plain_summary(self, outcome: str, reason: str) -> protocol.records.Summary:
        return self._verdict_summary(outcome, reason, Verdict(None, None, []))

    def _verdict_summary(
        self, outcome: str, reason: str, verdict: Verdict
    ) -> protocol.records.Summary:
        finding = self.finding
        if finding is None and outcome in STOPPED and self.standing is not None:
            attempt, found = self.standing
            if attempt == self.attempt:
                finding, reason = found, f"{reason}; before that: {found.title}"
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
            diagnosis=finding.record if finding else None,
            leftovers=self._leftovers,
            lines=self.tailer.lines_total(),
            memory=self.memory.peaks.record(),
            checkpoints=self.checkpoints,
            world_size=self.world_size,
            restarts=self.restarts,
            nodes_missing=self.nodes_missing,
        )
