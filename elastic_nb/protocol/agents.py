"""The join agents' channel: supervisor <-> a join agent (a node on another machine), one ZeroMQ
connection per agent, CURVE: mutually authenticated and encrypted (supervisor/nodes/channel.py).
A frame is the same header, and its blob travels as a second ZeroMQ frame.

The agent says hello with what its machine has, and is welcomed or refused; both sides beat every
BEAT_S (one silent for LOST_AFTER_S is gone). The supervisor opens a group's round there (its
files as a tar), sends a session's cells, signals, stacks and probe requests, asks for leftovers,
stops and closes; the agent relays its launcher's messages, its launcher's exit, ranks gone,
files its ranks leave (mirrored into the notebook's run directory, appended at `offset`, -1: the
whole file; only what a node may write, supervisor/nodes/files.py), memory, answers, and streams:
connections a process on the agent's machine opened to the agent's loopback listeners (a
launcher's to the rendezvous store, a session rank's to its session). Either side says bye.
`python -m elastic_nb.protocol` lists every message with its fields.
"""

from __future__ import annotations

import typing
from typing import Any, Final, Literal, TypedDict

from elastic_nb.protocol.records import GpuShare, Leftover, NodeInfo, Replied, Survivor
from elastic_nb.protocol.wire import Frame, check

__all__ = [
    "ANSWER",
    "ANSWERS",
    "BEAT",
    "BEAT_S",
    "CELL",
    "CLOSE",
    "FILE",
    "LAUNCHER",
    "LAUNCHER_EXIT",
    "LEFTOVERS",
    "LOST_AFTER_S",
    "MEMORY",
    "NODE_HELLO",
    "OPEN",
    "PROBE",
    "RANKS_UP",
    "RANK_GONE",
    "REFUSED",
    "SIGNAL",
    "STREAM_CLOSE",
    "STREAM_DATA",
    "STREAM_OPEN",
    "STREAM_SESSION",
    "STREAM_STORE",
    "WELCOME",
    "Answer",
    "Beat",
    "CellFiles",
    "CellUnpacked",
    "Close",
    "Dumps",
    "FileChunk",
    "GroupBeat",
    "JoinRefused",
    "LauncherExit",
    "LauncherSaid",
    "LeftoverList",
    "Leftovers",
    "MemoryRead",
    "NodeBye",
    "NodeHello",
    "NodeNews",
    "NodeOrder",
    "NodeStacks",
    "NodeStop",
    "Open",
    "Opened",
    "Probe",
    "ProbeAnswer",
    "RankDump",
    "RankGone",
    "RanksUp",
    "Request",
    "Signal",
    "SignalSent",
    "Stopped",
    "StreamClose",
    "StreamData",
    "StreamOpen",
    "Survivor",
    "Welcome",
    "node_news",
    "node_order",
]

# join agent -> supervisor
NODE_HELLO: Final = "node_hello"
BEAT: Final = "beat"
LAUNCHER: Final = "launcher"
LAUNCHER_EXIT: Final = "launcher_exit"
RANK_GONE: Final = "rank_gone"
FILE: Final = "file"
MEMORY: Final = "memory"
ANSWER: Final = "answer"
STREAM_OPEN: Final = "stream_open"
STREAM_DATA: Final = "stream_data"
STREAM_CLOSE: Final = "stream_close"
# supervisor -> join agent (and BEAT, STREAM_DATA, STREAM_CLOSE, BYE)
WELCOME: Final = "welcome"
REFUSED: Final = "refused"
OPEN: Final = "open"
CELL: Final = "cell"
SIGNAL: Final = "signal"
PROBE: Final = "probe"
RANKS_UP: Final = "ranks_up"
LEFTOVERS: Final = "leftovers"
CLOSE: Final = "close"
STOP: Final = "stop"
STACKS: Final = "stacks"
BYE: Final = "bye"
# What a stream connects to: a launcher's rendezvous store, or a session's rank to its session.
STREAM_STORE = "store"
STREAM_SESSION = "session"
# Both sides of a join agent's channel say they live this often; one silent for LOST_AFTER_S is
# gone (docs/howto/multinode.md promises a node that leaves is known within 2 s).
BEAT_S = 0.25
LOST_AFTER_S = 1.75

# A group's rounds on an agent's machine share its id, and a round's last news (its launcher's
# exit, after the mirror's sweep) can come after the supervisor has closed it and opened the
# next there: every piece of a group's news names its round (`round`: the round's attempt), and
# the supervisor takes only its open round's.


class GroupBeat(TypedDict):
    """A group's processes on an agent's machine, as its LocalSite sees them now."""

    round: int  # its round's attempt: the supervisor drops a closed round's news
    launcher: int | None
    launcher_alive: bool
    state: list[str] | None  # the launcher's process state (letter, words)
    tick_age: float | None  # seconds since its agent's monitor loop last ticked
    running: bool  # some process of the group lives there
    zombies: list[list[int]]  # [attempt, rank]: dead and unreaped
    oom_kills: int | None  # the OOM killer's kills where the ranks run, since the group began


class NodeHello(TypedDict):
    kind: Literal["node_hello"]
    version: int
    info: NodeInfo


class Welcome(TypedDict):
    kind: Literal["welcome"]
    version: int
    node: int  # its number in this supervisor's list (0 is the notebook's machine)
    info: NodeInfo  # the notebook's machine


class JoinRefused(TypedDict):
    kind: Literal["refused"]
    error: str


class Beat(TypedDict):
    kind: Literal["beat"]
    t: float  # the sender's wall clock
    groups: dict[str, GroupBeat]  # the agent's: each group it serves (the supervisor's: {})


