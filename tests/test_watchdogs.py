"""The zombie watchdog's judgement on hand-made observations (the real deadlocks are in
test_forensics.py)."""

from __future__ import annotations

import time

import pytest

from elastic_nb import protocol
from elastic_nb.common.rank_state import RankState
from elastic_nb.kernel.flags import job_spec
from elastic_nb.supervisor.forensics.watchdogs import (
    TorchAgent,
    agent_stuck,
    stuck_agent,
    zombie_bound,
)

pytestmark = pytest.mark.unit

BOUND = 1.5


def judge(ranks: list[RankState], now: float = 10.0, **kw: object) -> object:
    args = dict(
        nproc=len(ranks),
        now=now,
        bound=BOUND,
        teardown_at=None,
        last_tick=now,
        ticking=True,
        launcher_stopped=False,
        unreaped=lambda r: True,
    )
    args.update(kw)
    return stuck_agent(ranks, ranks, **args)  # type: ignore[arg-type]


def test_a_rank_dead_and_unreaped_past_the_bound() -> None:
    dead = RankState(0, 1, pid=11, died_at=8.0, gone_at=8.0, exit_code=-6)
    why, zombie = judge([RankState(0, 0, pid=10), dead])  # type: ignore[misc]
    assert why == "rank 1 died 2.0 s ago and is still unreaped" and zombie is dead
    assert judge([RankState(0, 0, pid=10), dead], unreaped=lambda r: False) is None
    assert judge([RankState(0, 0, pid=10), dead], now=9.0) is None  # within the bound
    assert judge([RankState(0, 0, pid=10), dead], teardown_at=7.0) is None  # we stopped it


def test_every_rank_done_and_gone_but_no_return() -> None:
    done = [RankState(0, r, pid=r, done={"time": 1}, died_at=7.0, gone_at=7.0) for r in (0, 1)]
    why, zombie = judge(done, unreaped=lambda r: False)  # type: ignore[misc]
    assert why.startswith("every rank finished the cell and exited 3.0 s ago") and zombie is None


def test_a_silent_monitor_loop_while_ranks_run() -> None:
    running = [RankState(0, r, pid=r) for r in (0, 1)]
    why, _ = judge(running, last_tick=8.0)  # type: ignore[misc]
    assert why == "its monitor loop has not run for 2.0 s"
    assert judge(running, last_tick=8.0, ticking=False) is None  # decided, or not running
    finished = [RankState(0, r, pid=r, done={"time": 1}) for r in (0, 1)]
    assert judge(finished, last_tick=8.0) is None  # the agent waits in join(): no ticks then
    assert judge(finished, last_tick=8.0, launcher_stopped=True) is not None  # SIGSTOPped


def test_a_step_of_the_wall_clock_is_not_a_stuck_agent() -> None:
    # The wall clock jumped an hour between the rank's death and now (NTP, a suspended VM):
    # intervals are taken on the monotonic clock, where 0.2 s passed.
    dead = RankState(0, 1, pid=11, died_at=8.0 - 3600, gone_at=9.8, exit_code=1)
    assert judge([RankState(0, 0, pid=10), dead]) is None
    done = [RankState(0, r, pid=r, done={"time": 1}, died_at=-3600.0, gone_at=9.9) for r in (0, 1)]
    assert judge(done, unreaped=lambda r: False) is None


def test_another_machines_agent_is_given_the_channels_lag() -> None:
    """A remote launcher's monitor loop is heard through its join agent's beats: its news may
    lag by as long as the channel takes to call the machine lost, and no longer."""
    ranks = [RankState(0, 0, pid=10)]
    spec = job_spec({"nproc": 1}, cwd="/tmp", sys_path=[])
    bound = zombie_bound(spec.monitor_interval)
    now = time.monotonic()

    def stuck(silent_s: float, slack: float) -> bool:
        agent = TorchAgent(10, ("S", "sleeping"), now - silent_s, slack=slack)
        return (
            agent_stuck(ranks, ranks, spec, agent, None, ticking=True, unreaped=lambda r: False)
            is not None
        )

    assert stuck(bound + 0.3, 0.0)  # on this machine: stuck
    assert not stuck(
        bound + 0.3, protocol.agents.LOST_AFTER_S
    )  # on another: it may be the way here
    assert stuck(bound + protocol.agents.LOST_AFTER_S + 0.3, protocol.agents.LOST_AFTER_S)
