"""A session's state, and the moves between states that its life allows (`session.Session`
makes every move in one place, `_move`, through `move`, which asserts it is one of these).

    STARTING ──> REPLAYING ──> READY <──> RUNNING
       │           ^   v         │           │
       └─────> RESTARTING <──────┴───────────┘
    (and RESTARTING again: the next attempt went too before all its ranks were up)
    each of those ──> ENDING ──> ENDED

A cell waits for READY, the replay for REPLAYING; a cell whose failure brought a restart ends once
a later attempt is in READY or RUNNING (REPLAYED: the journal's state is back on its ranks).
"""

from __future__ import annotations

import enum

__all__ = ["LIVE", "MOVES", "REPLAYED", "State", "move"]


class State(enum.Enum):
    """Its value is the word the kernel and ``%elastic session`` show (but ENDED's: `Session.state`
    shows the outcome, which says more)."""

    STARTING = "starting"  # the first attempt's ranks start and connect
    REPLAYING = "replaying"  # every rank of the attempt is up; the journal runs again (replay.py)
    READY = "ready"  # the ranks wait for a cell
    RUNNING = "running"  # they run one
    # A rank of the attempt died (or a new round of nodes ended it): torchelastic starts the next
    # attempt's ranks, which connect.
    RESTARTING = "restarting"
    ENDING = "ending"  # the outcome is decided: the teardown, then the summary
    ENDED = "ended"  # the summary is out


MOVES: dict[State, frozenset[State]] = {
    State.STARTING: frozenset({State.REPLAYING, State.RESTARTING, State.ENDING}),
    State.REPLAYING: frozenset({State.READY, State.RESTARTING, State.ENDING}),
    State.READY: frozenset({State.RUNNING, State.RESTARTING, State.ENDING}),
    State.RUNNING: frozenset({State.READY, State.RESTARTING, State.ENDING}),
    State.RESTARTING: frozenset({State.REPLAYING, State.RESTARTING, State.ENDING}),
    State.ENDING: frozenset({State.ENDED}),
    State.ENDED: frozenset(),
}
LIVE = frozenset(s for s in State if State.ENDING in MOVES[s])  # its outcome not decided yet
REPLAYED = frozenset({State.READY, State.RUNNING})  # the attempt's ranks hold the cells' state


def move(now: State, to: State, who: str) -> State:
    """`to`, if the table allows the move from `now` (a move it does not is a bug of ours)."""
    assert to in MOVES[now], f"{who}: {now.name} -> {to.name}"
    return to
