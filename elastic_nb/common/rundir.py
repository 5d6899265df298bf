"""The run directory: one per job, the record a user attaches to a bug report.

Its layout is defined here and nowhere else::

    <log-dir>/<job-id>/
        spec.json                 the JobSpec
        cell.py                   the cell, line for line (the magic line kept as a comment)
        cell.json                 how to run it: last-expression display, shipped names, pulls
        payload.pkl               pushed and shipped objects (cloudpickle)
        launcher.log              the launcher's own output (torchelastic's logging)
        events.jsonl              every event the supervisor saw, one JSON object a line
        summary.json              the outcome, written when the job ends
        checkpoints.jsonl         each checkpoint rank 0 saved or loaded (elastic_nb.checkpoint)
        attempt-<K>/              one per attempt; a restart never deletes an earlier one
            rank-<R>.out|err      the rank's stdout/stderr, captured at the fd level
            rank-<R>.failure.json what the rank raised, with our own sub-second clock
            rank-<R>.done.json    the rank finished the cell
            rank-<R>.torch-error.json   torchelastic's own error file
            rank-0.result.pkl     the value of the cell's last expression (rank 0)
            rank-<R>.pull.pkl     the --pull objects (from --pull-rank)
            rank-<R>.stacks       every thread's Python stack, appended on each dump request
            rank-<R>.collectives.json   the rank's collectives (flight recorder), at its end
            rank-<R>.group.json   the rank made its first process group (a collective can time out)
            rank-<R>.probe        a FIFO: the supervisor asks the live rank for its collectives
            rank-<R>.probe.json   the rank's answer, the latest one
            rank-<R>.input.json   what the rank's input() (pdb's prompt, a cell's input()) asks,
                                  the latest ask
            fr-rank-<R>           NCCL's flight-recorder dump on a collective timeout
            rank-<R>.memory.pickle    the CUDA allocator's snapshot at an OOM (--memory-history)
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import stat
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

__all__ = ["ATTEMPT_BASE_ENV", "CHECKPOINTS", "RUN_DIR_ENV", "RunDir", "attempt_of", "cache_home"]

RUN_DIR_ENV = "ELASTIC_NB_RUN_DIR"  # every rank's: its job's (or session's) run directory
# A multi-node job's round starts at this attempt (each round is an elastic_launch of its own,
# whose restart count starts at 0); unset for a single-node job, whose restarts are torch's.
ATTEMPT_BASE_ENV = "ELASTIC_NB_ATTEMPT_BASE"
CHECKPOINTS = "checkpoints.jsonl"
MAX_RECORD = 64 << 20  # bytes of a JSON record (a failure with its traceback is kilobytes)

_ATTEMPT = re.compile(r"attempt-(\d+)\Z")


def cache_home() -> Path:
    """elastic_nb's folder in the user's cache directory: run directories (runs/) and a join
    agent's work (agent/) live under it unless told otherwise."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "elastic_nb"


class _RankFile:
    """A rank's file in an attempt's folder (`rd.failure(attempt, rank)`: its path)."""

    def __init__(self, suffix: str) -> None:
        self.suffix = suffix

    def __get__(self, rd: RunDir, owner: type[RunDir]) -> Callable[[int, int], Path]:
        def path(attempt: int, rank: int) -> Path:
            return rd.attempt(attempt) / f"rank-{rank}.{self.suffix}"

        return path


