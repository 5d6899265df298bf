"""The kernel's channel: the kernel <-> its supervisor, over a Unix socket in an owner-only
directory; the JupyterLab panel's server extension (elastic_nb.server) talks it too, one
connection per request, its hello saying role "panel".

The kernel asks (`KernelRequest`: submit a cell, run it on a session's ranks, stop, stacks, warm,
up and down, the session's state, the machines, the join line; the panel's overview and a job's
events) and the supervisor answers each request with one reply ({req, ok, data}), and follows
each job with updates (at most ten a second per job) and its end, last (`KernelNews`). Only the
connection whose hello says role "kernel" is the kernel's lifeline: its end ends the supervisor;
any other connection may come and go. The hello carries the protocol's `wire.VERSION`, checked
at the handshake. `python -m elastic_nb.protocol` lists every message of every channel with its
fields.
"""

from __future__ import annotations

import typing
from typing import Any, Final, Literal, TypedDict

from elastic_nb.protocol.records import (
    Alert,
    Chip,
    LogBatch,
    MemorySample,
    NodeInfo,
    Replied,
    Round,
    Summary,
    Waiting,
)
from elastic_nb.protocol.wire import VERSION, Frame, ProtocolError, check

__all__ = [
    "DOWN",
    "END",
    "EVENTS",
    "HELLO",
    "INPUT",
    "JOBS",
    "JOIN",
    "NODES",
    "OVERVIEW",
    "PROMPT",
    "REPLIES",
    "REPLY",
    "ROLE_KERNEL",
    "ROLE_PANEL",
    "SESSION",
    "STACKS",
    "STATUS",
    "STOP",
    "SUBMIT",
    "UP",
    "UPDATE",
    "WARM",
    "CellSource",
    "Done",
    "Down",
    "End",
    "EventList",
    "Events",
    "Hello",
    "Input",
    "JobList",
    "JobRow",
    "Jobs",
    "Join",
    "JoinLine",
    "JoinedMachine",
    "JournalCell",
    "KernelNews",
    "KernelRequest",
    "Listening",
    "Machine",
    "MachineList",
    "Nodes",
    "Overview",
    "PanelAlert",
    "PanelEntry",
    "PanelList",
    "Prompt",
    "RankMemory",
    "Replay",
    "Reply",
    "Request",
    "SessionInfo",
    "SessionRank",
    "SessionState",
    "SessionUp",
    "StackText",
    "Stacks",
    "Status",
    "Stop",
    "Stopping",
    "Submit",
    "Submitted",
    "SupervisorStatus",
    "Up",
    "Update",
    "Warm",
    "WarmLauncher",
    "check_hello",
    "kernel_news",
    "kernel_request",
]

# kernel -> supervisor
HELLO: Final = "hello"
ROLE_KERNEL = "kernel"  # hello's role: the kernel's lifeline
ROLE_PANEL = "panel"  # hello's role: the server extension, a request at a time
SUBMIT: Final = "submit"
STOP: Final = "stop"
JOBS: Final = "jobs"
STATUS: Final = "status"
STACKS: Final = "stacks"
WARM: Final = "warm"
UP: Final = "up"
DOWN: Final = "down"
SESSION: Final = "session"
NODES: Final = "nodes"
JOIN: Final = "join"
# the JupyterLab panel (the server extension) -> supervisor; any other request above works too
OVERVIEW: Final = "overview"  # every job, session and session cell, as the panel lists them
EVENTS: Final = "events"  # what a job's renderer was sent, since a sequence number
INPUT: Final = "input"  # the notebook's answer to a rank's prompt (PROMPT)
# supervisor -> kernel
REPLY: Final = "reply"
UPDATE: Final = "update"
END: Final = "end"
PROMPT: Final = "prompt"  # a rank asks for input: pdb's prompt, a cell's input()


def check_hello(msg: Hello) -> None:
    if msg.get("kind") != HELLO:
        raise ProtocolError(f"expected hello, got {msg.get('kind')!r}")
    if msg.get("version") != VERSION:
        raise ProtocolError(
            f"protocol version {msg.get('version')} on the other side, {VERSION} here: "
            "restart the kernel after upgrading elastic_nb"
        )


class _Hello(TypedDict):
    kind: Literal["hello"]
    version: int


