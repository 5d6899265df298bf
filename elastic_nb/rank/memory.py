"""A rank's CUDA memory, as its allocator sees it: the figures a probe asks for once a second
(nothing is asked where CUDA is not initialised: this never initialises it), and, with
--memory-history, torch's record of every allocation (from CUDA's first use in the rank) whose
snapshot at a CUDA OOM says what filled the device, grouped by the cell line that allocated it.

torch's snapshot (torch/cuda/memory.py, _snapshot; torch/cuda/_memory_viz.py reads it the same
way): ``segments[].blocks[]``, each block with its ``state`` ("active_allocated" for live
memory), ``requested_size`` (or ``size``) and, with history on, the Python ``frames`` that
allocated it (innermost first: filename, line, name). Imported in every rank before torch: torch
is read only if the cell loaded it.
"""

from __future__ import annotations

import pickle
import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from elastic_nb.protocol.records import CudaMemory

__all__ = ["calls_of", "cuda_memory", "largest", "record_history", "snapshot_at_oom"]

# Allocations and frees the history keeps (each a few KB with its stack): the newest ones.
MAX_ENTRIES = 100_000
TOP = 8  # the largest groups a report names
STACK_FRAMES = 8  # of the stack a group shows

_recording = False
_start_failed: str | None = None  # why torch's recording did not start, if it did not


