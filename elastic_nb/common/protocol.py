"""The protocol between elastic_nb's processes: one module, one framing, one version.

Its channels (each below, with what it carries):

* kernel <-> supervisor, over a Unix socket in an owner-only directory (the JupyterLab panel's
  server extension too, one connection per request);
* launcher -> supervisor, over a pipe (the launcher's stdout, set aside before torch loads);
* rank <-> supervisor in a session, over a Unix socket per session;
* join agent <-> supervisor, over ZeroMQ with CURVE (another machine's node).

A frame is one line of compact JSON (an object with a ``"kind"``), optionally followed by a raw
binary blob whose length the header gives as ``"blob"``: pushed objects travel that way, without
base64. Every message of the kernel channel is checked against `VERSION` at the handshake.

Kernel -> supervisor                      Supervisor -> kernel
  hello {version, kernel_pid}               hello {version, pid}
  submit {req, spec, cell} + blob           reply {req, ok, data}  (to every request)
  stop {req, job, reason}                   update {job, ...}      (<= 10 per second per job)
  jobs {req}                                end {job, summary}     (once per job, last)
  status {req}
  stacks {req, job}                         (reply: text, every rank's stack; pids, the
                                            attempt's live ranks' {rank: pid})
  warm {req, on}                            (off: end the idle warm launcher now)
  up {req, session, spec, env}              start a session: ranks that stay up across cells
                                            (its updates and end come as a job's, id session)
  submit {..., session}                     a cell run on the session's ranks (a job of its own
                                            for the kernel: updates, end)
  down {req, session, reason?}              end the session (reason: who asked, as stop's)
  session {req, session}                    the session: ranks, attempt, restarts, journal
  nodes {req}                               the machines (this one, the join agents)
  join {req, host, port, new_token}         the line that starts a join agent elsewhere
                                            (the agents' channel opens at the first one)

The JupyterLab panel's server extension -> supervisor (elastic_nb.server), one connection per
request: hello {version, role: "panel"}, then one of stop {req, job, reason: "panel"},
stacks {req, job}, down {req, session, reason: "panel"} (above), or
  overview {req}                            every job, session and session cell, one entry each
  events {req, job, since}                  the update/end messages a job, session or session
                                            cell was last sent (a bounded history), after since
Only the connection whose hello says role "kernel" is the kernel's lifeline: its end ends the
supervisor; any other connection may come and go.

Launcher -> supervisor
  ready {pid}                               launcher is up, torch imported
  rendezvous {attempt, seconds}             agent finished a rendezvous
  start {attempt, rank, pid}                agent started one rank of an attempt
  exit {attempt, rank, pid, code}           a forked rank ended (its fork server reaps it at
                                            once: only the launcher learns how)
  exits {attempt, codes: {rank: code}}      agent closed an attempt (exit codes, -N = signal N)
  tick {t}                                  agent monitor loop is alive (every TICK_EVERY_S)
  agent_failed {error, t}                   torch's agent raised in its run (before it
                                            ends the ranks: they die of its SIGTERM next)
  result {ok, error?}                       elastic_launch returned or raised
  store {port}                              a multi-node group's rendezvous store host (a
                                            launcher in that role) serves on 127.0.0.1:port

Every message kind is a TypedDict below (its `kind` a literal): senders build one, mypy checks
it, and a reader takes a frame only through the parser of its channel (`kernel_request`,
`kernel_news`, `launcher_news`, `rank_news`, `session_order`), which refuses a kind that channel
does not carry and a message whose fields are missing or of the wrong type (ProtocolError). The
records inside messages (an update's alerts, rank chips and log batches, the end's summary) are
TypedDicts too: one definition for the supervisor that writes them and the handle, the text
renderer and the dashboard that read them.

Rank <-> supervisor, in a session (a Unix socket per session, in the owner-only socket directory;
never torch's TCPStore, which has no authentication)
  rank_hello {rank, attempt, pid}           a rank is up and waits for cells
  run {cell, run_dir}                       supervisor: run this cell (its own run directory)
  ran {cell, ok}                            rank: done with it; its records are in run_dir
  interrupt {cell}                          supervisor: KeyboardInterrupt in that cell
  bye {}                                    supervisor: the session ends; leave the loop

Supervisor -> rank (the desync watch; a FIFO per rank, see rundir.RunDir.probe)
  "<n> status" or "<n> full"                the rank's flight recorder: each group's last
                                            collective, or every entry too; the rank answers
                                            into rank-R.probe.json, tagged "req": n

Join agent <-> supervisor (a node on another machine; one ZeroMQ connection per agent, CURVE:
mutually authenticated and encrypted, see supervisor/nodes/channel.py). A frame is the same
header, and its blob travels as a second ZeroMQ frame.

Agent -> supervisor                       Supervisor -> agent
  node_hello {version, info}                welcome {version, node, info} | refused {error}
  beat {t, groups}                          beat {t}                 (both ways, every BEAT_S)
  launcher {group, msg}                     open {req, group, spec, env, round, session}
                                              + files (a tar)
  launcher_exit {group, outcome, reason}    cell {req, group, cell} + files (a session cell's)
  rank_gone {group, attempt, rank, t, code} signal {group, attempt, rank, sig}
  file {group, path, offset} + bytes        stacks {req, group, ranks, wait_s}
  memory {group, rss, gpu, limit, gpus}     probe {req, group, attempt, rank, what, wait_s}
  answer {req, ok, data, error?}            ranks_up {group}
  stream_open {group, stream, to, peer}     leftovers {req, group, grace, stuck}
  stream_data {group, stream} + bytes       stop {req, group, grace} | close {group, ended}
  stream_close {group, stream}              stream_data / stream_close (the other way)
  bye {reason}                              bye {reason}

A stream is a connection a process on the agent's machine opened to the agent's loopback
listeners: a launcher's to the rendezvous store ("store": the supervisor connects it to the
group's store on its own loopback), or a session rank's to its session ("session": the peer's
pid as the agent saw it). `file` mirrors what the node's ranks leave into the notebook's run
directory, appended at `offset` (-1: the whole file, replaced); only what a node may write
(supervisor/nodes/files.py, from_node: never the notebook's own files there).
"""