class RunDir:
    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        # job-level files
        self.spec = self.path / "spec.json"
        self.checkpoints = self.path / CHECKPOINTS
        self.cell = self.path / "cell.py"
        self.cell_meta = self.path / "cell.json"
        self.payload = self.path / "payload.pkl"
        self.launcher_log = self.path / "launcher.log"
        self.events = self.path / "events.jsonl"
        self.summary = self.path / "summary.json"

    @classmethod
    def of(cls, log_dir: str, job_id: str) -> RunDir:
        """The run directory of a job: <log-dir>/<job-id>."""
        return cls(Path(log_dir) / job_id)

    def __repr__(self) -> str:
        return f"RunDir({str(self.path)!r})"

    def __str__(self) -> str:
        return str(self.path)

    # per-attempt files
    def attempt(self, attempt: int) -> Path:
        return self.path / f"attempt-{attempt}"

    def attempts(self) -> list[int]:
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return []
        return sorted(int(m.group(1)) for n in names if (m := _ATTEMPT.match(n)))

    def log(self, attempt: int, rank: int, stream: str) -> Path:
        if stream not in ("out", "err"):
            raise ValueError(f"stream must be 'out' or 'err', not {stream!r}")
        return self.attempt(attempt) / f"rank-{rank}.{stream}"

    failure = _RankFile("failure.json")
    done = _RankFile("done.json")
    torch_error = _RankFile("torch-error.json")
    pulled = _RankFile("pull.pkl")
    stacks = _RankFile("stacks")
    collectives = _RankFile("collectives.json")
    # Written when the rank makes its first process group: from then a collective can time out.
    process_group = _RankFile("group.json")
    probe = _RankFile("probe")
    probe_answer = _RankFile("probe.json")
    input_asked = _RankFile("input.json")
    # torch's CUDA memory snapshot at an OOM (--memory-history): pytorch.org/memory_viz.
    memory_snapshot = _RankFile("memory.pickle")

    def result(self, attempt: int) -> Path:
        return self.attempt(attempt) / "rank-0.result.pkl"

    def flight_recorder(self, attempt: int, rank: int) -> Path:
        """What NCCL dumps there on a collective timeout (pickled, torch's format)."""
        return self.flight_recorder_prefix(attempt).with_name(f"fr-rank-{rank}")

    def make(self) -> None:
        """The directory, new, and every missing directory above it, each the owner's alone.
        (Path.mkdir(parents=True) makes the parents with the default mode, whatever `mode`
        says: 0755 under the usual umask, where every local user could list the jobs.)"""
        missing = []
        d = self.path.parent
        while not d.exists():
            missing.append(d)
            d = d.parent
        for d in reversed(missing):
            with contextlib.suppress(FileExistsError):  # made meanwhile by another job
                d.mkdir(mode=0o700)
        self.path.mkdir(mode=0o700)

    def create(
        self, spec_json: str, source: str, meta: dict[str, Any], payload: bytes | None
    ) -> None:
        """A new job's (or session cell's) directory, owner only (logs, the environment), with
        what its ranks read: the spec, the cell, how to run it, the pushed objects."""
        self.make()
        self.spec.write_text(spec_json)
        self.cell.write_text(source)
        write_json(self.cell_meta, meta)
        if payload:
            write_atomic(self.payload, payload)

    def read_private(self, path: Path) -> bytes:
        """A file of this run directory that is about to be unpickled (unpickling runs code):
        refused unless it, and every directory from it up to this one, is the user's own and
        writable by nobody else (a --log-dir in a shared place must not let others plant it)."""
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        with os.fdopen(fd, "rb") as f:
            _check_private(os.fstat(f.fileno()), path)
            d = path.parent
            while True:
                _check_private(os.stat(d), d)
                if d == self.path or d == d.parent:
                    break
                d = d.parent
            return f.read()

    def flight_recorder_prefix(self, attempt: int) -> Path:
        """TORCH_FR_DUMP_TEMP_FILE: NCCL appends the rank to this prefix."""
        return self.attempt(attempt) / "fr-rank-"


def attempt_of(env: Mapping[str, str]) -> int:
    """A rank's attempt, from its environment: torch's restart count within its round, past the
    round's first attempt (the launcher's environment, which a rank's inherits: torch gives the
    launcher only its own variables of a rank's)."""
    base = env.get(ATTEMPT_BASE_ENV) or os.environ.get(ATTEMPT_BASE_ENV) or 0
    return int(env.get("TORCHELASTIC_RESTART_COUNT") or 0) + int(base)


def _check_private(st: os.stat_result, path: Path) -> None:
    if st.st_uid != os.getuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise PermissionError(
            f"{path} is not this user's own or others may write to it: elastic_nb will not load "
            "objects from it (a shared --log-dir needs a directory of your own inside it)"
        )


def write_atomic(path: Path, data: bytes) -> None:
    """Readers poll these files: never let one see half a record."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def write_json(path: Path, obj: Any) -> None:
    write_atomic(path, json.dumps(obj, indent=1, default=str).encode())


def read_json(path: Path) -> Any | None:
    """A record (None: not there, or larger than any record of ours: MAX_RECORD, which a node's
    forged one could be, read on the supervisor's event loop)."""
    try:
        with open(path, "rb") as f:
            data = f.read(MAX_RECORD + 1)
    except FileNotFoundError:
        return None
    return json.loads(data) if len(data) <= MAX_RECORD else None
