"""The launcher's channel: its assignment, one JSON line on its stdin (which job, which round, the
rendezvous), then launcher -> supervisor over a pipe (the launcher's stdout, set aside before
torch loads): the launcher is up, each rendezvous, each rank started or ended, an attempt's exit
codes, the agent's monitor loop ticking (every TICK_EVERY_S), torch's agent failing (said before
it ends the ranks: they die of its SIGTERM next), elastic_launch's result, and a multi-node
group's rendezvous store serving on 127.0.0.1. `python -m elastic_nb.protocol` lists them.
"""

from __future__ import annotations

import typing
from typing import Any, Final, Literal, TypedDict

from elastic_nb.protocol.wire import Frame, check, check_record

__all__ = [
    "AGENT_FAILED",
    "EXIT",
    "EXITS",
    "READY",
    "RENDEZVOUS",
    "RESULT",
    "START",
    "STORE",
    "TICK",
    "TICK_EVERY_S",
    "AgentFailed",
    "Assignment",
    "Exit",
    "Exits",
    "LaunchRound",
    "LauncherNews",
    "Listener",
    "Ready",
    "Rendezvous",
    "Result",
    "Start",
    "StoreUp",
    "Tick",
    "assignment",
    "hear",
    "launcher_news",
]

# launcher -> supervisor
READY: Final = "ready"
RENDEZVOUS: Final = "rendezvous"
START: Final = "start"
EXIT: Final = "exit"
EXITS: Final = "exits"
TICK: Final = "tick"
AGENT_FAILED: Final = "agent_failed"
RESULT: Final = "result"
STORE: Final = "store"
# The launcher reports its agent's monitor loop at most this often; the zombie watchdog's bound
# is built on it.
TICK_EVERY_S = 0.25


class Ready(TypedDict):
    kind: Literal["ready"]
    pid: int


class Rendezvous(TypedDict):
    kind: Literal["rendezvous"]
    attempt: int
    seconds: float


class Start(TypedDict):
    kind: Literal["start"]
    attempt: int
    rank: int
    pid: int


class Exit(TypedDict):
    kind: Literal["exit"]
    attempt: int
    rank: int
    pid: int
    code: int | None


class Exits(TypedDict):
    kind: Literal["exits"]
    attempt: int
    codes: dict[str, int | None]  # rank (JSON keys are strings) -> exit code, -N = signal N


class Tick(TypedDict):
    kind: Literal["tick"]
    t: float


class AgentFailed(TypedDict):
    kind: Literal["agent_failed"]
    error: str  # "RendezvousStateError: ..."
    t: float  # when (the launcher's clock): the SIGTERMs the agent then sends its ranks are later


class _Result(TypedDict):
    kind: Literal["result"]
    ok: bool


class Result(_Result, total=False):
    error: str
    failures: dict[str, Any]


class StoreUp(TypedDict):
    kind: Literal["store"]
    port: int


class LaunchRound(TypedDict):
    """A multi-node job's round, as one node's launcher runs it: `nnodes` launchers (one a node)
    meet in torch's c10d rendezvous at `endpoint` (the group's store, reached on this machine's
    loopback), with no restarts of their own: the supervisor starts the next round."""

    attempt: int  # the round's attempt number (torch's restart count starts at 0 in each)
    nnodes: int
    run_id: str
    endpoint: str  # 127.0.0.1:PORT, on the launcher's machine
    addr: str  # this node's address: rank 0's process-group store and gloo listen there
    ifname: str  # the interface holding it (GLOO_SOCKET_IFNAME, NCCL_SOCKET_IFNAME)
    key: str  # the group's rendezvous key, hex: launcher/rendezvous.py signs the store's state


class Assignment(TypedDict):
    job: str
    run_dir: str
    env: dict[str, str]
    round: LaunchRound | None  # None: a single-node job (torch's own restarts)


LauncherNews = Ready | Rendezvous | Start | Exit | Exits | Tick | AgentFailed | Result | StoreUp


def launcher_news(frame: Frame) -> LauncherNews:
    """A frame on a launcher's pipe, checked."""
    return typing.cast(LauncherNews, check(frame, LauncherNews))


class Listener:
    """What a reader of a launcher's news does with each kind: the channel's one receiver
    (`hear`), so that no reader compares kinds. A reader overrides the kinds it takes; each
    other kind goes to `other`, which ignores it."""

    def ready(self, msg: Ready) -> None:
        self.other(msg)

    def rendezvous(self, msg: Rendezvous) -> None:
        self.other(msg)

    def started(self, msg: Start) -> None:
        self.other(msg)

    def exited(self, msg: Exit) -> None:
        self.other(msg)

    def exits(self, msg: Exits) -> None:
        self.other(msg)

    def tick(self, msg: Tick) -> None:
        self.other(msg)

    def agent_failed(self, msg: AgentFailed) -> None:
        self.other(msg)

    def result(self, msg: Result) -> None:
        self.other(msg)

    def store_up(self, msg: StoreUp) -> None:
        self.other(msg)

    def other(self, msg: LauncherNews) -> None:
        """A kind this reader does not take."""


# Each kind's method of a Listener, by name (a reader's override is the one called)
_HEARD = {
    READY: "ready",
    RENDEZVOUS: "rendezvous",
    START: "started",
    EXIT: "exited",
    EXITS: "exits",
    TICK: "tick",
    AGENT_FAILED: "agent_failed",
    RESULT: "result",
    STORE: "store_up",
}


def hear(msg: LauncherNews, listener: Listener) -> None:
    """`msg` (checked: launcher_news) to the `listener`'s method for its kind."""
    getattr(listener, _HEARD[msg["kind"]])(msg)


def assignment(frame: Frame) -> Assignment:
    """The launcher's assignment, checked (it has no kind: it is the line's one message)."""
    return typing.cast(Assignment, check_record(frame, Assignment, "the assignment"))