from __future__ import annotations

import json
import signal
import types
import typing
from collections.abc import Callable, Iterator
from typing import Any, Final, Literal, TypedDict, Union

__all__ = [
    "VERSION",
    "Alert",
    "Chip",
    "CudaMemory",
    "FrameDecoder",
    "GpuShare",
    "LogBatch",
    "MemoryPeak",
    "MemorySample",
    "Message",
    "ProtocolError",
    "Round",
    "Summary",
    "assignment",
    "encode",
    "kernel_news",
    "kernel_request",
    "launcher_news",
    "node_news",
    "node_order",
    "rank_news",
    "session_order",
    "summary",
]

VERSION = 6  # 2: log batches are records; 3: sessions; 4: typed messages, a reply's data;
# 5: memory samples; 6: nodes (join agents)

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
# supervisor -> kernel
REPLY: Final = "reply"
UPDATE: Final = "update"
END: Final = "end"
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
# supervisor <-> a session's ranks
RANK_HELLO: Final = "rank_hello"
RUN: Final = "run"
RAN: Final = "ran"
INTERRUPT: Final = "interrupt"
BYE: Final = "bye"
# Where a session's ranks find its socket (set in their environment by the supervisor).
SESSION_SOCKET_ENV = "ELASTIC_NB_SESSION_SOCKET"
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
# What a stream connects to: a launcher's rendezvous store, or a session's rank to its session.
STREAM_STORE = "store"
STREAM_SESSION = "session"
# Both sides of a join agent's channel say they live this often; one silent for LOST_AFTER_S is
# gone (the README promises a node that leaves is known within 2 s).
BEAT_S = 0.25
LOST_AFTER_S = 1.75