def cuda_memory() -> CudaMemory | None:
    """The allocator's figures on the rank's current device; None where CUDA is not in use."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return None
    device = torch.cuda.current_device()
    stats = torch.cuda.memory_stats(device)
    return CudaMemory(
        device=device,
        allocated=int(stats.get("allocated_bytes.all.current", 0)),
        reserved=int(stats.get("reserved_bytes.all.current", 0)),
        peak=int(stats.get("allocated_bytes.all.peak", 0)),
        total=int(torch.cuda.get_device_properties(device).total_memory),
    )


def record_history(on: bool) -> None:
    """--memory-history: record every allocation's Python stack (from CUDA's first use on), or
    stop recording (a session's later cell without the flag). Started on torch's lazy CUDA
    initialisation where CUDA is not in use yet: starting it at once would create a CUDA context
    on the default device before the cell picks its own (every rank's context on GPU 0)."""
    global _recording
    if on == _recording:
        return
    _recording = on
    if not on and "torch" not in sys.modules:
        return
    import torch

    if on:
        torch.cuda._lazy_call(_start)
    elif torch.cuda.is_initialized():
        torch.cuda.memory._record_memory_history(None)


def _start() -> None:
    """Run by torch's lazy CUDA initialisation: an error here would fail CUDA's start in the
    cell, so it is kept for the OOM report instead."""
    global _start_failed
    if not _recording:  # no longer wanted when CUDA came up
        return
    try:
        sys.modules["torch"].cuda.memory._record_memory_history(
            "all", context="alloc", stacks="python", max_entries=MAX_ENTRIES
        )
        _start_failed = None
    except Exception as e:
        _start_failed = f"torch.cuda.memory._record_memory_history raised {e!r}"


def snapshot_at_oom(path: Path, cell: Path) -> dict[str, Any] | None:
    """At a CUDA OOM, with --memory-history on: the snapshot in `path` (for
    pytorch.org/memory_viz) and the largest live allocations by what made them. None without
    the flag (the report says how to turn it on); with it, what failed as ``failed`` (the
    report says that instead), never an exception: the OOM's own report comes first.

    The snapshot is taken once and written as torch's `_dump_snapshot` writes it (a pickle of
    `_snapshot()`): at an OOM, a second walk of every block of the allocator would double the
    time the rank takes to report, and the file and the report must tell of the same moment."""
    torch = sys.modules.get("torch")
    if not _recording or torch is None or not torch.cuda.is_initialized():
        return None
    if _start_failed is not None:
        return {"snapshot": None, "largest": None, "failed": _start_failed}
    try:
        snapshot = torch.cuda.memory._snapshot()
    except Exception as e:
        return {
            "snapshot": None,
            "largest": None,
            "failed": f"torch.cuda.memory._snapshot() raised {e!r}",
        }
    out: dict[str, Any] = {"snapshot": None, "largest": None}
    failed = []
    try:
        out["largest"] = largest(snapshot, cell)
    except Exception as e:  # a snapshot in a shape we do not know: the file still helps
        failed.append(f"reading torch's snapshot failed: {e!r}")
    try:
        with open(path, "wb") as f:
            pickle.dump(snapshot, f)
        out["snapshot"] = str(path)
    except Exception as e:
        failed.append(f"writing the snapshot to {path} failed: {e!r}")
    if failed:
        out["failed"] = "; ".join(failed)
    return out


def largest(snapshot: dict[str, Any], cell: Path, top: int = TOP) -> list[dict[str, Any]]:
    """The live allocations of a snapshot, grouped by the cell line that made them: the
    innermost frame in a cell (the user's own line nearest the allocation: `out = model(x)` in
    the loop, not the layer inside the model; a session's earlier cell counts, named by its
    job), else the innermost Python frame. The largest groups first, each with its bytes, its
    blocks, where (`line`, and `job` for an earlier cell's line), what the line says (`what`)
    and the stack of its largest block: `stack`, its innermost frames as torch lists them, and
    `calls`, the same as the report shows it (`calls_of`)."""
    sources: dict[str, list[str]] = {}
    groups: dict[tuple[str | None, int | None, str], dict[str, Any]] = {}
    for block in _live_blocks(snapshot.get("segments") or ()):
        frames = _frames(block)
        size = int(block.get("requested_size") or block.get("size") or 0)
        in_cells = [f for f in frames if _is_cell(str(f.get("filename")), cell)]
        key: tuple[str | None, int | None, str]
        if in_cells:
            filename, line = str(in_cells[0]["filename"]), int(in_cells[0]["line"])
            job = None if filename == str(cell) else Path(filename).parent.name
            key = (job, line, _line_text(sources, filename, line))
        elif frames:
            key = (None, None, _frame(frames[0]))
        else:
            key = (None, None, "no stack recorded (allocated before --memory-history was on)")
        g = groups.setdefault(
            key, {"bytes": 0, "blocks": 0, "job": key[0], "line": key[1], "what": key[2]}
        )
        g["bytes"] += size
        g["blocks"] += 1
        if size > g.get("_largest", -1):
            g["_largest"] = size
            g["stack"] = [_frame(f) for f in frames[:STACK_FRAMES]]
            g["calls"] = calls_of(frames, cell)
    ranked = sorted(groups.values(), key=lambda g: -g["bytes"])[:top]
    for g in ranked:
        del g["_largest"]
    return ranked


def calls_of(frames: list[dict[str, Any]], cell: Path) -> list[dict[str, Any]]:
    """An allocation's stack as the report shows it: in call order, from the outermost frame in
    a cell (the frames above it are elastic_nb's own, running the cell) down to the allocation;
    at most STACK_FRAMES frames, the cells' first (up to half of them, the outermost), then the
    innermost, a gap said as ``{"skipped": n}``. A cell's frame is ``{"job", "line"}`` (`job`
    None for this cell), any other ``{"where": "linear.py:125 in forward"}``."""
    in_cell = [i for i, f in enumerate(frames) if _is_cell(str(f.get("filename")), cell)]
    path = list(reversed(frames[: in_cell[-1] + 1] if in_cell else frames))
    cells = [i for i, f in enumerate(path) if _is_cell(str(f.get("filename")), cell)]
    keep = set(cells[: STACK_FRAMES // 2])
    for i in range(len(path) - 1, -1, -1):  # then the innermost, up to the bound
        if len(keep) >= STACK_FRAMES:
            break
        keep.add(i)
    out: list[dict[str, Any]] = []
    last = -1
    for i in sorted(keep):
        if i > last + 1:
            out.append({"skipped": i - last - 1})
        f = path[i]
        filename = str(f.get("filename"))
        if _is_cell(filename, cell):
            job = None if filename == str(cell) else Path(filename).parent.name
            out.append({"job": job, "line": f.get("line")})
        else:
            out.append({"where": _frame(f)})
        last = i
    return out


def _live_blocks(segments: Iterable[dict[str, Any]]) -> Iterable[dict[str, Any]]:
    for segment in segments:
        for block in segment.get("blocks") or ():
            if block.get("state") == "active_allocated":
                yield block


def _frames(block: dict[str, Any]) -> list[dict[str, Any]]:
    """A block's allocation stack, innermost first (older snapshots kept it in its history)."""
    if "frames" in block:
        return list(block["frames"] or [])
    history = block.get("history") or [{}]
    return list(history[0].get("frames") or [])


def _is_cell(filename: str, cell: Path) -> bool:
    """The cell, or an earlier cell of its session (a sibling run directory's cell.py)."""
    return filename == str(cell) or (
        filename.endswith("/" + cell.name) and Path(filename).parent.parent == cell.parent.parent
    )


def _line_text(sources: dict[str, list[str]], filename: str, line: int) -> str:
    if filename not in sources:
        try:
            sources[filename] = Path(filename).read_text().splitlines()
        except OSError:
            sources[filename] = []
    lines = sources[filename]
    return lines[line - 1].strip() if 0 < line <= len(lines) else "?"


def _frame(f: dict[str, Any]) -> str:
    return f"{Path(str(f.get('filename'))).name}:{f.get('line')} in {f.get('name')}"
