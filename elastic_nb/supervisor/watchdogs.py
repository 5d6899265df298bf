"""The zombie watchdog's judgement, as a pure function of what the supervisor observed.

torchelastic's agent is stuck when it leaves a dead rank unreaped (spawned ranks are its
children), when it does not return after every rank finished and exited (forked ranks are
reaped by their fork server, so torch's Event.set() deadlock leaves no zombie), or when its
monitor loop stops ticking while ranks still run the cell. The job acts on the reason.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from elastic_nb.supervisor.verdict import RankState

__all__ = ["stuck_agent"]


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
    unreaped: Callable[[int], bool],
) -> tuple[str, RankState | None] | None:
    """Why the agent is stuck, and the rank left a zombie if that is why; None if it is not.

    `ranks`: every rank of every attempt; `current`: the running attempt's; `ticking`: the job
    runs undecided, so the monitor loop should tick; `unreaped(pid)`: the pid is a zombie."""
    for r in ranks:
        if r.died_at is None or now - r.died_at < bound or r.pid is None:
            continue
        if teardown_at is not None and r.died_at >= teardown_at:
            continue  # dying because we stop the job: the agent is busy with that
        if unreaped(r.pid):
            return f"rank {r.rank} died {now - r.died_at:.1f} s ago and is still unreaped", r
    if len(current) == nproc and all(r.done and r.died_at for r in current):
        gone = now - max(r.died_at or now for r in current)
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
