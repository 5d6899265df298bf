"""What a rank leaves in the run directory when a cell ends: its failure record (stamped with
our own sub-second clock, the cell's line, a hint, a CUDA OOM's memory figures), rank 0's result
and the --pull objects. Imported in every rank before torch: keep it light."""

from __future__ import annotations

import os
import re
import socket
import sys
import time
import traceback
from pathlib import Path
from typing import Any

from elastic_nb.common import pickling
from elastic_nb.common.rundir import RunDir, write_atomic, write_json
from elastic_nb.rank import memory

__all__ = ["dump", "dump_result", "record_failure"]


def record_failure(
    rd: RunDir,
    attempt: int,
    rank: int,
    exc: BaseException,
    phase: str,
    meta: dict[str, Any],
    at: float | None = None,
) -> None:
    """Stamp the failure with our clock (torch's error file has whole seconds; `at`: when it
    was raised, if that was not now) and say where."""
    now = time.time() if at is None else at
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename.startswith(_PACKAGE):
        tb = tb.tb_next  # our own frames (this bootstrap, a session's loop) are noise to the user
    _drop_own_innermost(tb)  # a session's interrupt is raised in our signal handler
    frames = traceback.extract_tb(tb)
    cell_frames = [f for f in frames if f.filename == str(rd.cell)]
    where = cell_frames[-1] if cell_frames else None
    hint = _name_hint(exc, meta)
    text = "".join(traceback.format_exception(type(exc), exc, tb))
    if hint:
        text += f"hint: {hint}\n"
    record = {
        "rank": rank,
        "attempt": attempt,
        "pid": os.getpid(),
        "host": socket.gethostname(),  # the pid is of its machine's
        "time": now,
        "phase": phase,
        "type": _type_name(type(exc)),
        "message": str(exc),
        "hint": hint,
        "cell_line": where.lineno if where else None,
        "line_text": (where.line or "").strip() if where else None,
        "traceback": text,
        "memory": _memory_report(exc, rd, attempt, rank),
    }
    try:
        write_json(rd.failure(attempt, rank), record)
    finally:
        # The rank's stderr log keeps the traceback too, as a script's would.
        sys.stderr.write(text)
        sys.stderr.flush()


_PACKAGE = os.path.dirname(__file__) + os.sep
_REQUESTED = re.compile(r"Tried to allocate ([\d.]+ [KMGT]?i?B)")
_GPU = re.compile(r"\bGPU (\d+)\b")


def _memory_report(
    exc: BaseException, rd: RunDir, attempt: int, rank: int
) -> dict[str, Any] | None:
    """For a CUDA out-of-memory error: what was asked for and what the allocator held, and with
    --memory-history what filled the device (its snapshot, and the largest live allocations by
    the cell line that made them)."""
    if not type(exc).__name__.endswith("OutOfMemoryError"):
        return None
    m = _REQUESTED.search(str(exc))
    report: dict[str, Any] = {"requested": m.group(1) if m else None}
    # The device that ran out is in the message ("GPU 3 has a total capacity of ..."): the
    # rank's current device need not be the one the failed allocation was for.
    gpu = _GPU.search(str(exc))
    report["device"] = int(gpu.group(1)) if gpu else None
    torch = sys.modules.get("torch")
    try:
        if torch is not None and torch.cuda.is_initialized():
            device = report["device"]
            if device is None:
                device = report["device"] = torch.cuda.current_device()
            report["allocated"] = torch.cuda.memory_allocated(device)
            report["reserved"] = torch.cuda.memory_reserved(device)
            report["summary"] = torch.cuda.memory_summary(device, abbreviated=True)
    except Exception as e:
        report["error"] = repr(e)
    # Whatever the figures did: with --memory-history on, the snapshot or what failed.
    history = memory.snapshot_at_oom(rd.memory_snapshot(attempt, rank), rd.cell)
    if history is not None:
        report["history"] = history
    return report


def _name_hint(exc: BaseException, meta: dict[str, Any]) -> str | None:
    name = getattr(exc, "name", None)
    if isinstance(exc, NameError) and name in meta.get("notebook_names", ()):
        return (
            f"{name!r} exists in the notebook, but only modules, functions and classes travel "
            f"to the ranks by themselves: add --push {name} to send its value"
        )
    return None


def _type_name(t: type) -> str:
    return t.__qualname__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def dump(path: Path, obj: Any) -> None:
    write_atomic(path, pickling.dumps(obj))


def dump_result(path: Path, value: Any) -> None:
    """The displayed value travels pickled; one that cannot be pickled travels as its repr."""
    try:
        dump(path, ("value", value))
    except Exception:
        dump(path, ("repr", repr(value)))


def _drop_own_innermost(tb: Any) -> None:
    """Cut the traceback after its last frame that is not ours."""
    last_theirs = None
    while tb is not None:
        if not tb.tb_frame.f_code.co_filename.startswith(_PACKAGE):
            last_theirs = tb
        tb = tb.tb_next
    if last_theirs is not None:
        last_theirs.tb_next = None
