"""The ranks' asks for a line of input (a rank's input(): pdb's prompt, a cell's own input()):
seen in the run directory (rank-R.input.json), shown in the notebook once what the rank printed
before it has been sent, and answered back to the rank through its site (a probe). A rank that
waits for its answer is paused: the group's watch for silence (--hang-after) leaves it alone.

While a rank is paused, the others that wait for it in a collective are looked for each second
(their flight recorders: the collective in flight, when it began, its group's timeout): their
chips say whom they wait for and when the collective's timeout runs out, and so does the paused
rank's prompt. torch cannot extend a timeout for a collective already started.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import time
import typing
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import anyio
from anyio.abc import TaskGroup

from elastic_nb import protocol
from elastic_nb.common.rank_state import RankState
from elastic_nb.common.rundir import RunDir, read_json
from elastic_nb.common.spec import JobSpec
from elastic_nb.supervisor.forensics.collectives import base, history
from elastic_nb.supervisor.processes.site import Site
from elastic_nb.supervisor.ranks.log_tailer import LogTailer
from elastic_nb.supervisor.ranks.rank_book import RankBook
from elastic_nb.supervisor.runs.reporter import Reporter

__all__ = ["ANSWER_WAIT_S", "GroupPrompts", "Prompts"]

# After an answer to a rank's prompt, its next prompt is looked for this often, this long (pdb
# asks again after each command: its round trip is a person's wait).
PROMPT_POLL_S = 0.001
NEXT_PROMPT_S = 2.0
RESUMED_AFTER_S = 0.25  # no prompt this long after an answer: the rank runs again (its chip)
log = logging.getLogger(__name__)

ANSWER_WAIT_S = 10.0  # for the rank's probe thread to take an answer
MIRROR_WAIT_S = 2.0  # for what a rank printed before its prompt to reach the tailer
WAITS_LOOK_S = 1.0  # how often the ranks waiting for a paused one are looked for
WAITS_PROBE_S = 1.0  # for a rank's flight recorder (a full one: ~0.1 s)


@dataclass
class Prompts:
    rd: RunDir
    # The last ask of each rank taken (attempt, rank): each is shown once.
    taken: dict[tuple[int, int], int] = field(default_factory=dict)
    # Asks shown and not answered yet: those ranks are paused.
    paused: dict[tuple[int, int], protocol.rank_probes.InputAsked] = field(default_factory=dict)
    _seen: dict[tuple[int, int], tuple[int, float]] = field(default_factory=dict)
    # The version (mtime) of each rank's ask file already dealt with: not read again each poll.
    _read: dict[tuple[int, int], int] = field(default_factory=dict)
    # The ranks that wait in a collective for paused ones (rank -> the wait, the paused ranks
    # in its group), as last looked; and the attempts whose waits are being watched.
    waits: dict[int, tuple[protocol.records.Waiting, list[int]]] = field(default_factory=dict)
    watching: set[int] = field(default_factory=set)

    def lines(self, attempt: int) -> dict[int, int | None]:
        """The ranks of `attempt` at a prompt now, and the cell line each stopped at."""
        return {rank: asked["line"] for (a, rank), asked in self.paused.items() if a == attempt}

    def waits_for(self, rank: int) -> list[protocol.records.Waiting]:
        return [w for w, paused in self.waits.values() if rank in paused]

    def ready(
        self, ranks: list[RankState], tailer: LogTailer, now: float
    ) -> list[tuple[RankState, protocol.rank_probes.InputAsked]]:
        """The live ranks' new asks whose output before them the tailer has read (or whose
        output is late: a joined node's mirror), each once."""
        out = []
        for r in ranks:
            key = (r.attempt, r.rank)
            if r.died_at is not None or key in self.paused:
                continue
            path = self.rd.input_asked(r.attempt, r.rank)
            try:
                mtime = os.stat(path).st_mtime_ns
            except OSError:
                continue
            if self._read.get(key) == mtime:
                continue
            first_seen = self._seen.get(key)
            if first_seen is None or first_seen[0] != mtime:
                self._seen[key] = first_seen = (mtime, now)
            record = read_json(path)
            if not isinstance(record, dict) or record.get("ask", 0) <= self.taken.get(key, 0):
                self._read[key] = mtime
                continue
            try:
                protocol.wire.check_record(record, protocol.rank_probes.InputAsked, path.name)
            except protocol.wire.ProtocolError:
                self._read[key] = mtime
                continue
            asked = typing.cast(protocol.rank_probes.InputAsked, record)
            offsets = {"out": asked["out"], "err": asked["err"]}
            if (
                not tailer.read_to(r.attempt, r.rank, offsets)
                and now - first_seen[1] < MIRROR_WAIT_S
            ):
                continue
            self.taken[key], self._read[key] = asked["ask"], mtime
            self.paused[key] = asked
            out.append((r, asked))
        return out

    def check(self, r: RankState, ask: int) -> None:
        """KeyError unless `r` waits for the answer to `ask`."""
        waiting = self.paused.get((r.attempt, r.rank))
        if waiting is None or waiting["ask"] != ask:
            raise KeyError(f"rank {r.rank} does not wait for that answer")

    async def answer(
        self, site: Site, r: RankState, ask: int, text: str | None, why: str | None
    ) -> None:
        """The notebook's answer, to the rank that asks; RuntimeError if it did not take it."""
        self.check(r, ask)
        self.paused.pop((r.attempt, r.rank), None)  # its next ask may come before the ack
        answer = protocol.rank_probes.InputAnswer(ask=ask, text=text, why=why)
        what = f"{protocol.rank_probes.PROBE_ANSWER} {json.dumps(answer)}"
        record = await site.probe(r, what, ANSWER_WAIT_S)
        if record is None or not record.get("taken"):
            raise RuntimeError(f"rank {r.rank} did not take the answer (it is no longer waiting)")

    def forget(self, attempt: int, rank: int) -> None:
        """A rank ended: it waits for nothing."""
        self.paused.pop((attempt, rank), None)