class Hello(_Hello, total=False):
    """Both ways on the kernel channel: the kernel's (role, kernel_pid), the supervisor's (pid),
    or its refusal (error)."""

    role: str
    kernel_pid: int
    pid: int
    error: str


class CellSource(TypedDict):
    source: str
    meta: dict[str, Any]


class Submit(TypedDict):
    kind: Literal["submit"]
    req: int
    job: str
    spec: dict[str, Any]
    cell: CellSource
    env: dict[str, str]
    session: str | None


class Stop(TypedDict):
    kind: Literal["stop"]
    req: int
    job: str | None
    reason: str


class Jobs(TypedDict):
    kind: Literal["jobs"]
    req: int


class Status(TypedDict):
    kind: Literal["status"]
    req: int


class Stacks(TypedDict):
    kind: Literal["stacks"]
    req: int
    job: str | None


class Warm(TypedDict):
    kind: Literal["warm"]
    req: int
    on: bool


class Up(TypedDict):
    kind: Literal["up"]
    req: int
    session: str
    spec: dict[str, Any]
    env: dict[str, str]


class _Down(TypedDict):
    kind: Literal["down"]
    req: int
    session: str


class Down(_Down, total=False):
    reason: str


class SessionInfo(TypedDict):
    kind: Literal["session"]
    req: int
    session: str


class Overview(TypedDict):
    kind: Literal["overview"]
    req: int


class Nodes(TypedDict):
    kind: Literal["nodes"]
    req: int


class Join(TypedDict):
    kind: Literal["join"]
    req: int
    host: str | None  # where agents reach this machine (None: its primary address)
    port: int  # 0: a free port (only when the channel is not open yet)
    new_token: bool  # replace the token: agents holding the old one are dropped


class Input(TypedDict):
    kind: Literal["input"]
    req: int
    job: str
    attempt: int
    rank: int
    ask: int  # the rank's number for what it asked
    text: str | None  # None: the frontend takes no input (`why`)
    why: str | None


class Events(TypedDict):
    kind: Literal["events"]
    req: int
    job: str
    since: int


class Reply(Replied):
    """To every request (records.Replied)."""

    kind: Literal["reply"]


class _Update(TypedDict):
    kind: Literal["update"]
    job: str


class Update(_Update, total=False):
    """What changed in a job since its last update (at most ten a second)."""

    state: str
    attempt: int
    ranks: dict[str, Chip]
    alerts: list[Alert]
    logs: list[LogBatch]
    memory: list[MemorySample]  # each rank's samples since the last update
    checkpoints: list[dict[str, Any]]  # checkpoints saved since the last update (their records)
    rounds: list[Round]  # a multi-node job's rounds so far (the whole timeline, when it changed)
    groups: bool  # a rank made a process group: its collectives can time out (said once)


class Prompt(TypedDict):
    """A rank waits for a line of input (pdb's prompt, a cell's input()): the kernel asks the
    frontend and answers with an INPUT request."""

    kind: Literal["prompt"]
    job: str
    attempt: int
    rank: int
    ask: int
    prompt: str
    waits: list[Waiting]  # the ranks that wait for it in a collective, as last looked


class End(TypedDict):
    kind: Literal["end"]
    job: str
    summary: Summary


# ---- replies: the data of each request's reply, of the type REPLIES names for its kind ----


class Done(TypedDict):
    """A reply that only says the request was done (warm, down)."""


class Submitted(TypedDict):
    job: str  # the job's id (or the session cell's)


class Stopping(TypedDict):
    stopping: list[str]  # the jobs (and session cells) that were running and now stop


class StackText(TypedDict):
    text: str  # every rank's stack, as %elastic stacks prints it
    pids: dict[str, int]  # the live ranks' pids by rank, of whom the stacks are


class JobRow(TypedDict):
    """One job as %elastic jobs lists it."""

    job: str
    state: str
    attempt: int
    world_size: int
    run_dir: str
    created: float
    outcome: str | None
    wall_s: float


class JobList(TypedDict):
    jobs: list[JobRow]


class SessionRank(TypedDict):
    rank: int
    pid: int | None
    state: str  # starting, up, gone


class JournalCell(TypedDict):
    no: int
    job: str
    line: str  # the cell's first line
    replay: bool  # run again after a restart


class Replay(TypedDict):
    """How a session's journal was replayed after a restart."""

    attempt: int
    cells: int  # replayed so far
    seconds: float
    failed: bool


