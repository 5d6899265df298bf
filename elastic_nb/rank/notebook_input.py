"""A rank's input() asks the notebook: pdb's prompt (``breakpoint()``, ``pdb.set_trace()``,
``torch.distributed.breakpoint()``: each reads its commands with input()) and a cell's own
input() are shown in the notebook's input box, and the line typed there comes back.

A rank's stdin is not a terminal (torchelastic's workers have none to share), so builtins.input
is replaced: it writes what it asks into the rank's run directory (rank-R.input.json, with how
much the rank had printed by then), and waits for the answer, which the supervisor brings as a
probe (protocol.rank_probes.PROBE_ANSWER) to the rank's probe thread (recorder.py), which hands it
over here. A frontend that takes no input (nbclient, papermill, nbconvert) answers none: the
rank's input() then raises `NoInput`, which fails the cell at once with the rank and its line.

Imported in every rank before torch: nothing of torch, and pdb costs the rank about 2 ms.
"""

from __future__ import annotations

import builtins
import itertools
import os
import pdb
import sys
import threading
import time
from pathlib import Path
from typing import Any

from elastic_nb.common.rundir import write_json
from elastic_nb.protocol.rank_probes import InputAnswer, InputAsked

__all__ = [
    "CellPdb",
    "NoInput",
    "answered",
    "cell_is",
    "debug_last",
    "failed",
    "install",
    "post_mortem",
    "written",
]


class NoInput(RuntimeError):
    """The notebook could not give this rank a line of input (its frontend takes none, or no
    kernel follows the cell), as a plain cell's StdinNotImplementedError says. Not an EOFError:
    pdb reads one as a quit, and the cell would end in a BdbQuit that says nothing of why."""


_asks = itertools.count(1)
_lock = threading.Lock()
_waiting: dict[int, tuple[threading.Event, list[InputAnswer]]] = {}
_where: Path | None = None
_rank: int | None = None
_cell: str | None = None  # the file name the running cell was compiled with
# A session rank's last failure, and its cell's file name: `%elastic debug` opens its frames.
_last: tuple[BaseException, str] | None = None
_post_mortem = False  # the prompts now are a post-mortem's (--pdb): the other ranks are held
_error_line: int | None = None  # a post-mortem's: the cell's line that raised


class CellPdb(pdb.Pdb):
    """pdb as a plain cell shows it: the cell's file is "cell", and the frames below the cell
    (the rank's bootstrap, torchelastic's, multiprocessing's) are left out of `where`, `up`."""

    def get_stack(self, f: Any, t: Any) -> tuple[list[tuple[Any, int]], int]:
        stack, i = super().get_stack(f, t)
        first = next((k for k, (fr, _) in enumerate(stack) if fr.f_code.co_filename == _cell), 0)
        return stack[first:], max(0, i - first)

    def format_stack_entry(self, frame_lineno: tuple[Any, int], lprefix: str = ": ") -> str:
        entry: str = super().format_stack_entry(frame_lineno, lprefix)
        return entry.replace(_cell, "cell", 1) if _cell else entry


def install(asked: Path, rank: int) -> None:
    """Answer this rank's input() from the notebook, its asks written at `asked`; every pdb
    (breakpoint(), pdb.set_trace(), torch.distributed.breakpoint()'s) a `CellPdb`."""
    global _where, _rank
    _where, _rank = asked, rank
    builtins.input = _input
    pdb.Pdb = CellPdb  # type: ignore[misc]  # what pdb.set_trace and torch's subclass make


def cell_is(filename: str) -> None:
    """The cell about to run was compiled with this file name."""
    global _cell
    _cell = filename


def failed(error: BaseException) -> None:
    """A session's cell raised on this rank: kept, with its frames and their locals, for
    `%elastic debug` (as IPython keeps sys.last_traceback for %debug, until the next failure)."""
    global _last
    if _cell is not None:
        _last = (error, _cell)


def post_mortem(error: BaseException) -> None:
    """--pdb: the debugger at the exception the cell raised on this rank, before the rank fails
    the cell (its failure is recorded after, with the time it raised); the supervisor holds the
    other ranks meanwhile."""
    global _post_mortem
    print(
        f"rank {_rank}: {type(error).__name__}: {error}\n"
        "post-mortem (--pdb): the other ranks are held until you leave (c or q); the cell then "
        "fails with this error"
    )
    _post_mortem = True
    try:
        _interact(error)
    finally:
        _post_mortem = False


def _interact(error: BaseException) -> None:
    global _error_line
    tb, _error_line = error.__traceback__, None
    while tb is not None:  # its frames are the exception's, not this stack's
        if tb.tb_frame.f_code.co_filename == _cell:
            _error_line = tb.tb_lineno
        tb = tb.tb_next
    debugger = CellPdb()
    debugger.reset()  # as pdb.post_mortem does: a quit needs the frames it was given
    try:
        debugger.interaction(None, error.__traceback__)
    finally:
        _error_line = None


def debug_last(rank: int) -> None:
    """``%elastic debug``: on rank `rank`, the debugger at the exception its last failed cell
    raised, in that cell's frames (post-mortem, as IPython's %debug)."""
    global _cell
    if _rank != rank:
        return
    if _last is None:
        print("no cell has failed on this rank since the session's ranks started")
        return
    error, cell = _last
    running, _cell = _cell, cell  # the failed cell's frames are the ones shown as `cell`
    try:
        print(f"{type(error).__name__}: {error}")
        _interact(error)
    finally:
        _cell = running


def answered(answer: InputAnswer) -> bool:
    """The notebook's answer (from the probe thread): to the input() that waits for it. False if
    none does (it was interrupted, or answered already)."""
    with _lock:
        waiting = _waiting.pop(answer["ask"], None)
    if waiting is None:
        return False
    waiting[1].append(answer)
    waiting[0].set()
    return True


def _input(prompt: object = "") -> str:
    assert _where is not None
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    ask = next(_asks)
    done, box = threading.Event(), list[InputAnswer]()
    with _lock:
        _waiting[ask] = (done, box)
    try:
        write_json(
            _where,
            InputAsked(
                ask=ask,
                prompt=str(prompt),
                out=written(1),
                err=written(2),
                t=time.time(),
                post_mortem=_post_mortem,
                line=_cell_line(),
            ),
        )
        done.wait()  # a signal still lands: an interrupt (a session's) or the teardown's
    finally:
        with _lock:
            _waiting.pop(ask, None)
    answer = box[0]
    if answer["text"] is None:
        raise NoInput(
            f"rank {_rank} waits for a line of input (its prompt: {str(prompt)!r}), and the "
            f"notebook has none to give: {answer['why']}"
        )
    return answer["text"]


def _cell_line() -> int | None:
    """The line the cell is at: its innermost frame on this stack (pdb's prompt is called from
    the frame it stopped; a post-mortem's, from the frames of the exception)."""
    if _error_line is not None:
        return _error_line
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_filename == _cell:
            return frame.f_lineno
        frame = frame.f_back  # type: ignore[assignment]
    return None


def written(fd: int) -> int:
    """Bytes written to an output (a log file, where torchelastic redirects it) so far."""
    try:
        return os.fstat(fd).st_size
    except OSError:
        return 0