class LauncherSaid(TypedDict):
    kind: Literal["launcher"]
    group: str
    round: int  # its round's attempt: the supervisor drops a closed round's news
    msg: dict[str, Any]  # a launcher message (launcher_news checks it)


class LauncherExit(TypedDict):
    kind: Literal["launcher_exit"]
    group: str
    round: int  # its round's attempt: the supervisor drops a closed round's news
    outcome: str
    reason: str


class RankGone(TypedDict):
    kind: Literal["rank_gone"]
    group: str
    round: int  # its round's attempt: the supervisor drops a closed round's news
    attempt: int
    rank: int
    t: float  # when the agent saw it go (its clock)
    code: int | None


class FileChunk(TypedDict):
    kind: Literal["file"]
    group: str
    root: str  # "": the group's run directory; else the session cell's (its id) it is in
    path: str  # relative to that run directory
    offset: int  # where the blob goes; -1: the blob starts the whole file anew


class MemoryRead(TypedDict):
    kind: Literal["memory"]
    group: str
    round: int  # its round's attempt: the supervisor drops a closed round's news
    rss: dict[str, int]
    gpu: dict[str, GpuShare]
    limit: dict[str, Any] | None  # host_memory.MemoryLimit's fields
    gpus: bool


class Answer(Replied):
    """To every order that carries a request number (records.Replied)."""

    kind: Literal["answer"]


class StreamOpen(TypedDict):
    kind: Literal["stream_open"]
    group: str
    stream: int
    to: str  # STREAM_STORE or STREAM_SESSION
    peer: int | None  # the connecting process's pid (SO_PEERCRED), as the agent saw it


class StreamData(TypedDict):
    kind: Literal["stream_data"]
    group: str
    stream: int


class StreamClose(TypedDict):
    kind: Literal["stream_close"]
    group: str
    stream: int


class NodeBye(TypedDict):
    kind: Literal["bye"]
    reason: str


class Open(TypedDict):
    kind: Literal["open"]
    req: int
    group: str
    spec: dict[str, Any]
    env: dict[str, str]  # --env: the agent's own environment is the ranks' base
    round: dict[str, Any]  # attempt, nnodes, run_id, key (the node fills in its endpoint, address)
    session: bool


class CellFiles(TypedDict):
    kind: Literal["cell"]
    req: int
    group: str
    cell: str


class Signal(TypedDict):
    kind: Literal["signal"]
    group: str
    attempt: int
    rank: int
    sig: int


class NodeStacks(TypedDict):
    kind: Literal["stacks"]
    req: int
    group: str
    ranks: list[list[int]]  # [attempt, rank]
    wait_s: float


class Probe(TypedDict):
    kind: Literal["probe"]
    req: int
    group: str
    attempt: int
    rank: int
    what: str
    wait_s: float


class RanksUp(TypedDict):
    kind: Literal["ranks_up"]
    group: str


class Leftovers(TypedDict):
    kind: Literal["leftovers"]
    req: int
    group: str
    grace: float
    stuck: bool


class NodeStop(TypedDict):
    kind: Literal["stop"]
    req: int
    group: str
    grace: float


class Close(TypedDict):
    kind: Literal["close"]
    group: str
    ended: bool  # the group has ended (else only its round here: another may follow)


# ---- answers: the data of each order's answer, of the type ANSWERS names for its kind ----


class Opened(TypedDict):
    warm: bool  # a warm launcher took the round
    launcher: int | None  # its pid


class CellUnpacked(TypedDict):
    run_dir: str  # the cell's run directory on the agent's machine


class RankDump(TypedDict):
    text: str  # faulthandler's dump, its last lines kept within the frame's share
    state: list[str] | None  # [letter, words] of the process when asked; None: gone
    asked: bool


class Dumps(TypedDict):
    dumps: dict[str, RankDump]  # by rank


class ProbeAnswer(TypedDict):
    record: dict[str, Any] | None  # what the rank's probe thread answered (rank/recorder.py)


class LeftoverList(TypedDict):
    leftovers: list[Leftover]


class SignalSent(TypedDict):
    sig: str  # its name, as the teardown says it
    pids: list[int]


class Stopped(TypedDict):
    survivors: list[Survivor]  # what a SIGKILL did not end
    signals: list[SignalSent]  # the teardown's signals, in order


ANSWERS: dict[str, type] = {
    OPEN: Opened,
    CELL: CellUnpacked,
    STACKS: Dumps,
    PROBE: ProbeAnswer,
    LEFTOVERS: LeftoverList,
    STOP: Stopped,
}


NodeNews = (
    NodeHello
    | Beat
    | LauncherSaid
    | LauncherExit
    | RankGone
    | FileChunk
    | MemoryRead
    | Answer
    | StreamOpen
    | StreamData
    | StreamClose
    | NodeBye
)
Request = Open | CellFiles | NodeStacks | Probe | Leftovers | NodeStop  # the orders answered
NodeOrder = (
    Welcome
    | JoinRefused
    | Beat
    | Open
    | CellFiles
    | Signal
    | NodeStacks
    | Probe
    | RanksUp
    | Leftovers
    | NodeStop
    | Close
    | StreamData
    | StreamClose
    | NodeBye
)


def node_news(frame: Frame) -> NodeNews:
    """A frame from a join agent, checked."""
    return typing.cast(NodeNews, check(frame, NodeNews))


def node_order(frame: Frame) -> NodeOrder:
    """A frame from the supervisor, as a join agent reads it, checked."""
    return typing.cast(NodeOrder, check(frame, NodeOrder))