# The launcher reports its agent's monitor loop at most this often; the zombie watchdog's bound
# is built on it.
TICK_EVERY_S = 0.25

# The supervisor asks a rank for every thread's Python stack through its probe thread
# (PROBE_STACKS), which has faulthandler write them into the rank's .stacks file while it holds
# the GIL: no other thread moves its frames then. Only a rank whose probe thread cannot start
# (the main thread holds the GIL in native code, or the rank has no probe thread) is sent this
# signal instead: faulthandler answers it without the GIL, safe only while no other thread runs
# Python (walking the frames of a thread that runs can crash the rank: it did, beside a probe).
STACK_SIGNAL = signal.SIGUSR1
# The .stacks file's first line: how every dump in it ends (the main thread, the oldest, is
# dumped last, and its outermost frame stays put), so that a dump is read whole, not as written.
STACKS_END_MARK = "# elastic_nb: each dump below ends with: "

# What a probe asks a rank (rank/recorder.py answers): its flight recorder, each group's last
# collective or every entry too; or its CUDA allocator's memory figures; or every thread's stack
# (``"<n> stacks <deadline>"``: answered into the .stacks file, unless the wall clock is past
# the deadline, when the supervisor has signalled the rank instead).
PROBE_STATUS = "status"
PROBE_FULL = "full"
PROBE_MEMORY = "memory"
PROBE_STACKS = "stacks"

# A header line longer than this is a corrupt stream, not a message.
_MAX_HEADER = 16 * 1024 * 1024
_MAX_BLOB = 1 << 40

Frame = dict[str, Any]  # a decoded frame, before its channel's parser has checked it


class ProtocolError(RuntimeError):
    """The other side sent something that is not a frame of this protocol."""


def encode(msg: Message, blob: bytes | None = None) -> bytes:
    header: dict[str, Any] = dict(msg)
    if blob is not None:
        header["blob"] = len(blob)
    line = json.dumps(header, separators=(",", ":"), default=str).encode() + b"\n"
    return line + blob if blob else line


class FrameDecoder:
    """Incremental decoder: feed bytes as they arrive, iterate complete (message, blob) pairs."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pending: Frame | None = None  # header waiting for its blob

    def feed(self, data: bytes) -> Iterator[tuple[Frame, bytes | None]]:
        self._buf += data
        while True:
            if self._pending is not None:
                size = self._pending["blob"]
                if len(self._buf) < size:
                    return
                blob = bytes(self._buf[:size])
                del self._buf[:size]
                msg, self._pending = self._pending, None
                yield msg, blob
                continue
            nl = self._buf.find(b"\n")
            if nl < 0:
                if len(self._buf) > _MAX_HEADER:
                    raise ProtocolError("header line too long")
                return
            line = bytes(self._buf[:nl])
            del self._buf[: nl + 1]
            if not line.strip():
                continue
            try:
                msg = json.loads(line)
            except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
                raise ProtocolError(f"not a frame: {line[:80]!r}") from e
            if not isinstance(msg, dict) or "kind" not in msg:
                raise ProtocolError(f"frame without a kind: {line[:80]!r}")
            if "blob" in msg:
                size = msg["blob"]
                if type(size) is not int or not 0 <= size <= _MAX_BLOB:
                    raise ProtocolError(f"bad blob size in {line[:80]!r}")
                self._pending = msg
                continue
            yield msg, None


def check_hello(msg: Hello) -> None:
    if msg.get("kind") != HELLO:
        raise ProtocolError(f"expected hello, got {msg.get('kind')!r}")
    if msg.get("version") != VERSION:
        raise ProtocolError(
            f"protocol version {msg.get('version')} on the other side, {VERSION} here: "
            "restart the kernel after upgrading elastic_nb"
        )


# ---- records --------------------------------------------------------------------------------


class _Alert(TypedDict):
    kind: str  # failure, oom, desync, collective_timeout, hang, zombie, restart, stacks, ...
    severity: str  # error, warning, info
    title: str
    rank: int | None  # the rank it is about, if one
    text: str | None  # the detail: stacks, a traceback, a memory report
    time: float


class Alert(_Alert, total=False):
    key: str  # one story told as it goes (a replay): it replaces the last alert of its key
    ends: int  # a restart's: the attempt it ended (its words are why that attempt ended)


class Chip(TypedDict, total=False):
    """One rank of the current attempt, as a dashboard shows it."""

    state: str  # running, done, failed, stopped, zombie
    label: str  # a few words: "exited 0", "ValueError", "left the cell early"
    attempt: int
    pid: int | None
    detail: str  # the whole story, for a failed or stopped rank
    node: str  # a multi-node job's: where the rank runs, "node 1 (gpu-b)"


class Round(TypedDict):
    """A multi-node job's round: its nodes, why it began, and what the change cost."""

    attempt: int
    nodes: list[str]  # "node 0 (here)", "node 1 (gpu-b)"
    world_size: int
    why: str  # "first round", "node 2 (gpu-c) joined", "node 1 (gpu-b) left: connection lost"
    counted: bool  # it spent a restart of the job's budget (failures, departures; not arrivals)
    restarts: int  # restarts spent once it began
    started: float  # when the change began (wall clock)
    stop_s: float | None  # ending the last round's ranks
    rendezvous_s: float | None  # its launchers' rendezvous
    running_s: float | None  # from the change to every rank of the round running


