"""Checkpoints that survive a restart and a change of world size: the rank side.

    from elastic_nb import checkpoint

    state = {"epoch": 0}                                  # your own values, saved with each step
    step = checkpoint.load(model, opt, extra=state)       # None: nothing saved yet
    for step in range(0 if step is None else step + 1, 1000):
        train_one_step(step)
        if step % 100 == 0:
            checkpoint.save(step, model, opt, extra=state, async_save=True)
    checkpoint.wait()                                     # before the cell ends

This package owns, for the code a cell runs in every rank: where a notebook's checkpoints live
(`default_directory`), how every rank saves a step and when it counts, finding and loading the
newest committed step on any world size, keeping the last K, and the line rank 0 adds to the job's
run directory for the supervisor (`RECORD_FILE`, see commit.py). Importing it imports the standard
library; torch comes with the first save or load; nothing of elastic_nb's kernel or supervisor.

The writing and the resharding are torch.distributed.checkpoint's (DCP): `save` of
`get_state_dict(model, optimizer)`, then `load` and `set_state_dict` (torch/distributed/checkpoint/
state_dict_saver.py, state_dict_loader.py, state_dict.py). A DDP model is saved once (DCP spreads
its replicated tensors over the ranks), an FSDP2 model as its shards; either loads on any number
of ranks. An async save runs DCP's `save` in a thread of the package's, and its bytes are written
by a process of the rank's (writer.py). The rank's side is `Checkpoints` (checkpoints.py).

A step counts once its directory holds COMMITTED, which the leaders write only after every rank
finished writing its part (commit.py); a rank killed mid-save leaves the previous step the latest,
and the next save or load removes the half-written one (directory.py). The step numbers order the
checkpoints: the latest is the highest committed step.

Storage is probed, never assumed (directory.py). When every rank sees every other's probe file,
DCP reads and writes the directory from all ranks. Otherwise (a directory per node) each node
keeps a whole copy, written by its lowest rank; a load agrees on the newest step across nodes and
sends that state from a rank that holds it to every other (ranks.py), so a node that just joined,
with no checkpoint at all, starts from the same state. A sharded state cannot resume that way and
is refused with the options.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Mapping, MutableMapping
from typing import TYPE_CHECKING, Any, TypedDict

from elastic_nb.checkpoint import writer
from elastic_nb.checkpoint.checkpoints import Checkpoints
from elastic_nb.checkpoint.commit import RECORD_FILE, RUN_DIR_ENV
from elastic_nb.checkpoint.directory import DIRECTORY_ENV, default_directory

if TYPE_CHECKING:
    import torch
    from typing_extensions import Unpack  # typing's own from Python 3.11

    Optimizers = torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None

__all__ = [
    "DIRECTORY_ENV",
    "RECORD_FILE",
    "RUN_DIR_ENV",
    "Checkpoints",
    "default_directory",
    "load",
    "save",
    "wait",
    "writer",
]


class _SaveOptions(TypedDict, total=False):
    """`Checkpoints.save`'s options: what they mean and their defaults are said there."""

    extra: Mapping[str, Any] | None
    keep: int | None
    async_save: bool
    rng: bool
    fsync: bool


# The module-level functions: one Checkpoints per directory, per process.
_BY_DIRECTORY: dict[str, Checkpoints] = {}


def _checkpoints(directory: str | os.PathLike[str] | None) -> Checkpoints:
    key = os.fspath(directory) if directory is not None else default_directory()
    if key not in _BY_DIRECTORY:
        _BY_DIRECTORY[key] = Checkpoints(key)
    return _BY_DIRECTORY[key]


def save(
    step: int,
    model: torch.nn.Module,
    optimizer: Optimizers = None,
    *,
    directory: str | os.PathLike[str] | None = None,
    **options: Unpack[_SaveOptions],
) -> None:
    """`Checkpoints(directory).save(...)`, whose options (and their defaults) these are; the
    default directory is one per notebook."""
    _checkpoints(directory).save(step, model, optimizer, **options)


def load(
    model: torch.nn.Module,
    optimizer: Optimizers = None,
    *,
    extra: MutableMapping[str, Any] | None = None,
    rng: bool = True,
    directory: str | os.PathLike[str] | None = None,
) -> int | None:
    """`Checkpoints(directory).load(...)`: the newest committed step, or None."""
    return _checkpoints(directory).load(model, optimizer, extra=extra, rng=rng)


def wait(directory: str | os.PathLike[str] | None = None) -> None:
    """Wait for the async save in flight (of `directory`, or of every directory)."""
    targets = list(_BY_DIRECTORY.values()) if directory is None else [_checkpoints(directory)]
    for checkpoints in targets:
        checkpoints.wait()
