"""The protocol between elastic_nb's processes: one module, one framing, one version.

Two channels speak it:

* kernel <-> supervisor, over a Unix socket in an owner-only directory;
* launcher -> supervisor, over a pipe (the launcher's stdout, set aside before torch loads).

A frame is one line of compact JSON (an object with a ``"kind"``), optionally followed by a raw
binary blob whose length the header gives as ``"blob"``: pushed objects travel that way, without
base64. Every message of the kernel channel is checked against `VERSION` at the handshake.

Kernel -> supervisor                      Supervisor -> kernel
  hello {version, kernel_pid}               hello {version, pid}
  submit {req, spec, cell} + blob           reply {req, ok, ...}   (to every request)
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
  result {ok, error?}                       elastic_launch returned or raised

The records inside those messages (an update's alerts, rank chips and log batches, the end's
summary) are the TypedDicts below: one definition for the supervisor that writes them and the
handle, the text renderer and the dashboard that read them.

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
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from typing import Any, TypedDict

__all__ = [
    "VERSION",
    "Alert",
    "Chip",
    "FrameDecoder",
    "LogBatch",
    "ProtocolError",
    "Summary",
    "encode",
    "summary",
]

VERSION = 3  # 2: log batches are records; 3: sessions

# kernel -> supervisor
HELLO = "hello"
ROLE_KERNEL = "kernel"  # hello's role: the kernel's lifeline
ROLE_PANEL = "panel"  # hello's role: the server extension, a request at a time
SUBMIT = "submit"
STOP = "stop"
JOBS = "jobs"
STATUS = "status"
STACKS = "stacks"
WARM = "warm"
UP = "up"
DOWN = "down"
SESSION = "session"
# the JupyterLab panel (the server extension) -> supervisor; any other request above works too
OVERVIEW = "overview"  # every job, session and session cell, as the panel lists them
EVENTS = "events"  # what a job's renderer was sent, since a sequence number
# supervisor -> kernel
REPLY = "reply"
UPDATE = "update"
END = "end"
# launcher -> supervisor
READY = "ready"
RENDEZVOUS = "rendezvous"
START = "start"
EXIT = "exit"
EXITS = "exits"
TICK = "tick"
RESULT = "result"
# supervisor <-> a session's ranks
RANK_HELLO = "rank_hello"
RUN = "run"
RAN = "ran"
INTERRUPT = "interrupt"
BYE = "bye"
# Where a session's ranks find its socket (set in their environment by the supervisor).
SESSION_SOCKET_ENV = "ELASTIC_NB_SESSION_SOCKET"

# The launcher reports its agent's monitor loop at most this often; the zombie watchdog's bound
# is built on it.
TICK_EVERY_S = 0.25

# The supervisor asks a rank for every thread's Python stack with this signal; the worker's
# faulthandler answers into the rank's .stacks file (no GIL needed: it works mid-collective).
STACK_SIGNAL = signal.SIGUSR1
# The .stacks file's first line: how every dump in it ends (the main thread, the oldest, is
# dumped last, and its outermost frame stays put), so that a dump is read whole, not as written.
STACKS_END_MARK = "# elastic_nb: each dump below ends with: "

# What a probe asks a rank's flight recorder for (elastic_nb/recorder.py answers).
PROBE_STATUS = "status"
PROBE_FULL = "full"

# A header line longer than this is a corrupt stream, not a message.
_MAX_HEADER = 16 * 1024 * 1024
_MAX_BLOB = 1 << 40

Message = dict[str, Any]


class ProtocolError(RuntimeError):
    """The other side sent something that is not a frame of this protocol."""


def encode(kind: str, blob: bytes | None = None, **fields: Any) -> bytes:
    header: Message = {"kind": kind, **fields}
    if blob is not None:
        header["blob"] = len(blob)
    line = json.dumps(header, separators=(",", ":"), default=str).encode() + b"\n"
    return line + blob if blob else line


class FrameDecoder:
    """Incremental decoder: feed bytes as they arrive, iterate complete (message, blob) pairs."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pending: Message | None = None  # header waiting for its blob

    def feed(self, data: bytes) -> Iterator[tuple[Message, bytes | None]]:
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
            except ValueError as e:
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


def check_hello(msg: Message) -> None:
    if msg.get("kind") != HELLO:
        raise ProtocolError(f"expected hello, got {msg.get('kind')!r}")
    if msg.get("version") != VERSION:
        raise ProtocolError(
            f"protocol version {msg.get('version')} on the other side, {VERSION} here: "
            "restart the kernel after upgrading elastic_nb"
        )


# ---- records --------------------------------------------------------------------------------


class Alert(TypedDict):
    kind: str  # failure, oom, desync, collective_timeout, hang, zombie, restart, stacks, ...
    severity: str  # error, warning, info
    title: str
    rank: int | None  # the rank it is about, if one
    text: str | None  # the detail: stacks, a traceback, a memory report
    time: float


class Chip(TypedDict, total=False):
    """One rank of the current attempt, as a dashboard shows it."""

    state: str  # running, done, failed, stopped, zombie
    label: str  # a few words: "exited 0", "ValueError", "left the cell after 7 collectives"
    attempt: int
    pid: int | None
    detail: str  # the whole story, for a failed or stopped rank


class LogBatch(TypedDict):
    """New output of one rank's stream since the last update."""

    attempt: int
    rank: int
    stream: str  # out, err
    lines: list[str]  # whole lines, at most a bounded number per update
    skipped: int  # lines left out of this update (the log file has them)
    progress: str | None  # the latest state of a \r progress bar, if one is being drawn


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
    }
    unknown = set(known) - set(s)
    if unknown:
        raise TypeError(f"not summary keys: {sorted(unknown)}")
    s.update(known)
    return Summary(**s)  # type: ignore[typeddict-item]
