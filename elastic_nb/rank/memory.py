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

import sys
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from elastic_nb.common.protocol import CudaMemory

__all__ = ["cuda_memory", "largest", "record_history", "snapshot_at_oom"]

# Allocations and frees the history keeps (each a few KB with its stack): the newest ones.
MAX_ENTRIES = 100_000
TOP = 8  # the largest groups a report names
STACK_FRAMES = 8  # of the stack a group shows

_recording = False


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
    if _recording:  # still wanted when CUDA came up
        sys.modules["torch"].cuda.memory._record_memory_history(
            "all", context="alloc", stacks="python", max_entries=MAX_ENTRIES
        )


def snapshot_at_oom(path: Path, cell: Path) -> dict[str, Any] | None:
    """At a CUDA OOM, with --memory-history on: the snapshot in `path` (for
    pytorch.org/memory_viz) and the largest live allocations by what made them."""
    torch = sys.modules.get("torch")
    if not _recording or torch is None or not torch.cuda.is_initialized():
        return None
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._dump_snapshot(str(path))
    return {"snapshot": str(path), "largest": largest(snapshot, cell)}


def largest(snapshot: dict[str, Any], cell: Path, top: int = TOP) -> list[dict[str, Any]]:
    """The live allocations of a snapshot, grouped by the cell line that made them: the
    innermost frame in a cell (the user's own line nearest the allocation: `out = model(x)` in
    the loop, not the layer inside the model; a session's earlier cell counts, named by its
    job), else the innermost Python frame. The largest groups first, each with its bytes, its
    blocks, where (`line`, and `job` for an earlier cell's line), what the line says (`what`)
    and the stack of its largest block."""
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
    ranked = sorted(groups.values(), key=lambda g: -g["bytes"])[:top]
    for g in ranked:
        del g["_largest"]
    return ranked


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
