"""`Checkpoints`: a directory's checkpoints, as every rank saves and loads them (the package's
`save`, `load` and `wait` use one per directory). See the package's docstring for what a step is
and when it counts."""

from __future__ import annotations

import atexit
import contextlib
import os
import pickle
import secrets
import time
import warnings
from collections.abc import Iterable, Mapping, MutableMapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

from elastic_nb.checkpoint.commit import Commit, record
from elastic_nb.checkpoint.directory import (
    DIRECTORY_ENV,
    Directory,
    Layout,
    default_directory,
    step_name,
)
from elastic_nb.checkpoint.ranks import Ranks, rng_state, set_rng_state, sharded
from elastic_nb.checkpoint.writer import Handover, WriterProcess, storage_writer

if TYPE_CHECKING:
    import torch

    Optimizers = torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None

__all__ = ["Checkpoints"]

# Our own values (the step, extra, every rank's RNG) travel in DCP's state dict as one pickled
# bytes value: DCP flattens nested dicts into keys, and a load must name every key it reads
# before it knows how many ranks saved RNG states.
_META = "elastic_nb"


class Checkpoints:
    """The checkpoints in one directory (a path, or an fsspec URL DCP writes through), from one
    rank. `save` and `load` are collective: every rank calls them, in the same order. One save is
    in flight at a time: the next save, a load and `wait` wait for it."""

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self.directory = os.fspath(directory) if directory is not None else default_directory()
        self._dir = Directory(self.directory)
        self._layout: tuple[Any, Layout] | None = None  # (the group it was probed on, layout)
        self._pending: Future[None] | None = None
        self._thread: ThreadPoolExecutor | None = None
        self._writer: WriterProcess | None = None  # writes this rank's async saves

    @property
    def shared(self) -> bool | None:
        """Whether every rank sees this directory (None until the first save or load)."""
        return None if self._layout is None else self._layout[1].shared

    @property
    def in_flight(self) -> bool:
        """Whether this rank's async save is still being written or committed."""
        return self._pending is not None and not self._pending.done()

    @property
    def writer_pid(self) -> int | None:
        """The process that writes this rank's async saves (None before the first)."""
        return None if self._writer is None else self._writer.pid

    def steps(self) -> list[int]:
        """The committed steps this rank's storage holds, oldest first (not collective)."""
        return sorted({step for step, _, _ in self._dir.committed()})

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: Optimizers = None,
        *,
        extra: Mapping[str, Any] | None = None,
        keep: int | None = 3,
        async_save: bool = False,
        rng: bool = True,
        fsync: bool = False,
    ) -> None:
        """Save `step` from every rank: the model, the optimizer, `extra` (small picklable values
        such as the epoch or the sampler's position, taken from rank 0) and every rank's RNG
        states. The step counts once every rank wrote its part; then all but the `keep` newest
        steps are removed (None keeps all).

        With `async_save`, this rank's share of the state is copied to shared memory, and
        written by a process of the rank's (`writer_pid`) while training goes on; `wait()` (or
        the next save or load) waits for it and raises its error.

        A committed step survives the death of any process (the kernel holds what was written,
        as it holds a file torch.save wrote). With `fsync`, every file is on disk before the step
        counts, so it also survives the machine losing power (P14 measures the cost)."""
        if step < 0 or (keep is not None and keep < 1):
            raise ValueError(f"step must be >= 0 and keep >= 1 or None (got {step}, {keep})")
        self.wait()
        started = time.time()
        ranks, layout = self._prepare()
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(model, _optimizers(optimizer))
        if not layout.shared:
            self._refuse_sharded(model_state, layout)
        leader = ranks.rank == layout.leader
        # What could fail on one rank alone travels in the gather below, so that every rank
        # raises instead of the others waiting there for it.
        mine: dict[str, Any] = {"rng": rng_state() if rng else None, "newest": None}
        if leader:
            mine.update(self._newest())
        if ranks.rank == 0:
            mine["nonce"] = secrets.token_hex(4)
            try:
                mine["extra"] = pickle.dumps(dict(extra or {}))
            except Exception as e:
                mine["error"] = f"extra= cannot be saved: {type(e).__name__}: {e}"
        # Also the barrier between the leaders' cleaning above and anyone's writing below.
        everyone = ranks.all_gather(mine)
        _raise_any(everyone)
        newest = max((e["newest"][0] for e in everyone if e["newest"]), default=None)
        if newest is not None and step < newest:
            raise ValueError(
                f"elastic_nb.checkpoint: step {step} is before the newest step saved in "
                f"{self.directory} ({newest}), so it would never be the one loaded; load() "
                "first to resume, or give a new run a directory of its own"
            )
        meta = {
            "step": step,
            "extra": pickle.loads(everyone[0]["extra"]),
            "rng": [e["rng"] for e in everyone],
            "world_size": ranks.world,
        }
        state = {"model": model_state, "optim": optim_state, _META: pickle.dumps(meta)}
        name = step_name(step, everyone[0]["nonce"])
        path = self._dir.path(name)
        commit = Commit(self._dir, ranks, layout, step, name, started, async_save, keep, fsync)
        # Shared: every rank writes its part through DCP's collectives. A directory per node:
        # each node's leader writes a whole copy alone (the state is replicated: checked above).
        kwargs: dict[str, Any] | None = None
        if layout.shared:
            kwargs = {"process_group": ranks.group, "no_dist": ranks.group is None}
        elif leader:
            kwargs = {"no_dist": True}
        if kwargs is not None and kwargs["no_dist"]:
            _quiet_no_dist()
        import torch.distributed.checkpoint as dcp

        error: BaseException | None = None
        url = self._dir.fs is not None
        if not async_save:
            if kwargs is not None:
                try:
                    writer = storage_writer(path, url=url, fsync=fsync)
                    dcp.save(state, storage_writer=writer, **kwargs)
                # DCP's CheckpointException is a BaseException (torch/distributed/checkpoint/
                # api.py): a rank whose write failed that let it pass skipped the commit, and
                # the others waited there for it until it died.
                except (Exception, dcp.CheckpointException) as e:
                    error = e  # still to the commit: the other ranks wait there for this one
            commit(error)
            return
        # Async: DCP plans, writes and commits in the package's thread while training goes on;
        # the training thread waits only until this rank's share of the state is copied
        # (writer.py), and the bytes are written by the rank's writer process.
        if self._thread is None:
            # Not a daemon: a rank that exits with a save in flight finishes it first (the
            # interpreter's exit, and multiprocessing's for a forked rank (process.py, _bootstrap),
            # join it in threading._shutdown).
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="elastic_nb-checkpoint")
        if self._writer is None:
            self._writer = WriterProcess()
            atexit.register(self._close_at_exit)
        handover = Handover()
        self._pending = self._thread.submit(
            self._save_async, commit, state, path, kwargs, url, fsync, handover
        )
        handover.wait()
        commit.returned = time.time()

    def _save_async(
        self,
        commit: Commit,
        state: dict[str, Any],
        path: str,
        kwargs: dict[str, Any] | None,
        url: bool,
        fsync: bool,
        handover: Handover,
    ) -> None:
        import torch.distributed.checkpoint as dcp

        error: BaseException | None = None
        try:
            if kwargs is not None:
                assert self._writer is not None
                writer = storage_writer(
                    path, url=url, fsync=fsync, process=self._writer, handover=handover
                )
                dcp.save(state, storage_writer=writer, **kwargs)
        except (Exception, dcp.CheckpointException) as e:  # a BaseException: see save()
            error = e  # still to the commit: the other ranks wait there for this one
        finally:
            handover.release()
        commit.after(error)

    def load(
        self,
        model: torch.nn.Module,
        optimizer: Optimizers = None,
        *,
        extra: MutableMapping[str, Any] | None = None,
        rng: bool = True,
    ) -> int | None:
        """Load the newest committed step into `model` and `optimizer` on any world size; return
        the step, or None when no rank's storage holds one (the model is then untouched).

        `extra` is updated with the values saved with the step. A rank that existed when the step
        was saved gets its RNG states back; one that did not (the world grew) keeps its own."""
        self.wait()
        started = time.time()
        ranks, layout = self._prepare()
        everyone = ranks.all_gather(self._newest() if ranks.rank == layout.leader else {})
        _raise_any(everyone)
        held = [(e["newest"][0], r) for r, e in enumerate(everyone) if e.get("newest")]
        if not held:
            if ranks.rank == 0:
                record(
                    {
                        "event": "loaded",
                        "step": None,  # nothing to resume from: the run starts fresh
                        "time": time.time(),
                        "path": self.directory,
                        "seconds": time.time() - started,
                        "world_size": ranks.world,
                    }
                )
            return None
        # The ranks agree on the newest step, and read it from the lowest rank that holds it.
        step = int(max(s for s, _ in held))
        src = min(r for s, r in held if s == step)
        _, name, marker = everyone[src]["newest"]
        path = self._dir.path(name)
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        # get_state_dict gives a fresh optimizer its state first (state_dict.py,
        # _init_optim_state), so that DCP has tensors to load into.
        model_state, optim_state = get_state_dict(model, _optimizers(optimizer))
        state: dict[str, Any] = {"model": model_state, "optim": optim_state, _META: b""}
        import torch.distributed.checkpoint as dcp

        if layout.shared:
            if ranks.group is None:
                _quiet_no_dist()
            dcp.load(
                state, checkpoint_id=path, process_group=ranks.group, no_dist=ranks.group is None
            )
            source = "shared"
        else:
            self._refuse_sharded(model_state, layout)
            error = None
            if ranks.rank == src:
                _quiet_no_dist()
                try:
                    dcp.load(state, checkpoint_id=path, no_dist=True)
                except (Exception, dcp.CheckpointException) as e:  # see save()
                    error = f"rank {src} could not read {path}: {type(e).__name__}: {e}"
            state = ranks.broadcast_state(state, src, error)
            source = f"rank {src}"
        set_state_dict(
            model,
            _optimizers(optimizer),
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        meta = pickle.loads(state[_META])
        if rng and ranks.rank < len(meta["rng"]) and meta["rng"][ranks.rank] is not None:
            set_rng_state(meta["rng"][ranks.rank])
        if extra is not None:
            extra.update(meta["extra"])
        if ranks.rank == 0:
            record(
                {
                    "event": "loaded",
                    "step": step,
                    "time": time.time(),  # when the load ended
                    "path": path,  # the copy read (src's; shared: everyone's)
                    "bytes": marker.get("bytes"),
                    "seconds": time.time() - started,
                    "from": source,  # "shared", or "rank R" that sent it to every rank
                    "world_size": ranks.world,
                    "saved_world_size": meta["world_size"],
                    "saved_time": marker.get("time"),  # when the step was committed
                }
            )
        return step

    def wait(self) -> None:
        """Wait until the save in flight (if any) is committed; raise its error if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            if not pending.done() and self._writer is not None:
                self._writer.hurry()
            pending.result()

    def close(self) -> None:
        """Wait for the save in flight, then free the memory async saves keep their copy in."""
        try:
            self.wait()
        finally:
            if self._writer is not None:
                atexit.unregister(self._close_at_exit)
                self._writer.close()
                self._writer = None
            if self._thread is not None:
                self._thread.shutdown(wait=True)
                self._thread = None

    def _close_at_exit(self) -> None:
        """As the rank exits (a forked one too: bootstrap runs the atexit handlers): the save in
        flight finished, its writer process ended and reaped. The rank outlives its writer, so
        the job's end never finds the writer still running. A failed save said so already (its
        commit record), and an exit handler has no one to raise to."""
        with contextlib.suppress(Exception):
            self.close()

    def _newest(self) -> dict[str, Any]:
        """A leader's word before a save or a load: its newest committed step after tidying, or
        why it could not list them."""
        try:
            committed = self._dir.tidy()
        except OSError as e:
            return {"error": f"cannot list {self.directory}: {e}"}
        return {"newest": committed[-1] if committed else None}

    def _prepare(self) -> tuple[Ranks, Layout]:
        ranks = Ranks()
        if self._layout is None or self._layout[0] is not ranks.group:
            self._layout = (ranks.group, self._dir.probe(ranks))
        return ranks, self._layout[1]

    def _refuse_sharded(self, state: Mapping[str, Any], layout: Layout) -> None:
        found = sharded(state)
        if found is None:
            return
        raise RuntimeError(
            f"elastic_nb.checkpoint: {self.directory} is not shared by every rank (the ranks "
            f"{list(layout.groups)} each see a different one), and this state is sharded "
            f"({found[0]} is a {found[1]} shard, as FSDP makes): no node holds a whole copy to "
            "resume from. Either put the checkpoints on storage every node mounts (directory= "
            f"or ${DIRECTORY_ENV}: an NFS or Lustre path, or an fsspec URL such as "
            "s3://bucket/run), or keep the model replicated (DDP) so that each node keeps a "
            "whole copy, or save a full state dict yourself (get_state_dict with "
            "StateDictOptions(full_state_dict=True, cpu_offload=True)) from one rank."
        )


def _raise_any(everyone: list[dict[str, Any]]) -> None:
    errors = [f"rank {r}: {e['error']}" for r, e in enumerate(everyone) if e.get("error")]
    if errors:
        raise RuntimeError("elastic_nb.checkpoint: " + "; ".join(errors))


def _optimizers(optimizer: Optimizers) -> Any:
    return () if optimizer is None else optimizer


def _quiet_no_dist() -> None:
    """DCP warns at every save and load with no_dist=True (state_dict_saver.py,
    state_dict_loader.py), which is how a node's own copy is written and read without shared
    storage; it warns in the package's save thread too, where warnings.catch_warnings is not
    safe."""
    warnings.filterwarnings(
        "ignore",
        message=r"torch\.distributed is disabled, unavailable or uninitialized, assuming the "
        r"intent is to (save|load) in a single process",
    )