class LogBatch(TypedDict):
    """New output of one rank's stream since the last update."""

    attempt: int
    rank: int
    stream: str  # out, err
    lines: list[str]  # whole lines, at most a bounded number per update
    skipped: int  # lines left out of this update (the log file has them)
    progress: str | None  # the latest state of a \r progress bar, if one is being drawn


class CudaMemory(TypedDict):
    """A rank's CUDA allocator, as torch.cuda.memory_stats counts it (bytes)."""

    device: int
    allocated: int
    reserved: int
    peak: int  # the most allocated at once since the rank started (or its peak was reset)
    total: int  # the device's memory


class GpuShare(TypedDict):
    """What NVML says of a rank's process and its GPU (bytes): the process's share, its CUDA
    context and NCCL's buffers included (what the allocator does not count), and the device."""

    index: int  # NVML's numbering, as nvidia-smi's
    process: int
    used: int  # by every process on the device
    total: int


class MemorySample(TypedDict):
    """One rank's memory at time t (at most one a second): its host memory (RSS, read by the
    supervisor from /proc: no cost to the rank), its CUDA allocator's figures (asked of the rank
    only when NVML sees its process on a GPU) and NVML's."""

    attempt: int
    rank: int
    t: float
    rss: int | None
    cuda: CudaMemory | None
    gpu: GpuShare | None
    limit: int | None  # the host memory its ranks may use: their cgroup's limit, or the machine's


class MemoryPeak(TypedDict):
    """A rank's highest figures over a job (bytes; None: never seen)."""

    rss: int | None
    cuda: int | None  # the allocator's peak
    gpu: int | None  # NVML's, the process's share
    gpu_index: int | None


class Summary(TypedDict):
    """A finished job: summary.json, the END message, what the cell raises or returns."""

    job: str
    outcome: str  # succeeded, failed, timeout, interrupted, stopped
    reason: str
    cause: str | None  # report.CAUSE_HINTS' classes
    world_size: int
    attempt: int  # the last attempt
    restarts: int
    max_restarts: int
    worst_case_s: float | None
    started: float | None
    ended: float | None
    wall_s: float
    run_dir: str
    failure: dict[str, Any] | None  # rank, attempt, cause, summary, hint, record, exit_code
    diagnosis: dict[str, Any] | None  # text, hint, stacks (a timeout or desync's evidence)
    others: list[dict[str, Any]]  # every other rank: rank, kind, text, delay
    launcher_log_tail: str | None
    leftovers: list[dict[str, Any]]  # processes the cell left running: pid, cmd
    result: bool  # rank 0 left a value for the cell
    lines: int
    session: str | None  # the session whose ranks ran the cell (%elastic up), if one
    memory: dict[str, MemoryPeak]  # rank -> its peaks, as sampled each second
    checkpoint: dict[str, Any] | None  # the latest saved (its record), words on what a failure cost


