"""What the supervisor knows of one rank in one attempt (`RankState`), and what it means: how
the rank ended (`kind`: done, an exception, a CUDA OOM, a collective timeout, a dead peer, a
signal, ...), the few words of its chip, and its failure in words. The record is filled in from
the rank's own records (its failure or done record), its site (when it was seen gone, its exit
code) and its logs (NCCL's watchdog line).
"""

from __future__ import annotations

import re
import signal
from dataclasses import dataclass
from typing import Any

from elastic_nb.common.report import describe_exit, signal_name, size
from elastic_nb.protocol.rank_probes import TIMED_OUT

__all__ = [
    "NCCL_TIMEOUT_MARKS",
    "TORCH_LOG_NOISE",
    "RankState",
    "watchdog_op",
    "watchdog_summary",
]

# What a rank raises when another rank of its group died under it (gloo and NCCL wordings).
_PEER_DIED = re.compile(
    r"connection closed by peer|connection reset by peer|remote process exited"
    r"|communicator was aborted|NCCL.*(?:aborted|remote)"
    r"|failed to recv|got 0 bytes|DistNetworkError",
    re.IGNORECASE,
)
# Words any socket error has: a peer's death only in torch's communication layer (gloo's
# transport, c10d's store), not in a rank's own code (an HTTP download refused is its failure).
_SOCKET_GONE = re.compile(r"broken pipe|connection refused", re.IGNORECASE)
_TORCH_COMM = re.compile(r"gloo|c10d|TCPStore|ProcessGroup|nccl", re.IGNORECASE)
# NCCL's watchdog announcing that a collective of *this* rank timed out (ProcessGroupNCCL.cpp,
# Watchdog::runLoop and the heartbeat monitor). With TORCH_NCCL_ASYNC_ERROR_HANDLING=1 it then
# waits for the flight recorder's dump (60 s by default) and aborts: no exception reaches the
# cell, no failure record is written, and the rank ends in SIGABRT like every other rank.
# ("failure detected by watchdog at work sequence id" is not one: NCCL logs it for any failed
# work, a dead peer's included.)
NCCL_TIMEOUT_MARKS = (
    b"Watchdog caught collective operation timeout",
    b"Received a dump signal due to a collective timeout from this local rank",
)
# Lines torch's C++ logging writes by itself (glog style, "[rank0]:[E1123 ...] ProcessGroupNCCL
# .cpp:632] ..."), and NCCL's own: they are not the cell's output, so not a sign of progress.
TORCH_LOG_NOISE = (b"ProcessGroupNCCL", b"NCCL WARN", b"NCCL INFO", b"c10d::DistBackendError")
_WATCHDOG = re.compile(
    r"SeqNum=(?P<seq>\d+), OpType=(?P<op>\w+).*?ran for (?P<ms>\d+) milliseconds"
)
_TIMEOUT_MS = re.compile(r"Timeout\(ms\)=(\d+)")