class GroupPrompts:
    """A rank group's part (rank_group.RankGroup's base, as group_hooks.GroupHooks is): each
    rank's prompt shown to the kernel that follows the cell, its chip paused meanwhile, the
    answer brought back, the rank's next prompt looked for at once; with --pdb the other ranks
    held while one is in post-mortem. What it uses of the group is declared here."""

    id: str
    spec: JobSpec
    book: RankBook
    tailer: LogTailer
    report: Reporter
    prompts: Prompts
    process_group_made: int | None
    _held: dict[tuple[int, int], list[RankState]]  # --pdb: held ranks, by the rank debugged
    _collectives_warned: set[int]  # attempts told a paused rank's cost
    _asker: Callable[[], Reporter | None]  # group_hooks.GroupHooks's
    _flush: Callable[[], Awaitable[None]]
    signal: Callable[[list[RankState], int], None]

    # rank_group.RankGroup's: its decision core's, and its task group while it runs
    @property
    def attempt(self) -> int:
        raise NotImplementedError

    @property
    def teardown_at(self) -> float | None:
        raise NotImplementedError

    @property
    def task_group(self) -> TaskGroup:
        raise NotImplementedError

    async def _show_asks(
        self, asks: list[tuple[RankState, protocol.rank_probes.InputAsked]]
    ) -> None:
        for r, asked in asks:
            await self._ask(r, asked)

    async def _next_ask(self, r: RankState) -> None:
        """After an answer, the rank's next prompt (pdb's, after each command) is looked for
        every PROMPT_POLL_S for a while, not at the poll loop's pace: a command's round trip
        is that long, not a poll of the group."""
        start = time.monotonic()
        resumed = False  # its chip says it runs again (it asked nothing for a while)
        while r.died_at is None:
            await anyio.sleep(PROMPT_POLL_S)
            self.tailer.poll()
            asks = self.prompts.ready([r], self.tailer, time.monotonic())
            if asks:
                await self._flush()
                await self._show_asks(asks)
                return
            if (r.attempt, r.rank) in self.prompts.paused:
                return  # shown by the poll loop meanwhile
            waited = time.monotonic() - start
            if not resumed and (waited >= RESUMED_AFTER_S or waited >= NEXT_PROMPT_S):
                resumed = True
                if (report := self._asker()) is not None:
                    report.chip(r.rank, self.book.chip(r, self.teardown_at))
            if waited >= NEXT_PROMPT_S:
                return

    async def _ask(self, r: RankState, asked: protocol.rank_probes.InputAsked) -> None:
        """A rank's prompt, to the kernel that follows the cell; where none can answer, the
        rank's input() is told so at once (it fails the cell, naming the rank)."""
        held = self._hold_others(r) if asked["post_mortem"] else []
        report = self._asker()
        if report is not None:
            # Its chip first (the dashboard's, the text mode's line), then the prompt.
            where = f"line {asked['line']}" if asked["line"] else "input()"
            self._paused_chip(report, r, f"paused at {where}")
            for o in held:
                self._paused_chip(report, o, f"held: rank {r.rank} is at its post-mortem")
            self._warn_collectives(report, r, held)
            if not held and r.attempt not in self.prompts.watching:
                self.prompts.watching.add(r.attempt)
                self.task_group.start_soon(self._watch_waits, r.attempt)
            await report.flush(self.attempt, None)
            if await report.prompt(r.attempt, r.rank, asked, self.prompts.waits_for(r.rank)):
                return
        why = "no kernel follows this cell (a replayed cell, or a notebook that has gone)"
        with contextlib.suppress(KeyError, RuntimeError):
            await self.answer_input(r.attempt, r.rank, asked["ask"], None, why)

    def _warn_collectives(self, report: Reporter, r: RankState, held: list[RankState]) -> None:
        """Once an attempt, at the first prompt where ranks made a process group and are not
        held: those waiting for the paused rank in a collective still time out."""
        timeout = self.spec.collective_timeout
        if held or timeout is None or self.process_group_made != r.attempt:
            return
        if r.attempt in self._collectives_warned:
            return
        self._collectives_warned.add(r.attempt)
        report.alert(
            "paused",
            "info",
            f"rank {r.rank} waits at a prompt: a rank waiting for it in a collective fails once "
            f"its timeout runs out (--collective-timeout {timeout:g} s) unless the timeout was "
            f"extended: torch.distributed.breakpoint(rank={r.rank}) extends every process "
            "group's to an hour",
            rank=r.rank,
        )

    async def _watch_waits(self, attempt: int) -> None:
        """While a rank of `attempt` waits at a prompt, every WAITS_LOOK_S: which other live
        ranks wait for it in a collective; their chips say so (the dashboard counts down to the
        timeout), and the paused rank's next prompt too."""
        try:
            while self.attempt == attempt and self.teardown_at is None:
                paused = {rank for a, rank in self.prompts.paused if a == attempt}
                if not paused:
                    return
                held = {id(o) for ranks in self._held.values() for o in ranks}
                others = [
                    r
                    for r in self.book.of(attempt)
                    if r.died_at is None and r.rank not in paused and id(r) not in held
                ]
                self.show_waits(attempt, await waiting_for(others, paused, self.book.site))
                await anyio.sleep(WAITS_LOOK_S)
        finally:
            self.show_waits(attempt, {})
            self.prompts.watching.discard(attempt)

    def show_waits(
        self, attempt: int, found: dict[int, tuple[protocol.records.Waiting, list[int]]]
    ) -> None:
        """Chips for the ranks that wait now (a wait already shown keeps its first expiry: the
        same collective's), and back to the book's for those that no longer do."""
        report, shown = self._asker(), self.prompts.waits
        for rank in [rank for rank in shown if rank not in found]:
            del shown[rank]
            r = self.book.get(attempt, rank)
            if report is None or r is None or self.teardown_at is not None:
                continue
            if (attempt, rank) not in self.prompts.paused:  # (one at a prompt keeps its chip)
                report.chip(rank, self.book.chip(r, self.teardown_at))
        for rank, (wait, paused) in found.items():
            before = shown.get(rank)
            if before is not None and (before[0]["op"], before[1]) == (wait["op"], paused):
                continue
            shown[rank] = (wait, paused)
            r = self.book.get(attempt, rank)
            if report is None or r is None:
                continue
            whom = (
                f"rank {paused[0]}" if len(paused) == 1 else f"ranks {', '.join(map(str, paused))}"
            )
            chip = self.book.chip(r, self.teardown_at)
            chip["state"], chip["label"] = "waiting", f"waiting for {whom} (paused) in {wait['op']}"
            if wait["expires"] is not None:
                chip["expires"] = wait["expires"]
            report.chip(rank, chip)

    def _paused_chip(self, report: Reporter, r: RankState, words: str) -> None:
        chip = self.book.chip(r, self.teardown_at)
        chip["state"], chip["label"] = "paused", words
        report.chip(r.rank, chip)

    def _hold_others(self, r: RankState) -> list[RankState]:
        """--pdb: while `r` is in post-mortem the other live ranks are stopped, so that none
        times out waiting for it in a collective (nor runs on without it); they go on once `r`
        has left the debugger and failed."""
        key = (r.attempt, r.rank)
        if key in self._held:
            return self._held[key]
        others = [o for o in self.book.of(r.attempt) if o is not r and o.died_at is None]
        self._held[key] = others
        self.signal(others, signal.SIGSTOP)
        self.report.event("held", attempt=r.attempt, by=r.rank, ranks=[o.rank for o in others])
        return others

    def _release(self, r: RankState) -> None:
        held = self._held.pop((r.attempt, r.rank), None)
        if held:
            self.signal([o for o in held if o.died_at is None], signal.SIGCONT)

    async def answer_input(
        self, attempt: int, rank: int, ask: int, text: str | None, why: str | None
    ) -> None:
        """The notebook's answer to a rank's prompt, on its way to the rank when this returns
        (the kernel waits for the rank's next prompt, not for this); KeyError if that rank
        does not wait for it."""
        r = self.book.get(attempt, rank)
        if r is None:
            raise KeyError(f"no rank {rank} in attempt {attempt}")
        self.prompts.check(r, ask)
        self.report.event(
            "input.answered", attempt=attempt, rank=rank, ask=ask, given=text is not None
        )
        self.task_group.start_soon(self._deliver, r, ask, text, why)

    async def _deliver(self, r: RankState, ask: int, text: str | None, why: str | None) -> None:
        """The answer to the rank, and its next prompt looked for at once: pdb asks again
        before the rank's acknowledgement has been read."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._next_ask, r)
            try:
                await self.prompts.answer(self.book.site(r), r, ask, text, why)
            except (KeyError, RuntimeError) as e:  # it ended meanwhile: its end says the rest
                log.info("group %s: %s", self.id, e)
                tg.cancel_scope.cancel()


async def waiting_for(
    ranks: list[RankState], paused: set[int], site_of: Callable[[RankState], Site]
) -> dict[int, tuple[protocol.records.Waiting, list[int]]]:
    """Of `ranks`, those in a collective of a group that holds a paused rank: the wait (its
    timeout's end on our clock: what the rank's record said was left, from when it came) and
    the paused ranks of that group. A rank that does not answer in time is left out."""
    found: dict[int, tuple[protocol.records.Waiting, list[int]]] = {}

    async def look(r: RankState) -> None:
        record = await site_of(r).probe(r, protocol.rank_probes.PROBE_FULL, WAITS_PROBE_S)
        received = time.time()
        if record is None:
            return
        h = history(r.rank, record, cell="")  # the cell's lines are not asked for here
        op = h.waiting_in()
        if op is None:
            return
        members = h.members.get(base(op.group))
        waited = sorted(paused if members is None else paused & set(members))
        if waited:
            left = op.timeout_left
            expires = None if left is None else received + left
            wait = protocol.records.Waiting(rank=r.rank, op=f"{op.name} #{op.seq}", expires=expires)
            found[r.rank] = (wait, waited)

    async with anyio.create_task_group() as tg:
        for r in ranks:
            tg.start_soon(look, r)
    return found