class SessionState(TypedDict):
    """What %elastic session shows."""

    session: str
    state: str
    world_size: int
    attempt: int
    restarts: int
    max_restarts: int
    ranks: list[SessionRank]
    cells_run: int
    journal: list[JournalCell]
    replays: list[Replay]
    run_dir: str
    checkpoint: dict[str, Any] | None  # the latest saved (its record, as checkpoint/ writes it)
    created: float
    reason: str | None  # why it ended, once it has


class SessionUp(TypedDict):
    session: str
    run_dir: str


class WarmLauncher(TypedDict):
    """The idle launcher and its zygote, for %elastic status."""

    pid: int | None
    ready: bool
    age_s: float
    preload: list[str]
    zygote: int | None
    zygote_ready: bool
    rss_mb: float
    pss_mb: float


class RankMemory(TypedDict):
    sample: MemorySample  # the latest
    rss_peak: int | None
    growth: float | None  # bytes a minute, over the last minute


class SupervisorStatus(TypedDict):
    pid: int
    uptime_s: float
    running: list[str]
    sessions: list[SessionState]
    warm: WarmLauncher | None
    memory: dict[str, dict[str, RankMemory]]  # job or session -> rank -> its memory now


class PanelAlert(TypedDict):
    kind: str
    severity: str
    rank: int | None
    text: str


class PanelEntry(TypedDict):
    """A job, a session or a session cell, as the JupyterLab panel lists it."""

    id: str
    kind: str  # job, session, cell
    session: str | None  # a cell's session
    supervisor_pid: int
    state: str
    running: bool
    world_size: int
    attempt: int
    restarts: int
    max_restarts: int
    created: float
    elapsed_s: float
    alerts: list[PanelAlert]
    outcome: str | None
    summary: str | None  # its summary's line, once it has ended
    run_dir: str
    logs_dir: str
    paused: list[int]  # its ranks waiting at a prompt (pdb's, an input()) now


class PanelList(TypedDict):
    jobs: list[PanelEntry]


class EventList(TypedDict):
    # Each the update or end the job's renderer was sent, with its "seq" and "t" (the panel
    # replays them into a renderer, which reads them as it reads a live job's).
    events: list[dict[str, Any]]
    seq: int


class Listening(TypedDict):
    host: str
    port: int
    token: str  # the token's fingerprint, never the token


class Machine(NodeInfo):
    node: int  # 0: this machine
    state: str  # here; ready, lost, left (a join agent's)


class JoinedMachine(Machine):
    why: str | None  # why it is no longer ready
    joined: float
    last_heard_s: float
    groups: list[str]  # the jobs and sessions it runs ranks of


class _MachineList(TypedDict):
    listening: Listening | None
    here: Machine
    agents: list[JoinedMachine]


class MachineList(_MachineList, total=False):
    refused: list[dict[str, Any]]  # agents refused lately: name, addr (where known), why


class JoinLine(TypedDict):
    command: str  # the line to run on each machine that joins
    dropped: int  # agents dropped by a new token


# Each request's reply data. A reader checks a reply against its request's entry: half of every
# request/reply is the reply.
REPLIES: dict[str, type] = {
    SUBMIT: Submitted,
    STOP: Stopping,
    STACKS: StackText,
    WARM: Done,
    JOBS: JobList,
    STATUS: SupervisorStatus,
    UP: SessionUp,
    DOWN: Done,
    SESSION: SessionState,
    OVERVIEW: PanelList,
    EVENTS: EventList,
    NODES: MachineList,
    JOIN: JoinLine,
    INPUT: Done,
}


# What each channel carries; a reader takes a frame only through its channel's parser.
Request = (
    Submit
    | Stop
    | Jobs
    | Status
    | Stacks
    | Warm
    | Up
    | Down
    | SessionInfo
    | Overview
    | Events
    | Nodes
    | Join
    | Input
)  # every message of the kernel's that asks for a reply
KernelRequest = Hello | Request
KernelNews = Hello | Reply | Update | Prompt | End


def kernel_request(frame: Frame) -> KernelRequest:
    """A frame on the supervisor's socket (the kernel's or the panel's), checked."""
    return typing.cast(KernelRequest, check(frame, KernelRequest))


def kernel_news(frame: Frame) -> KernelNews:
    """A frame from the supervisor, as its kernel (or the panel) reads it, checked."""
    return typing.cast(KernelNews, check(frame, KernelNews))
