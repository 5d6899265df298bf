"""A rank group: ranks that torchelastic starts, restarts and ends together, under one run
directory, on one node or several. A one-off job (`job.Job`: its ranks run one cell) and a
session (`sessions.session.Session`: its ranks run cell after cell) are rank groups; this is what
they share, from the launcher's start to the kernel hearing the end:

* start: a launcher at each of its sites, given the group's run directory, spec and environment
  (a single-node group: this machine's site, for its whole life, torch restarting its ranks; a
  multi-node group: a round at a time; the two lifecycles apart, behind `placement.Placement`);
* observe: the launchers' messages (each rank's start and exit), a watcher per rank (its site
  says when it went, its records how), a poll loop that tails the ranks' logs and flushes the
  group's news to the kernel (at most every FLUSH_S) and follows the checkpoints its cells save
  and load (said as `checkpoint_news` words them), and each rank's memory once a second (read as
  `group_memory` reads it);
* end: once the group's outcome is decided, the teardown of every process of it on every node, a
  wait for the launchers' last word, the summary, and the END message.

Everything done to a rank goes through the site it runs at (`RankBook.site`).

What the group decides is the decision core's (`decider.Decider`: events in, actions out); the
group is its shell: it turns what it hears into the core's events and carries out the actions
(`act`), with each kind's own steps in its hooks (group_hooks.GroupHooks), so that a job and a
session see ranks, logs and their end alike.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import time
from typing import Any

import anyio
from anyio.abc import TaskGroup

from elastic_nb import protocol
from elastic_nb.common.rank_state import NCCL_TIMEOUT_MARKS, TORCH_LOG_NOISE, RankState
from elastic_nb.common.rundir import RunDir, write_json
from elastic_nb.common.spec import JobSpec
from elastic_nb.supervisor.forensics.watchdogs import Silence
from elastic_nb.supervisor.processes.site import Site, Survivor, Work
from elastic_nb.supervisor.ranks.checkpoint_log import CheckpointLog
from elastic_nb.supervisor.ranks.log_tailer import LogTailer
from elastic_nb.supervisor.ranks.memory_watch import SAMPLE_S, MemoryWatch
from elastic_nb.supervisor.ranks.rank_book import RankBook
from elastic_nb.supervisor.runs import cell_rules, checkpoint_news, decider, diagnosis, summary
from elastic_nb.supervisor.runs.decider import Decider
from elastic_nb.supervisor.runs.group_hooks import GroupHooks
from elastic_nb.supervisor.runs.group_memory import memory_figures, read_memory
from elastic_nb.supervisor.runs.placement import InRounds, OneMachine, Placement
from elastic_nb.supervisor.runs.prompts import GroupPrompts, Prompts
from elastic_nb.supervisor.runs.reporter import Reporter, Send
from elastic_nb.supervisor.runs.rounds import Machines

__all__ = ["RankGroup"]

log = logging.getLogger(__name__)

POLL_S = 0.05  # log tail and record polling
FLUSH_S = 0.1  # one update per group per flush: at most 10 messages a second
# The least SIGTERM -> SIGKILL of those who stop a group's ranks but the teardown (--stop-grace):
# torch's agent (max(1, round(--stop-grace))) and a join agent (served_group.STOP_GRACE_S).
KILL_AFTER_S = 1.0
IDLE_STOP_GRACE_S = 0.2  # SIGTERM -> SIGKILL for a site of a multi-node group with no live rank
PROCESS_GROUP_LOOK_S = 1.0  # a look for the ranks' first process group (a few stats)


class RankGroup(GroupHooks, GroupPrompts):
    kind = "job"  # what the logs and errors call it
    # The outcomes whose decision is the moment the group begins to end its ranks (Decider)
    stops_ranks = frozenset({"failed", "timeout", "interrupted", "stopped"})
    # Failures this kind restarts from though its placement would end on them (a session ends
    # the others of an exit(0), and torch restarts the group)
    restarts_from: frozenset[str] = frozenset()

    def __init__(
        self,
        group_id: str,
        spec: JobSpec,
        site: Site | None,
        send: Send,
        machines: Machines | None = None,
    ) -> None:
        """`site`: a single-node group's (this machine's); `machines`: where a multi-node
        group's sites come from, a round at a time."""
        self.id = group_id
        self.spec = spec
        self.created = time.time()
        self.summary: protocol.records.Summary | None = None
        self.sites: list[Site] = []  # the current round's
        self.placement: Placement
        if site is not None:
            self.rd = site.rd
            self.placement = OneMachine(self, site)
        else:
            assert machines is not None, "a group runs at a site or on machines"
            self.rd = RunDir.of(spec.log_dir, group_id)
            self.placement = InRounds(self, machines)
        self.core = Decider(
            spec.max_restarts,
            self.placement.final - self.restarts_from,
            self.placement.awaited,
            self.stops_ranks,
        )
        # SIGTERM -> SIGKILL: --stop-grace for the teardown, max(1, round(it)) for torch's agent,
        # 1 s for a join agent's; half the shortest, for an agent that began before the teardown.
        self.book = RankBook(self.rd, kill_window=min(spec.stop_grace, KILL_AFTER_S) / 2)
        self.report = Reporter(group_id, send)
        self.tailer = LogTailer(marks=NCCL_TIMEOUT_MARKS, noise=TORCH_LOG_NOISE)
        self.silence = Silence(last_activity=time.monotonic())  # --hang-after's clock
        self.prompts = Prompts(self.rd)  # the ranks' input(), asked in the notebook
        # --pdb: the ranks held (SIGSTOP) while a rank is in post-mortem, by that rank
        self._held: dict[tuple[int, int], list[RankState]] = {}
        self._collectives_warned: set[int] = set()  # attempts told a paused rank's cost
        self.memory = MemoryWatch()
        self.checkpoints = CheckpointLog(self.rd.checkpoints)
        # The latest attempt a rank of which made torch's process group (its collectives can time
        # out: the dashboards say what --collective-timeout will do), and the next look for one.
        self.process_group_made: int | None = None
        self._process_group_look = 0.0
        self.nodes_missing = False  # a multi-node group's nodes did not come (cause: nodes)
        self._decided = anyio.Event()
        self._heard = anyio.Event()  # every message of the launchers taken in (book.hear_out)
        self._unheard = 0  # launchers of the current round whose messages are still coming
        self._tg: TaskGroup | None = None

    # ---- for the service ----------------------------------------------------------------

    @property
    def running(self) -> bool:
        return self.summary is None

    @property
    def decided(self) -> bool:
        return self.core.decided

    @property
    def attempt(self) -> int:
        """The latest attempt a rank of which started."""
        return self.core.attempt

    @property
    def restarts(self) -> int:
        """Spent: a single-node group's is its attempt (torch's count)."""
        return self.core.restarts

    @property
    def teardown_at(self) -> float | None:
        """When ending the ranks began (our clock)."""
        return self.core.teardown_at

    @property
    def last_failure(self) -> tuple[float, str, bool] | None:
        """The latest failure that ended an attempt (when, who: "rank 2", lost with its
        machine), for the words of what it cost (the resume that follows it)."""
        return self.core.last_failure

    @property
    def launcher_pid(self) -> int | None:
        """This machine's launcher of the group, if one runs (the service keeps it its own)."""
        return next((s.launcher_pid for s in self.sites if s.number == 0), None)

    @property
    def world_size(self) -> int:
        """Ranks in the current attempt: a round's nodes' in a multi-node group."""
        return self.placement.world_size(self.attempt)

    @property
    def multi_node(self) -> bool:
        return self.placement.multi_node

    def ended(self) -> str | None:
        """Why the group ended, once its outcome is decided."""
        return self.core.outcome[1] if self.core.outcome is not None else None

    def attempt_failed(self, attempt: int) -> bool:
        return attempt in self.core.failed

    def alert(self, kind: str, severity: str, title: str, **about: Any) -> None:
        """About the group, to whoever follows it (`about`: Reporter.alert's rank, key or ends)."""
        self.report.alert(kind, severity, title, **about)

    def memory_now(self) -> dict[str, protocol.kernel.RankMemory]:
        """What %elastic status prints of each rank's memory."""
        return memory_figures(self.memory, self.attempt)

    def held_memory(self) -> dict[int, int | None]:
        """Each rank's latest host memory in the current attempt (rank -> bytes)."""
        return {rank: s["rss"] for rank, s in self.memory.latest(self.attempt).items()}

    def signal(self, ranks: list[RankState], sig: int) -> None:
        for r in ranks:
            r.killed = r.killed or sig == signal.SIGKILL
            self.book.site(r).signal(r, sig)

    def restarts_left(self, attempt: int) -> bool:
        """A failure in `attempt` can still be restarted from."""
        return self.core.restarts_left(attempt)

    @property
    def task_group(self) -> TaskGroup:
        assert self._tg is not None, "the group is not running"
        return self._tg

    # ---- its life ---------------------------------------------------------------------------

    async def run(self) -> None:
        try:
            if self.decided:
                return  # stopped before it started
            await self._open()
            async with anyio.create_task_group() as tg:
                self._tg = tg
                await self.placement.begin(tg)
                tg.start_soon(self._poll_loop)
                tg.start_soon(self._sample_memory)
                self._start_tasks(tg)
                await self._decided.wait()
                # Rank watchers and the launcher readers keep running through the teardown,
                # and until the launchers' last word is heard: they record how and when each
                # ended.
                await self._teardown()
                if not any(s.launcher_alive() for s in self.sites):
                    await self.book.hear_out(self._heard)
                tg.cancel_scope.cancel()
        except Exception as e:  # a bug of ours must still end the group cleanly
            log.exception("%s %s: supervisor error", self.kind, self.id)
            self._decide("failed", f"elastic_nb supervisor error: {type(e).__name__}: {e}")
            self.report.event("internal_error", error=repr(e))
        finally:
            with anyio.CancelScope(shield=True):
                self._decide(*summary.STOPS["shutdown"])
                if any(s.running() for s in self.sites):
                    await self._teardown()
                self._close()
                await self._finish()

    # ---- its sites ----------------------------------------------------------------------------

    async def start_sites(
        self, sites: list[Site], plan: protocol.launcher.LaunchRound | None
    ) -> None:
        """A launcher at each site (all at once), and a reader of what each says."""
        self.sites = sites
        self._heard = anyio.Event()
        self._unheard = len(sites)
        env = self._launch_env()

        async def start(site: Site) -> None:
            warm = await site.start(Work(self.id, self.spec, env, plan))
            self.report.event("launcher", node=site.label, pid=site.launcher_pid, warm=warm)
            if warm:
                self._on_ready()
            self.task_group.start_soon(self._read_launcher, site)

        async with anyio.create_task_group() as tg:
            for site in sites:
                tg.start_soon(start, site)

    async def stop_sites(self, ended: bool) -> list[Survivor]:
        """SIGTERM, grace, SIGKILL to every process of the group at every site of the round (at
        once), then each site closed (`ended`: the group's end); what survived."""
        survivors: list[Survivor] = []

        async def stop(site: Site) -> None:
            # A site with no live rank has nothing to let finish: its launcher may wait where a
            # SIGTERM cannot reach Python (torch's exit barrier, in a store's wait), and waits
            # out the whole grace there.
            live = any(
                x.died_at is None and self.book.site(x) is site for x in self.book.of(self.attempt)
            )
            grace = self.spec.stop_grace if live or not self.multi_node else IDLE_STOP_GRACE_S
            survivors.extend(
                await site.stop(grace, lambda sig, stray: self._stopping(site, sig, stray))
            )

        async with anyio.create_task_group() as tg:
            for site in self.sites:
                tg.start_soon(stop, site)
        if not ended:
            for site in self.sites:
                site.close(ended=False)
            self.sites = []
        return survivors

    def _stopping(self, site: Site, sig: str, stray: list[int]) -> None:
        """The teardown sent `sig` at `site`: a rank not yet seen gone may die of our SIGKILL."""
        self.report.event("teardown", node=site.label, signal=sig, stray=stray)
        if sig.startswith("SIGKILL"):
            for r in self.book.of(self.attempt):
                r.killed = r.killed or (r.died_at is None and self.book.site(r) is site)

    # ---- the decision core's events and actions ------------------------------------------------

    def hear(self, event: decider.AnyEvent) -> None:
        """An event for the decision core, and what it decides carried out."""
        self.act(self.core.handle(event))

    def act(self, actions: list[decider.AnyAction]) -> None:
        for action in actions:
            _ACTIONS[type(action)](self, action)

    def _agent_failed(self, site: Site, error: str, at: float) -> None:
        """torch's agent at `site` raised at `at` (our clock): the ranks it ends from then on
        did not fail, it did."""
        label = self.placement.node_label(site)
        why = f"torchelastic's agent failed{f' on {label}' if label else ''}: {error}"
        self.hear(decider.AgentFailed(time.time(), self.placement.round_of(site), why, at))

    def _decide(self, outcome: str, reason: str) -> None:
        """The group's outcome from outside its ranks, first come first served."""
        self.hear(decider.Ended(time.time(), outcome, reason))

    def _decided_as(self, action: decider.Decide) -> None:
        self.report.event("decided", outcome=action.outcome, reason=action.reason)
        self._on_decided(action.outcome)
        self._decided.set()

    def _show_action(self, action: decider.Show) -> None:
        chip = self.book.chip(action.r, self.teardown_at)
        if action.ended is not None:
            chip["state"], chip["label"] = "stopped", action.ended
        self.report.chip(action.r.rank, chip)

    def _oom_alert(self, action: decider.OomAlert) -> None:
        title, text = diagnosis.oom_alert(action.r)
        self.report.alert("oom", "error", title, rank=action.r.rank, text=text)

    def _wait(self, action: decider.Wait) -> None:
        async def wait() -> None:
            await anyio.sleep(action.seconds)
            self.hear(decider.Waited(time.time(), action.attempt, action.what))

        self.task_group.start_soon(wait)

    def _restart(self, action: decider.Restart) -> None:
        self.report.set_state("restarting")
        self._on_restart(action)
        self.placement.restart(action)

    def _record(self, action: decider.Record) -> None:
        self.report.event(action.name, **action.fields)

    async def _read_launcher(self, site: Site) -> None:
        heard = _Heard(self, site)
        async for msg in site.messages():
            fields = {k: v for k, v in msg.items() if k != "kind"}
            if label := self.placement.node_label(site):
                fields["node"] = label
            self.report.event(f"launcher.{msg['kind']}", **fields)
            protocol.launcher.hear(msg, heard)
        if site in self.sites:
            self._unheard -= 1
            if self._unheard <= 0:
                self._heard.set()
        # The pipe's write end lives only in the launcher: EOF means it is exiting.
        await site.launcher_exited()
        await self.placement.launcher_ended(site, site.launcher_outcome(self.rd.launcher_log))

    def _on_start(self, site: Site, attempt: int, rank: int, pid: int) -> None:
        if attempt > self.attempt:
            self.memory.forget(self.attempt)
            self._new_attempt(attempt)
            self.placement.attempt_began(attempt)
        r = self.book.add(attempt, rank, pid, time.time(), site)
        self.placement.rank_started(site, r)
        self.hear(decider.RankStarted(time.time(), r))
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
        site = self.book.site(r)
        kills, base = site.oom_kills(), site.oom_base  # None: no OOM count where it ran
        r.oom_killed = kills is not None and base is not None and kills > base
        r.rss_peak = self.memory.rss_peak(r.attempt, r.rank)
        self.book.read_records(r)
        self.prompts.forget(r.attempt, r.rank)
        self._release(r)
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
            self._watch_process_group()
            now = time.monotonic()
            asks = self.prompts.ready(self.book.of(self.attempt), self.tailer, now)
            if now >= next_flush or asks:
                await self._flush()  # what the ranks printed first, then their prompts
                next_flush = time.monotonic() + FLUSH_S
            await self._show_asks(asks)
            if self.prompts.paused:
                self.silence.activity(now)  # a rank at a prompt is not a hang
            await anyio.sleep(POLL_S)

    def places(self, places: dict[int, str]) -> dict[int, str]:
        """The chips' words of where each rank is (Evidence.places), a rank in no collective
        with how long it has been silent: 'silent 9 s · line 13'."""
        out = dict(places)
        for rank, place in places.items():
            silent = self.tailer.silent_for(self.attempt, rank)
            if silent is not None and not place.startswith(("waiting in", "raised in", "finished")):
                out[rank] = f"silent {silent:.0f} s · {place}"
        return out

    def _watch_process_group(self, last: bool = False) -> None:
        """Once a rank of the attempt has made a process group (rank/bootstrap.py leaves a
        record), its followers say what a stuck collective will do. `last`: the look at the
        end, whenever the one before it was (a job of a second made one after it)."""
        now = time.monotonic()
        if self.process_group_made == self.attempt or (now < self._process_group_look and not last):
            return
        self._process_group_look = now + PROCESS_GROUP_LOOK_S
        attempt = self.attempt
        if any(self.rd.process_group(attempt, r.rank).exists() for r in self.book.of(attempt)):
            self.process_group_made = attempt
            for report in self._followers():
                report.process_group_made()

    def poll_checkpoints(self) -> None:
        """What the cells' checkpoints did since the last poll, said (checkpoint_news)."""
        checkpoint_news.tell(
            self.checkpoints.poll(), self.report, self._followers(), self.last_failure
        )

    def checkpoint_info(self) -> dict[str, Any] | None:
        """The latest saved checkpoint, with its words (%elastic session, the summary)."""
        return checkpoint_news.latest_checkpoint(self.checkpoints)

    async def _sample_memory(self) -> None:
        """Each live rank's memory once a second, to the dashboard (batched into the next
        update) and against its limits. Read by the site, at no cost to the ranks; a rank's
        CUDA allocator is asked only where its machine has GPUs."""
        while True:
            attempt = self.attempt
            ranks = [r for r in self.book.of(attempt) if r.died_at is None and r.pid is not None]
            for site in {id(self.book.site(r)): self.book.site(r) for r in ranks}.values():
                here = [r for r in ranks if self.book.site(r) is site]
                samples, limit = await read_memory(site, attempt, here)
                for sample in samples:
                    self.memory.add(sample)
                    for report in self._followers():
                        report.memory(sample)
                for rank, title in self.memory.alerts(attempt, limit):
                    self.alert("memory", "warning", title, rank=rank)
            await anyio.sleep(SAMPLE_S)

    async def _teardown(self) -> None:
        """Leave nothing behind: what the kind does first (`_before_teardown`), then SIGTERM,
        grace, SIGKILL to every process of the group at its sites, and what survived said."""
        assert self.core.outcome is not None
        await self._before_teardown(self.core.outcome[0])
        if any(s.running() for s in self.sites):
            self.hear(decider.TeardownBegan(time.time()))
        survivors = await self.stop_sites(ended=True)
        if survivors:  # no process of a group may outlive it unsaid
            self.report.event("teardown_failed", pids=[s["pid"] for s in survivors])
            self.report.alert(**summary.unkillable(survivors))

    async def _finish(self) -> None:
        assert self.core.outcome is not None
        outcome, reason = self.core.outcome
        self._watch_process_group(last=True)
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
        for site in self.sites:
            site.close()
        self.placement.close()
        self.tailer.close()
        self.report.close()
        await self.report.end(self.summary)

    def _plain_summary(self, outcome: str, reason: str) -> protocol.records.Summary:
        """A summary without a verdict (a session's; a job's whose analysis broke)."""
        ended = time.time()
        return protocol.records.summary(
            self.id,
            outcome,
            reason,
            world_size=self.world_size,
            attempt=self.attempt,
            restarts=self.restarts,
            max_restarts=self.spec.max_restarts,
            started=self.created,
            ended=ended,
            wall_s=ended - self.created,
            run_dir=str(self.rd),
            lines=self.tailer.lines_total(),
        )

    # ---- hooks whose plain version is the group's own (group_hooks.GroupHooks: the others) ----

    def _followers(self) -> list[Reporter]:
        """Who is sent the ranks' news (memory samples, checkpoints)."""
        return [self.report]

    async def _flush(self) -> None:
        await self.report.flush(self.attempt, self.tailer)


