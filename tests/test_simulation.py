"""The decision core under a deterministic simulation (tests/simulation.py): thousands of seeded
worlds, each an ordering of events the real one allows, the invariants checked after every step.
A failing seed prints its story and replays exactly. Each past race of this logic, its fix
reverted, is found again."""

from __future__ import annotations

import itertools
import signal
from collections.abc import Iterator
from typing import Any

import pytest

from elastic_nb.common.rank_state import RankState
from elastic_nb.supervisor.forensics import verdict
from elastic_nb.supervisor.forensics.verdict import Verdict
from elastic_nb.supervisor.runs import decider
from elastic_nb.supervisor.runs.cell_rules import CellRules
from elastic_nb.supervisor.runs.decider import Decider, RoundEnded, Show
from tests.cell_simulation import FATES, CellSim
from tests.simulation import Sim

pytestmark = pytest.mark.unit

SEEDS = 4000  # about 5 s here


def broken_seeds(seeds: range) -> Iterator[tuple[int, str, list[str]]]:
    for seed in seeds:
        story, broken = Sim(seed).run()
        if broken is not None:
            yield seed, broken, story


def first_broken(seeds: range = range(SEEDS)) -> tuple[int, str, list[str]] | None:
    return next(broken_seeds(seeds), None)


def test_thousands_of_orderings_keep_every_invariant() -> None:
    found = first_broken()
    if found is not None:
        seed, broken, story = found
        pytest.fail(f"seed {seed}: {broken}\n" + "\n".join(story), pytrace=False)


def test_a_seed_replays_exactly() -> None:
    for seed in (0, 1, 2, 77, 1234):
        assert Sim(seed).run() == Sim(seed).run()