def summary(job: str, outcome: str, reason: str, **known: Any) -> Summary:
    """A summary with every key; what is not `known` is empty."""
    s: dict[str, Any] = {
        "job": job,
        "outcome": outcome,
        "reason": reason,
        "cause": None,
        "world_size": 0,
        "attempt": 0,
        "restarts": 0,
        "max_restarts": 0,
        "worst_case_s": None,
        "started": None,
        "ended": None,
        "wall_s": 0.0,
        "run_dir": "",
        "failure": None,
        "diagnosis": None,
        "others": [],
        "launcher_log_tail": None,
        "leftovers": [],
        "result": False,
        "lines": 0,
        "session": None,
        "memory": {},
        "checkpoint": None,
    }
    unknown = set(known) - set(s)
    if unknown:
        raise TypeError(f"not summary keys: {sorted(unknown)}")
    s.update(known)
    return typing.cast(Summary, s)


# ---- messages -------------------------------------------------------------------------------


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


class Events(TypedDict):
    kind: Literal["events"]
    req: int
    job: str
    since: int


class _Reply(TypedDict):
    kind: Literal["reply"]
    req: int | None
    ok: bool
    data: dict[str, Any]


class Reply(_Reply, total=False):
    """To every request: ok and the request's data, or not ok and why."""

    error: str


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


class End(TypedDict):
    kind: Literal["end"]
    job: str
    summary: Summary


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


class Interrupt(TypedDict):
    kind: Literal["interrupt"]
    cell: str


class Bye(TypedDict):
    kind: Literal["bye"]


# ---- the launcher's assignment (supervisor -> launcher, one JSON line on its stdin) ----------


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


# ---- join agent <-> supervisor ------------------------------------------------------------


class NodeInfo(TypedDict):
    """A machine that can run ranks, as `%elastic nodes` lists it."""

    name: str  # its host name
    addr: str  # the address other nodes reach it at
    pid: int  # the join agent's (or the supervisor's, for the notebook's machine)
    cpus: int
    gpus: list[str]  # NVML's names, in NVML's order
    python: str
    torch: str | None
    cuda: str | None
    elastic_nb: str
    workdir: str  # where its run directories and per-job working directories are


class GroupBeat(TypedDict):
    """A group's processes on an agent's machine, as its LocalNode sees them now."""

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


class Refused(TypedDict):
    kind: Literal["refused"]
    error: str


class Beat(TypedDict):
    kind: Literal["beat"]
    t: float  # the sender's wall clock
    groups: dict[str, GroupBeat]  # the agent's: each group it serves (the supervisor's: {})


class LauncherSaid(TypedDict):
    kind: Literal["launcher"]
    group: str
    msg: dict[str, Any]  # a launcher message (launcher_news checks it)


class LauncherExit(TypedDict):
    kind: Literal["launcher_exit"]
    group: str
    outcome: str
    reason: str


class RankGone(TypedDict):
    kind: Literal["rank_gone"]
    group: str
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
    rss: dict[str, int]
    gpu: dict[str, GpuShare]
    limit: dict[str, Any] | None  # procs.MemoryLimit's fields
    gpus: bool


class _Answer(TypedDict):
    kind: Literal["answer"]
    req: int
    ok: bool
    data: dict[str, Any]


class Answer(_Answer, total=False):
    error: str


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