class _Heard(protocol.launcher.Listener):
    """What a group does with each kind of its launchers' news, `site`'s."""

    def __init__(self, group: RankGroup, site: Site) -> None:
        self.g, self.site = group, site

    def ready(self, msg: protocol.launcher.Ready) -> None:
        self.g._on_ready()

    def rendezvous(self, msg: protocol.launcher.Rendezvous) -> None:
        self.g.placement.rendezvous(msg["attempt"], msg["seconds"])

    def started(self, msg: protocol.launcher.Start) -> None:
        self.g._on_start(self.site, msg["attempt"], msg["rank"], msg["pid"])

    def agent_failed(self, msg: protocol.launcher.AgentFailed) -> None:
        self.g._agent_failed(self.site, msg["error"], msg["t"] + self.site.clock_offset)

    def exited(self, msg: protocol.launcher.Exit) -> None:
        # Its watcher, waiting for it (RankBook.wait_exit), judges the rank.
        self.g.book.report_exit(msg["attempt"], msg["rank"], msg["code"])

    def exits(self, msg: protocol.launcher.Exits) -> None:
        codes = {int(r): c for r, c in msg["codes"].items() if c is not None}
        for r in self.g.book.record_exits(msg["attempt"], codes):
            self.g._rank_ended(r)  # its exit was unknown when it was seen gone


# What carries out each action of the decision core (Diagnose: the kind's own, `_diagnose`; a
# cell's: the session's, `_cell_act`).
_ACTIONS: dict[type[decider.AnyAction], Any] = {
    decider.Decide: RankGroup._decided_as,
    decider.Show: RankGroup._show_action,
    decider.OomAlert: RankGroup._oom_alert,
    decider.Diagnose: lambda g, action: g._diagnose(action.what, action.r),
    decider.Wait: RankGroup._wait,
    decider.Restart: RankGroup._restart,
    decider.Record: RankGroup._record,
    **{kind: lambda g, action: g._cell_act(action) for kind in cell_rules.ACTIONS},
}
