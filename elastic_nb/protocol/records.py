"""The records inside messages: an update's alerts, rank chips, log batches, rounds and memory
samples, the end's summary. One definition for the supervisor that writes them and the handle,
the text renderer and the dashboard that read them (checked as deep as their types go)."""

from __future__ import annotations

import typing
from typing import Any, TypedDict

__all__ = [
    "Alert",
    "Chip",
    "CudaMemory",
    "GpuShare",
    "Leftover",
    "LogBatch",
    "MemoryPeak",
    "MemorySample",
    "NodeInfo",
    "Replied",
    "Round",
    "Summary",
    "Survivor",
    "Waiting",
    "summary",
]


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

    # running, paused (at a prompt: pdb's, an input()), waiting (in a collective, for a paused
    # rank), done, failed, stopped, zombie
    state: str
    label: str  # a few words: "exited 0", "ValueError", "left the cell early"
    attempt: int
    pid: int | None
    detail: str  # the whole story, for a failed or stopped rank
    node: str  # a multi-node job's: where the rank runs, "node 1 (gpu-b)"
    expires: float  # waiting for a paused rank: when its collective's timeout runs out (clock)


class Waiting(TypedDict):
    """A rank waiting in a collective for a rank at a prompt: when its timeout runs out."""

    rank: int
    op: str  # "all_reduce #4"
    expires: float | None  # the supervisor's wall clock (the kernel's machine); None: unknown


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
    leftovers: list[Leftover]  # processes the cell left running
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


class _Leftover(TypedDict):
    pid: int
    cmd: str  # its command line, cut at 80 characters ("?" if it could not be read)


class Leftover(_Leftover, total=False):
    """A process a cell left running after it succeeded."""

    node: str  # the machine's label, where it is another machine


class Survivor(TypedDict):
    """A process of a group still alive after SIGKILL (in D state, most often)."""

    pid: int
    state: str  # what its state means, or "gone"


class _Replied(TypedDict):
    req: int | None  # the request's number (None: a request whose number could not be read)
    ok: bool
    data: dict[str, Any]  # of the type the channel's table names for the request's kind


class Replied(_Replied, total=False):
    """A reply's envelope, on each channel with requests (its own kind added): ok and the
    request's data, or not ok and why."""

    error: str