# What each channel carries; a reader takes a frame only through its channel's parser.
KernelRequest = (
    Hello
    | Submit
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
)
KernelNews = Hello | Reply | Update | End
LauncherNews = Ready | Rendezvous | Start | Exit | Exits | Tick | AgentFailed | Result | StoreUp
RankNews = RankHello | Ran
SessionOrder = Run | Interrupt | Bye
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
NodeOrder = (
    Welcome
    | Refused
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
Message = KernelRequest | KernelNews | LauncherNews | RankNews | SessionOrder | NodeNews | NodeOrder


def kernel_request(frame: Frame) -> KernelRequest:
    """A frame on the supervisor's socket (the kernel's or the panel's), checked."""
    return typing.cast(KernelRequest, _check(frame, KernelRequest))


def kernel_news(frame: Frame) -> KernelNews:
    """A frame from the supervisor, as its kernel (or the panel) reads it, checked."""
    return typing.cast(KernelNews, _check(frame, KernelNews))


def launcher_news(frame: Frame) -> LauncherNews:
    """A frame on a launcher's pipe, checked."""
    return typing.cast(LauncherNews, _check(frame, LauncherNews))


def rank_news(frame: Frame) -> RankNews:
    """A frame from a session's rank, checked."""
    return typing.cast(RankNews, _check(frame, RankNews))


def session_order(frame: Frame) -> SessionOrder:
    """A frame from the supervisor, as a session's rank reads it, checked."""
    return typing.cast(SessionOrder, _check(frame, SessionOrder))


def node_news(frame: Frame) -> NodeNews:
    """A frame from a join agent, checked."""
    return typing.cast(NodeNews, _check(frame, NodeNews))


def node_order(frame: Frame) -> NodeOrder:
    """A frame from the supervisor, as a join agent reads it, checked."""
    return typing.cast(NodeOrder, _check(frame, NodeOrder))


def assignment(frame: Frame) -> Assignment:
    """The launcher's assignment, checked (it has no kind: it is the line's one message)."""
    if not _fits_of(Assignment)(frame):
        why = _misfit(frame, Assignment, "") or "does not fit its type"
        raise ProtocolError(
            f"the assignment {why}" if why.startswith("without ") else f"the assignment: {why}"
        )
    return typing.cast(Assignment, frame)


_KINDS: dict[object, dict[str, tuple[type, Callable[[Any], bool]]]] = {}


def _check(frame: Frame, channel: object) -> Frame:
    """The frame if it is one of the channel's messages with every field it needs, of its type,
    nested records, lists and maps included; else ProtocolError naming the first field that
    does not fit."""
    kinds = _KINDS.get(channel)
    if kinds is None:
        kinds = _KINDS[channel] = {
            typing.get_args(typing.get_type_hints(t)["kind"])[0]: (t, _fits_of(t))
            for t in typing.get_args(channel)
        }
    kind = frame.get("kind")
    entry = kinds.get(kind) if type(kind) is str else None
    if entry is None:
        raise ProtocolError(f"unexpected message kind {kind!r} on this channel")
    cls, fits = entry
    if not fits(frame):
        why = _misfit(frame, cls, "") or "does not fit its type"
        raise ProtocolError(f"{kind} {why}" if why.startswith("without ") else f"{kind}: {why}")
    return frame


# ---- the checker ------------------------------------------------------------------------------
#
# Each message type compiles once into a function (generated Python source: one expression a
# field) that says whether a frame fits it, nested records, lists and maps included; the path of
# the first field that does not fit is found only then, by `_misfit`, slowly.

_MISSING = object()
_NUM = (int, float)


def _expr(hint: Any, v: str, depth: int, names: dict[str, Any]) -> str:
    """A Python expression, true when the value named `v` fits `hint`."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return "True"
    if hint is type(None):
        return f"{v} is None"
    if hint is float:
        return f"type({v}) in _NUM"
    if hint in (str, int, bool):
        return f"type({v}) is {hint.__name__}"
    if origin is Literal:
        return f"{v} in {typing.get_args(hint)!r}"
    if origin in (Union, types.UnionType):
        return "(" + " or ".join(_expr(h, v, depth, names) for h in typing.get_args(hint)) + ")"
    if _is_record(hint):
        names[f"_fits_{hint.__name__}"] = _fits_of(hint)
        return f"_fits_{hint.__name__}({v})"
    x = f"_x{depth}"
    if origin is list:
        (item,) = typing.get_args(hint) or (Any,)
        each = _expr(item, x, depth + 1, names)
        every = "" if each == "True" else f" and all({each} for {x} in {v})"
        return f"(type({v}) is list{every})"
    if origin is dict or hint is dict:
        key, value = typing.get_args(hint) or (Any, Any)
        each = " and ".join(
            e
            for e in (_expr(key, f"_k{depth}", depth + 1, names), _expr(value, x, depth + 1, names))
            if e != "True"
        )
        every = f" and all({each} for _k{depth}, {x} in {v}.items())" if each else ""
        return f"(type({v}) is dict{every})"
    raise TypeError(f"the protocol's checker has no rule for {hint!r}")


def _is_record(hint: Any) -> bool:
    return isinstance(hint, type) and issubclass(hint, dict) and hasattr(hint, "__required_keys__")


_FITS: dict[type, Callable[[Any], bool]] = {}


def _fits_of(cls: type) -> Callable[[Any], bool]:
    """`cls`'s compiled check (a TypedDict): whether a value is a dict with each of its required
    keys and every key it declares of its type (keys it does not declare are a newer writer's)."""
    known = _FITS.get(cls)
    if known is not None:
        return known
    names: dict[str, Any] = {"_MISSING": _MISSING, "_NUM": _NUM}
    required = cls.__required_keys__  # type: ignore[attr-defined]
    lines = [
        f"def _fits_{cls.__name__}(m):",
        "    if type(m) is not dict: return False",
        "    g = m.get",
    ]
    for key, hint in typing.get_type_hints(cls).items():
        test = _expr(hint, "v", 0, names)
        lines.append(f"    v = g({key!r}, _MISSING)")
        if key in required:
            lines.append(f"    if v is _MISSING or not ({test}): return False")
        elif test != "True":
            lines.append(f"    if v is not _MISSING and not ({test}): return False")
    lines.append("    return True")
    exec("\n".join(lines), names)  # our own source, from our own type hints
    fits: Callable[[Any], bool] = names[f"_fits_{cls.__name__}"]
    _FITS[cls] = fits
    return fits


def _misfit(value: Any, hint: Any, path: str) -> str | None:
    """Where `value` does not fit `hint`: the path of the first field that does not, and why
    (None: it fits). Only called once the compiled check said no."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        args = typing.get_args(hint)
        if any(_misfit(value, h, path) is None for h in args):
            return None
        records = [h for h in args if _is_record(h)]
        if len(records) == 1 and isinstance(value, dict):
            return _misfit(value, records[0], path)
        return f"{path} is not a {_name(hint)}: {value!r:.80}"
    if _is_record(hint):
        if not isinstance(value, dict):
            return f"{path} is not a record: {value!r:.80}"
        for key, h in typing.get_type_hints(hint).items():
            if key not in value:
                if key in hint.__required_keys__:
                    return f"{path}.{key} is missing" if path else f"without {key}"
                continue
            found = _misfit(value[key], h, f"{path}.{key}" if path else key)
            if found:
                return found
        return None
    if origin is list and isinstance(value, list):
        (item,) = typing.get_args(hint) or (Any,)
        for i, x in enumerate(value):
            found = _misfit(x, item, f"{path}[{i}]")
            if found:
                return found
        return None
    if (origin is dict or hint is dict) and isinstance(value, dict):
        key_hint, value_hint = typing.get_args(hint) or (Any, Any)
        for k, x in value.items():
            found = _misfit(k, key_hint, f"{path} key") or _misfit(x, value_hint, f"{path}[{k!r}]")
            if found:
                return found
        return None
    names: dict[str, Any] = {"_MISSING": _MISSING, "_NUM": _NUM}
    if eval(_expr(hint, "value", 0, names), names, {"value": value}):  # our own source, as above
        return None
    return f"{path} is not a {_name(hint)}: {value!r:.80}"


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint)