@dataclass
class RankState:
    """What the supervisor knows of one rank in one attempt."""

    attempt: int
    rank: int
    pid: int | None = None
    started_at: float | None = None
    done: dict[str, Any] | None = None  # the worker's done record
    failure: dict[str, Any] | None = None  # the worker's failure record
    died_at: float | None = None  # our clock, when its site saw it go (ordered with ranks' stamps)
    gone_at: float | None = None  # the same moment on the monotonic clock, for intervals
    exit_code: int | None = None  # N, or -SIG
    oom_killed: bool = False  # the kernel's OOM killer fired while it died
    rss_peak: int | None = None  # the most host memory it was seen holding (sampled each second)
    armed: bool = False  # its stack dump handler is registered: it runs our bootstrap
    watchdog: dict[str, Any] | None = None  # NCCL's watchdog said it timed out: {time, line}
    blame: str | None = None  # what a desync verdict found it did ("left the cell early")
    where: str | None = None  # a multi-node job's: its node, "node 1 (gpu-b)"
    lost: str | None = None  # its node left with it: "node 1 (gpu-b) left: connection lost"
    killed: bool = False  # elastic_nb sent it SIGKILL (a session ends stuck ranks so, at once)
    # How soon after the teardown began a death by SIGKILL is still the rank's own: no one who
    # stops a group sends SIGKILL sooner (RankBook.kill_window).
    kill_window: float = 0.0

    @property
    def name(self) -> str:
        """How reports name it: 'rank 3', or 'node 1 (gpu-b) rank 3' across machines."""
        return f"{self.where} rank {self.rank}" if self.where else f"rank {self.rank}"

    @property
    def failed_at(self) -> float | None:
        if self.failure:
            return float(self.failure["time"])
        return float(self.watchdog["time"]) if self.watchdog else self.died_at

    def kind(self, teardown_at: float | None) -> str:
        """done | running | exception | oom | collective_timeout | peer | terminated | exit |
        exit0 | signal | host_oom | lost (its node left)"""
        if self.done is not None:
            return "done"
        if self.failure is not None:
            if self.failure["type"] == "KeyboardInterrupt":
                return "terminated"  # torch gives ranks PDEATHSIG=SIGINT
            if self.failure["type"] == "SystemExit":
                return "exit"  # sys.exit(N), exit(N): the cell chose to end the rank
            if self.failure["type"].endswith("OutOfMemoryError"):
                return "oom"
            if TIMED_OUT.search(self.failure["message"]):
                return "collective_timeout"
            message = self.failure["message"]
            if _PEER_DIED.search(message) or (
                _SOCKET_GONE.search(message)
                and (_TORCH_COMM.search(message) or self.failure["type"].startswith("torch."))
            ):
                return "peer"
            return "exception"
        if self.watchdog is not None:
            return "collective_timeout"  # whatever signal NCCL's abort then ends it with
        if self.lost is not None:
            if teardown_at is not None and self.died_at is not None and self.died_at >= teardown_at:
                return "terminated"  # its machine was lost once the stop was under way
            return "lost"
        if self.died_at is None:
            return "running"
        if (
            teardown_at is not None
            and self.died_at >= teardown_at
            and not self._own_end(teardown_at)
        ):
            return "terminated"
        if self.exit_code == 0:
            return "exit0"
        if self.exit_code is None or self.exit_code > 0:
            return "exit"
        if self.oom_killed and self.exit_code == -signal.SIGKILL:
            return "host_oom"
        if self.exit_code == -signal.SIGINT:
            # Nobody sends a rank SIGINT but torch, as its parent-death signal: the rank went
            # because its launcher (or fork server) did.
            return "terminated"
        return "signal"

    def _own_end(self, teardown_at: float) -> bool:
        """An end no one stopping the group had caused yet, seen only after a peer's error
        began the teardown (a loaded machine reaps and reads late): a SIGKILL no one had sent
        (the cell's own), or an exit(0) before the cell's end (a stop ends a rank by a signal,
        or by an error of a torn-down store: never with 0)."""
        own = self.exit_code == 0 or (self.exit_code == -signal.SIGKILL and not self.killed)
        return own and self.died_at is not None and self.died_at < teardown_at + self.kill_window

    def failure_summary(self) -> str:
        if self.failure:
            text = f"{self.failure['type']}: {self.failure['message']}".rstrip(": ")
            if self.failure.get("cell_line"):
                text += f" (cell line {self.failure['cell_line']})"
            return text
        if self.watchdog is not None:
            return watchdog_summary(self.watchdog["line"])
        if self.lost is not None:
            return f"was lost: {self.lost}"
        if self.exit_code == 0 and self.died_at is not None and self.done is None:
            return "exited with code 0 before finishing the cell (os._exit?)"
        if self.oom_killed and self.exit_code == -signal.SIGKILL:
            peak = f"; it peaked at {size(self.rss_peak)} resident" if self.rss_peak else ""
            return f"killed by SIGKILL from the kernel's OOM killer (host memory{peak})"
        return describe_exit(self.exit_code)

    def label(self, teardown_at: float | None) -> str:
        """A few words for a rank's chip: running, exited 0, ValueError, killed by SIGKILL."""
        kind = self.kind(teardown_at)
        if kind in ("done", "running"):
            return "exited 0" if kind == "done" and self.died_at is not None else "running"
        if self.failure is not None:
            return str(self.failure["type"]).rsplit(".", 1)[-1]
        if self.watchdog is not None:
            return "collective timeout (NCCL)"
        if self.lost is not None:
            return "lost with its node"
        if kind == "exit0":
            return "exited 0 early"
        if self.exit_code is not None and self.exit_code < 0:
            return f"killed by {signal_name(-self.exit_code)}"
        return f"exit code {self.exit_code}" if self.exit_code is not None else "exited"

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "attempt": self.attempt,
            "pid": self.pid,
            "exit_code": self.exit_code,
            "died_at": self.died_at,
            "done": self.done is not None,
            "failure": self.failure,
        }


def watchdog_op(line: str) -> str | None:
    """The collective a watchdog line names: 'ALLREDUCE #7'."""
    m = _WATCHDOG.search(line)
    return f"{m['op']} #{m['seq']}" if m else None


def watchdog_summary(line: str) -> str:
    """'NCCL's watchdog: ALLREDUCE #7 timed out after 5002 ms (Timeout(ms)=5000)'."""
    m = _WATCHDOG.search(line)
    if m is None:
        return f"NCCL's watchdog: {line.split('] ')[-1].strip()}"
    t = _TIMEOUT_MS.search(line)
    limit = f" (Timeout(ms)={t[1]})" if t else ""
    return f"NCCL's watchdog: {watchdog_op(line)} timed out after {m['ms']} ms{limit}"
