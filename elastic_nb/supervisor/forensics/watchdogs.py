"""The watchdogs' judgements, as functions of what the supervisor observed: the zombie watchdog
(is torchelastic's agent stuck?) and --hang-after (has every rank been silent too long?).

torchelastic's agent is stuck when it leaves a dead rank unreaped (spawned ranks are its
children), when it does not return after every rank finished and exited (forked ranks are
reaped by their fork server, so torch's Event.set() deadlock leaves no zombie), or when its
monitor loop stops ticking while ranks still run the cell. The job acts on the reason.

Silence is no new line and no start or exit from any rank while they run the cell. A rank still
starting its interpreter is busy, not silent (and has no stack to show yet); ranks that all
finished the cell are the agent's to reap (the zombie watchdog's business).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from elastic_nb import protocol
from elastic_nb.common.rank_state import RankState
from elastic_nb.common.spec import JobSpec

__all__ = [
    "Silence",
    "TorchAgent",
    "TorchAgentStuck",
    "agent_stuck",
    "stuck_agent",
    "zombie_bound",
    "zombie_title",
]


@dataclass(frozen=True)
class TorchAgent:
    """torchelastic's agent (the launcher process) as its site sees it now."""

    pid: int
    state: tuple[str, str] | None  # its process state (letter, words); None once it is gone
    last_tick: float | None  # its monitor loop, last heard (monotonic clock)
    # What its site's news may lag by, on top of the bound: another machine's agent is heard
    # through its join agent's beats, and each of its monitor passes reads the rendezvous
    # store through the channel.
    slack: float = 0.0


def zombie_bound(monitor_interval: float) -> float:
    """How long a dead rank may stay unreaped, or the agent's loop silent, before the watchdog
    calls the agent stuck: a few monitor passes and one tick period past 1 s."""
    return 1.0 + 3 * monitor_interval + protocol.launcher.TICK_EVERY_S


def stuck_agent(
    ranks: Iterable[RankState],
    current: list[RankState],
    nproc: int,
    now: float,
    bound: float,
    teardown_at: float | None,
    last_tick: float | None,
    ticking: bool,
    launcher_stopped: bool,
    unreaped: Callable[[RankState], bool],
    exit_barrier: bool = False,
) -> tuple[str, RankState | None] | None:
    """Why the agent is stuck, and the rank left a zombie if that is why; None if it is not.
    Intervals are on the monotonic clock (`now`, `RankState.gone_at`, `last_tick`): a step of
    the wall clock must never make a healthy agent look stuck.

    `ranks`: every rank of every attempt; `current`: the running attempt's; `ticking`: the job
    runs undecided, so the monitor loop should tick; `unreaped(r)`: the rank is a zombie."""
    for r in ranks:
        if r.gone_at is None or now - r.gone_at < bound or r.pid is None:
            continue
        if teardown_at is not None and r.died_at is not None and r.died_at >= teardown_at:
            continue  # dying because we stop the job: the agent is busy with that
        if unreaped(r):
            return f"rank {r.rank} died {now - r.gone_at:.1f} s ago and is still unreaped", r
    # Across machines a node whose ranks all finished waits in torch's exit barrier for the
    # others (agent/server/api.py, _exit_barrier): not returning is right there.
    if not exit_barrier and len(current) == nproc and all(r.done and r.gone_at for r in current):
        gone = now - max(r.gone_at or now for r in current)
        if gone > bound:
            return (
                f"every rank finished the cell and exited {gone:.1f} s ago; it has not returned",
                None,
            )
    if ticking and last_tick:
        # Once every rank has finished the cell the agent legitimately sits in join() while
        # they exit (no ticks then); a loop silent while ranks still run is stuck.
        busy = any(r.done is None for r in current)
        if now - last_tick > bound and (busy or launcher_stopped):
            return f"its monitor loop has not run for {now - last_tick:.1f} s", None
    return None


def zombie_title(
    why: str, launcher_pid: int, state: tuple[str, str] | None, finished: list[int]
) -> str:
    title = f"torchelastic's agent is stuck (zombie): {why}"
    if state is not None:
        title += f"; the launcher (pid {launcher_pid}) is {state[1]}"
    if finished:
        title += f"; rank{'s' if len(finished) > 1 else ''} "
        title += ", ".join(map(str, finished)) + " had finished the cell"
    return title + "; stopping it"


@dataclass(frozen=True)
class TorchAgentStuck:
    """What the zombie watchdog found, and how the job ends because of it."""

    title: str  # the alert's
    zombie: RankState | None  # the rank it left unreaped, if that is why
    outcome: str  # succeeded when every rank had finished the cell before the agent stuck
    reason: str


def agent_stuck(
    ranks: Iterable[RankState],
    current: list[RankState],
    spec: JobSpec,
    agent: TorchAgent,
    teardown_at: float | None,
    ticking: bool,
    unreaped: Callable[[RankState], bool],
    exit_barrier: bool = False,
) -> TorchAgentStuck | None:
    """`stuck_agent` on what the site shows now (the agent's state, zombies), worded;
    `exit_barrier`: the agent waits for other nodes' agents once its ranks have finished."""
    nproc = spec.nproc
    stuck = stuck_agent(
        ranks,
        current,
        nproc,
        time.monotonic(),
        zombie_bound(spec.monitor_interval) + agent.slack,
        teardown_at,
        agent.last_tick,
        ticking=ticking,
        launcher_stopped=agent.state is not None and agent.state[0] in "Tt",
        unreaped=unreaped,
        exit_barrier=exit_barrier,
    )
    if stuck is None:
        return None
    why, zombie = stuck
    finished = [r.rank for r in current if r.done is not None]
    title = zombie_title(why, agent.pid, agent.state, finished)
    if len(finished) == nproc:
        return TorchAgentStuck(
            title, zombie, "succeeded", "every rank finished the cell; the agent then got stuck"
        )
    return TorchAgentStuck(title, zombie, "failed", f"torchelastic's agent got stuck: {why}")


@dataclass
class Silence:
    """--hang-after: how long every rank has said nothing, one alert per silence."""

    last_activity: float  # output, a start or an exit, by any rank (monotonic clock)
    lines_seen: int = 0
    reported: bool = False

    def activity(self, now: float) -> None:
        self.last_activity = now

    def due(self, now: float, lines: int, in_the_cell: bool, hang_after: float | None) -> bool:
        """Observe the line count; True once, when the silence has lasted `hang_after`."""
        if lines != self.lines_seen or not in_the_cell:
            self.lines_seen, self.last_activity, self.reported = lines, now, False
        if hang_after is None or self.reported or now - self.last_activity < hang_after:
            return False
        self.reported = True  # once per silence; output re-arms it
        return True