def test_the_worlds_cover_every_story_on_both_placements() -> None:
    """The seeds' worlds are not all alike: every story plays on one machine and in rounds
    (a lost machine only in rounds), and restarts happen."""
    seen: set[tuple[bool, str]] = set()
    restarts = 0
    for seed in range(SEEDS // 4):
        sim = Sim(seed)
        sim.run()
        seen |= {(sim.rounds, t.story) for t in sim.truths.values()}
        restarts += sim.core.restarts
    stories = {story for _, story in seen}
    assert stories == {
        "succeeds",
        "raises",
        "oom",
        "exit0",
        "own_kill",
        "hang",
        "agent",
        "lost",
        "stop",
        "outside",
    }
    assert {(True, s) for s in stories} | {(False, s) for s in stories - {"lost"}} == seen
    assert restarts > 100


# ---- the past races, each fix reverted ----------------------------------------------------


def _own_end_but(kind: str) -> Any:
    """RankState._own_end as if one of its two cases (`kind`, "kill" or "exit0") were not."""
    own_end = RankState._own_end

    def without(self: RankState, teardown_at: float) -> bool:
        if self.exit_code == (-signal.SIGKILL if kind == "kill" else 0):
            return False
        return own_end(self, teardown_at)

    return without


def test_an_end_of_its_own_seen_after_a_peers_error_began_the_teardown_is_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """3762b5f: a rank that SIGKILLed itself, seen gone after a peer's error began the
    teardown, was called stopped and the peer blamed. (The simulation found the same of an
    exit(0) before the cell's end, seed 12, fixed with it; since a peer's error on one machine
    waits for the death it reports, no ordering it makes reaches that case.)"""
    monkeypatch.setattr(RankState, "_own_end", _own_end_but("kill"))
    found = first_broken()
    assert found is not None and "the verdict names rank" in found[1], found
    assert "story 'own_kill'" in "\n".join(found[2]), found[1]


def test_a_peer_error_on_one_machine_pinned_on_the_peer_is_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found this stop (a review of the job's decision tests): on one machine a peer's error
    read before the death it reports failed the attempt as the peer's at once, and the job's
    reason named the peer where its verdict named the rank that went. Now it waits for that
    death to be seen (decider.PEER_GONE_WAIT_S at most)."""
    monkeypatch.setattr(Decider, "_await_gone", lambda self, t, r: self._fail_attempt(t, r, "peer"))
    found = first_broken()
    assert found is not None and "peer error" in found[1], found


def test_torch_agents_word_read_late_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """a8c945e: the ranks torch's failed agent SIGTERMed were blamed when its word came over a
    second late (the wait was 1 s; here, none at all)."""
    monkeypatch.setattr(decider, "AGENT_WORD_S", 0.0)
    found = first_broken()
    assert found is not None and "torch's agent failed in attempt" in found[1], found


def test_ranks_that_died_before_the_agents_word_are_found_stopped(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """c07bef5: once the agent's word ended the group, the ranks it had SIGTERMed before its
    word came were judged by the decision's time, not the agent's, and one was blamed."""
    monkeypatch.setattr(Decider, "_stopped_since", lambda self, at: None)
    found = first_broken()
    assert found is not None and "no rank failed on its own" in found[1], found


def test_a_closed_rounds_late_news_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """a64e07a: a round's launcher exit, told after the next round had opened, failed the next
    round and spent a restart."""
    monkeypatch.setattr(Decider, "_of_now", lambda self, attempt: True)
    found = first_broken()
    assert found is not None, "not found"
    story = found[2]
    taken = [
        (line, then)
        for line, then in itertools.pairwise(story)
        if "-> RoundFailed" in line and "why=late" in line and "<- " in then
    ]
    assert taken, found[1]


def test_a_rank_whose_status_is_untold_at_its_rounds_end_is_found_running(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """55b27b2: a round's end showed each rank as the book had it, and a rank whose exit status
    was still on its way stayed "running" in an attempt that was over."""

    def as_the_book_had_it(self: Decider, e: RoundEnded) -> None:
        self.replaced.add(e.attempt)
        for r in self.of(e.attempt):
            ended = decider.STOPPED_FOR_ROUND if r.kind(e.t) == "terminated" else None
            self._out.append(Show(r, ended))

    monkeypatch.setattr(Decider, "_round_ended", as_the_book_had_it)
    found = first_broken()
    assert found is not None and "still shown running" in found[1], found


def test_a_peers_error_read_before_the_failure_it_reports_is_found_pinned_on_the_peer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found this stop (test_multinode, under load): across machines a survivor's peer error was
    read before its lost machine's loss, and the round's "why" named the survivor. Without the
    verdict's look at what the ranks show once the evidence is in, the simulation finds it."""
    monkeypatch.setattr(decider, "analyze", lambda *args, **kwargs: Verdict(None, None, []))
    found = first_broken()
    assert found is not None and "peer error" in found[1], found


# ---- a session's cell ---------------------------------------------------------------------------


def first_broken_cell(seeds: range = range(SEEDS)) -> tuple[int, str, list[str]] | None:
    for seed in seeds:
        story, broken = CellSim(seed).run()
        if broken is not None:
            return seed, broken, story
    return None


def test_thousands_of_cell_orderings_keep_every_invariant() -> None:
    found = first_broken_cell()
    if found is not None:
        seed, broken, story = found
        pytest.fail(f"seed {seed}: {broken}\n" + "\n".join(story), pytrace=False)


def test_a_cell_seed_replays_exactly() -> None:
    for seed in (0, 3, 99, 2024):
        assert CellSim(seed).run() == CellSim(seed).run()


def test_the_cell_worlds_cover_every_fate_and_every_end() -> None:
    """Every fate plays, and the cells end in every way: succeeded, failed with the session
    kept, failed with a restart, stuck ranks killed, stopped, timed out (a prompt open)."""
    fates: set[str] = set()
    ends: set[str] = set()
    for seed in range(SEEDS // 4):
        sim = CellSim(seed)
        sim.run()
        fates |= set(sim.fates.values())
        (done,) = sim.done
        ends.add(done.outcome)
        if "could not be interrupted" in done.reason:
            ends.add("stuck")
        if done.restarts:
            ends.add("restarts")
        if done.outcome == "timeout" and "prompt" in sim.fates.values():
            ends.add("timeout at a prompt")
    assert fates == set(FATES)
    assert ends >= {
        "succeeded",
        "failed",
        "restarts",
        "stuck",
        "interrupted",
        "stopped",
        "timeout",
        "timeout at a prompt",
    }


def test_a_rank_the_cell_killed_blamed_for_its_death_is_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found this stop, reading the cell's rules: a rank killed because it did not come back
    from an interrupt was judged by the core, when its death came, as killed by SIGKILL on its
    own (the restart's alert named it). The core now ends the attempt as the cell's doing."""

    def as_before(self: Decider, e: Any) -> None:
        assert self.cell is not None
        self._out += self.cell.handle(e)

    monkeypatch.setattr(Decider, "_cell_decides", as_before)
    found = first_broken_cell()
    assert found is not None and "the cell killed were blamed" in found[1], found


def test_a_death_after_a_stop_ending_the_cell_as_failed_is_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found this stop by the simulation (seed 684, at once): the --timeout had passed and its
    interrupts were out when a rank died, and the cell said "failed" (the death's words), not
    "timeout". The first cause gives the outcome; the death is said after it."""

    def always_failed(self: CellRules, t: float, reason: str, restarts: bool) -> list[Any]:
        self._out = []
        if self.done is None:
            self._end("failed", reason, self.interrupted or t, restarts)
        return self._out

    monkeypatch.setattr(CellRules, "end", always_failed)
    found = first_broken_cell()
    assert found is not None and "the --timeout passed while the cell ran" in found[1], found


def test_a_machine_lost_mid_stop_blamed_is_found(monkeypatch: pytest.MonkeyPatch) -> None:
    """Found this stop, once the simulation lost machines while a round or the job stopped:
    a machine lost after the stop had begun (a user's stop, torch's agent's failure) was the
    verdict's root, "lost with its node", where nothing of its own had failed. Its loss is now
    judged by when it came, as a death is."""
    kind = RankState.kind

    def as_before(self: RankState, teardown_at: float | None) -> str:
        if self.lost is not None and self.failure is None and self.watchdog is None:
            return "lost"
        return kind(self, teardown_at)

    monkeypatch.setattr(RankState, "kind", as_before)
    found = first_broken()
    assert found is not None and "(node_lost)" in found[1], found
    assert "lost mid-stop" in "\n".join(found[2]), found[1]


def test_a_rank_torch_stopped_after_a_peer_outside_the_job_died_blamed_is_found(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Found this stop (test_promises, in a full run): a process outside the job died under
    rank 0, which raised a peer's error and exited; torch's agent then SIGTERMed rank 1, and
    the verdict named rank 1 "killed by SIGTERM" once the core waited for the death the peer's
    error reports. A SIGTERM seen after the peer's own exit is torch's stop."""
    monkeypatch.setattr(verdict, "stopped_after_a_peer_went", lambda r, peers: False)
    found = first_broken()
    assert found is not None and "a peer outside the job died under rank" in found[1], found
