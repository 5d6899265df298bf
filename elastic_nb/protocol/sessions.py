"""A session's channel: supervisor <-> the session's ranks, over a Unix socket per session in the
owner-only socket directory (never torch's TCPStore, which has no authentication). A rank says
hello once it waits for cells; the supervisor sends it cells to run (each with its own run
directory) and interrupts, the rank says when it ran one, and bye ends the loop.
`python -m elastic_nb.protocol` lists the messages.
"""

from __future__ import annotations

import typing
from typing import Final, Literal, TypedDict

from elastic_nb.protocol.wire import Frame, check

__all__ = [
    "BYE",
    "INTERRUPT",
    "RAN",
    "RANK_HELLO",
    "RUN",
    "SESSION_SOCKET_ENV",
    "Bye",
    "Interrupt",
    "Ran",
    "RankHello",
    "RankNews",
    "Run",
    "SessionOrder",
    "rank_news",
    "session_order",
]

# supervisor <-> a session's ranks
RANK_HELLO: Final = "rank_hello"
RUN: Final = "run"
RAN: Final = "ran"
INTERRUPT: Final = "interrupt"
BYE: Final = "bye"
# Where a session's ranks find its socket (set in their environment by the supervisor).
SESSION_SOCKET_ENV = "ELASTIC_NB_SESSION_SOCKET"


class RankHello(TypedDict):
    kind: Literal["rank_hello"]
    rank: int
    attempt: int
    pid: int


class Run(TypedDict):
    kind: Literal["run"]
    cell: str
    run_dir: str


class Ran(TypedDict):
    kind: Literal["ran"]
    cell: str
    ok: bool
    # Bytes the rank had written to its stdout and stderr by then (its log files'): what its
    # cell printed reaches the kernel before the cell's end, from any machine.
    out: int
    err: int


class Interrupt(TypedDict):
    kind: Literal["interrupt"]
    cell: str


class Bye(TypedDict):
    kind: Literal["bye"]


RankNews = RankHello | Ran
SessionOrder = Run | Interrupt | Bye


def rank_news(frame: Frame) -> RankNews:
    """A frame from a session's rank, checked."""
    return typing.cast(RankNews, check(frame, RankNews))


def session_order(frame: Frame) -> SessionOrder:
    """A frame from the supervisor, as a session's rank reads it, checked."""
    return typing.cast(SessionOrder, check(frame, SessionOrder))
