"""Checkpoints that survive a restart and a change of world size: the rank side.

    from elastic_nb import checkpoint

    state = {"epoch": 0}                                  # your own values, saved with each step
    step = checkpoint.load(model, opt, extra=state)       # None: nothing saved yet
    for step in range(0 if step is None else step + 1, 1000):
        train_one_step(step)
        if step % 100 == 0:
            checkpoint.save(step, model, opt, extra=state, async_save=True)
    checkpoint.wait()                                     # before the cell ends

This module owns, for the code a cell runs in every rank: where a notebook's checkpoints live
(`default_directory`), how every rank writes a step and when that step counts (committed), finding
and loading the newest committed step on any world size, keeping the last K, and the line rank 0
adds to the job's run directory for the supervisor (`RECORD_FILE`). It imports the standard
library when imported, torch when a checkpoint is saved or loaded, and nothing of elastic_nb's
kernel or supervisor side.

The writing and the resharding are torch.distributed.checkpoint's (DCP): `save`/`async_save` of
`get_state_dict(model, optimizer)`, then `load` and `set_state_dict` (torch/distributed/checkpoint/
state_dict_saver.py, state_dict_loader.py, state_dict.py). A DDP model is saved once (DCP spreads
the replicated tensors over the ranks), an FSDP2 model as its shards, and either loads on any
number of ranks.

A checkpoint directory:

    step-000000001200-3f9a1c2e/   a DCP checkpoint (.metadata, __R_0.distcp, ...) and COMMITTED
    step-000000001300-77b0e4d1/   no COMMITTED: being written, or left by a rank that died; never
                                  loaded, and removed by the next save or load

A step counts once COMMITTED is in it, and COMMITTED is written only after every rank finished
writing its part (an all-reduce of every rank's outcome; for an async save, in a thread of ours
once DCP's upload future completed on every rank). The step numbers order the checkpoints: the
latest is the highest committed step.

Storage is probed, never assumed: every rank writes a token file and looks for everyone else's.
When every rank sees every token the directory is shared and DCP reads and writes it from all
ranks. Otherwise (a directory per node), each node keeps a whole copy, written by its lowest rank;
a load agrees on the newest step across nodes and broadcasts that state from a rank that holds it,
so a node that joined with no checkpoint starts from the same state. A sharded state (FSDP) cannot
resume that way and is refused with the options.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import pickle
import random
import re
import secrets
import shutil
import sys
import time
import warnings
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterable, Mapping, MutableMapping

    import torch

__all__ = [
    "DIRECTORY_ENV",
    "RECORD_FILE",
    "Checkpoints",
    "default_directory",
    "load",
    "save",
    "wait",
]

# In $ELASTIC_NB_RUN_DIR (the job's run directory, set in every rank): one JSON line per committed
# save and per load, appended by rank 0, for the dashboard and the failure report.
RECORD_FILE = "checkpoints.jsonl"
RUN_DIR_ENV = "ELASTIC_NB_RUN_DIR"
# Overrides the default directory of every rank it is given to (e.g. `--env` on the magic).
DIRECTORY_ENV = "ELASTIC_NB_CHECKPOINT_DIR"

_COMMITTED = "COMMITTED"
_STEP_DIR = re.compile(r"^step-(\d+)-([0-9a-f]+)$")
_PROBE = ".probe-"
# Our own values (step, extra, every rank's RNG) travel in the DCP state dict as one pickled
# bytes value: DCP flattens nested dicts into keys, and a load must name every key it reads
# before it knows how many ranks saved RNG states.
_META = "elastic_nb"

log = logging.getLogger(__name__)


def default_directory() -> str:
    """One directory per notebook: `<notebook's directory>/.elastic_nb_checkpoints/<notebook
    name>`, beside the notebook as Jupyter's own `.ipynb_checkpoints` is (and so, on a cluster, on
    the storage the notebook is on). $ELASTIC_NB_CHECKPOINT_DIR wins.

    Ranks inherit the kernel's environment and working directory. Jupyter gives a kernel the
    notebook's path in JPY_SESSION_NAME (relative to the server's root, or absolute) and starts it
    in the notebook's directory; without it (a terminal, a script) the name is `default`.
    """
    if os.environ.get(DIRECTORY_ENV):
        return os.environ[DIRECTORY_ENV]
    session = os.environ.get("JPY_SESSION_NAME", "")
    base = os.getcwd()
    name = "default"
    if session:
        base = os.path.dirname(session) if os.path.isabs(session) else base
        name = os.path.splitext(os.path.basename(session))[0] or name
    return os.path.join(base, ".elastic_nb_checkpoints", name)


class _Files:
    """The few file operations a checkpoint directory needs, on a local path or an fsspec URL
    (the storage DCP's FsspecWriter/FsspecReader use: torch/distributed/checkpoint/
    _fsspec_filesystem.py)."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.fs: Any = None
        if "://" in root:
            from fsspec.core import url_to_fs  # torch depends on fsspec

            self.fs, _ = url_to_fs(root)

    def join(self, *names: str) -> str:
        if self.fs is not None:
            return "/".join([self.root.rstrip("/"), *names])
        return os.path.join(self.root, *names)

    def makedirs(self) -> None:
        if self.fs is not None:
            self.fs.makedirs(self.root, exist_ok=True)
        else:
            os.makedirs(self.root, exist_ok=True)

    def listdir(self) -> list[str]:
        if self.fs is not None:
            if not self.fs.exists(self.root):
                return []
            return [p.rstrip("/").rpartition("/")[2] for p in self.fs.ls(self.root, detail=False)]
        try:
            return os.listdir(self.root)
        except FileNotFoundError:
            return []

    def write(self, path: str, data: bytes) -> None:
        """All or nothing: a reader never sees half of it (a rename here; a single PUT on an
        object store)."""
        if self.fs is not None:
            self.fs.pipe_file(path, data)
            return
        tmp = f"{path}.tmp-{secrets.token_hex(4)}"
        with open(tmp, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)

    def read(self, path: str) -> bytes | None:
        try:
            if self.fs is not None:
                return self.fs.cat_file(path)
            with open(path, "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def remove(self, path: str) -> None:
        """Tolerates a file already gone: another rank of the same storage may clean too."""
        with contextlib.suppress(FileNotFoundError):
            if self.fs is not None:
                self.fs.rm_file(path)
            else:
                os.remove(path)

    def rmtree(self, path: str) -> None:
        if self.fs is not None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(path, recursive=True)
        else:
            shutil.rmtree(path, ignore_errors=True)

    def size(self, path: str) -> int:
        if self.fs is not None:
            return int(self.fs.du(path))
        total = 0
        for parent, _, files in os.walk(path):
            for name in files:
                with contextlib.suppress(OSError):
                    total += os.path.getsize(os.path.join(parent, name))
        return total


# The checkpoint's own gloo group, made once per default group: (default group, our group).
_GROUP: tuple[Any, Any] | None = None


class _Comm:
    """The collectives of a checkpoint, on a gloo group of its own, or one process when
    torch.distributed is not initialised.

    A group of its own because async_save runs DCP's collectives in a background thread
    (torch/distributed/checkpoint/_async_thread_executor.py): on the training's group they could
    interleave with the training's own collectives in a different order on different ranks, and
    gloo matches collectives by their order. gloo because async_save needs a CPU backend
    (state_dict_saver.py asserts it) and an NCCL-only default group has none."""

    def __init__(self) -> None:
        global _GROUP
        import torch.distributed as dist

        self.group: Any = None
        self.rank, self.world = 0, 1
        if dist.is_available() and dist.is_initialized():
            world = dist.group.WORLD
            if _GROUP is None or _GROUP[0] is not world:
                _GROUP = (world, dist.new_group(backend="gloo"))
            self.group = _GROUP[1]
            self.rank, self.world = dist.get_rank(), dist.get_world_size()

    def all_gather(self, obj: Any) -> list[Any]:
        if self.group is None:
            return [obj]
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out

    def all_ok(self, ok: bool) -> bool:
        if self.group is None:
            return ok
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def broadcast_object(self, obj: Any, src: int) -> Any:
        if self.group is None:
            return obj
        import torch.distributed as dist

        box = [obj]
        dist.broadcast_object_list(box, src=src, group=self.group)
        return box[0]

    def broadcast_tensor(self, tensor: torch.Tensor, src: int) -> None:
        import torch.distributed as dist

        if tensor.device.type == "cpu" and tensor.is_contiguous():
            dist.broadcast(tensor, src=src, group=self.group)
            return
        buffer = tensor.detach().to("cpu", copy=True).contiguous()
        dist.broadcast(buffer, src=src, group=self.group)
        tensor.copy_(buffer)


@dataclass(frozen=True)
class _Layout:
    """Which ranks see the same checkpoint directory, as the probe found."""

    shared: bool  # every rank sees every rank's files
    leader: int  # the lowest rank that sees what this rank sees: it lists, cleans and commits
    groups: tuple[tuple[int, ...], ...]  # ranks by the storage they see


def _probe(files: _Files, comm: _Comm) -> _Layout:
    """Every rank writes a random token file into its directory and looks for every other rank's;
    the ranks then compare what each saw. Shared storage is what was seen, never assumed."""
    token, error = secrets.token_hex(8), None
    mine = files.join(f"{_PROBE}{comm.rank}-{token}")
    try:
        files.makedirs()
        files.write(mine, token.encode())
    except OSError as e:
        error = f"rank {comm.rank} cannot write {files.root}: {e}"
    try:
        tokens = comm.all_gather((token, error))
        errors = [e for _, e in tokens if e]
        if errors:
            raise OSError("; ".join(errors))

        def seen() -> list[int]:
            return [
                r
                for r, (t, _) in enumerate(tokens)
                if files.read(files.join(f"{_PROBE}{r}-{t}")) == t.encode()
            ]

        visible = seen()
        if len(visible) < comm.world:
            # A network filesystem may answer from a cache of the directory for a moment after
            # another node created a file (NFS attribute caching); one more look before we
            # conclude that the storage is not shared.
            time.sleep(0.2)
            visible = seen()
        views = comm.all_gather(visible)
    finally:
        files.remove(mine)
    for r, view in enumerate(views):
        if r not in view or any(views[s] != view for s in view):
            raise RuntimeError(
                f"elastic_nb.checkpoint: the ranks disagree about who shares {files.root} "
                f"(each rank saw the probe files of the ranks {dict(enumerate(views))}); give every "
                "rank a directory on the same storage, or one of its own per node"
            )
    groups = tuple(sorted({tuple(v) for v in views}))
    return _Layout(len(groups) == 1, min(views[comm.rank]), groups)


def _optimizers(optimizer: Any) -> Any:
    return () if optimizer is None else optimizer


def _walk(obj: Any, path: tuple[Any, ...] = ()) -> Iterable[tuple[tuple[Any, ...], Any]]:
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from _walk(value, (*path, key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from _walk(value, (*path, i))
    else:
        yield path, obj


def _refuse_sharded(state: Mapping[str, Any], directory: str, layout: _Layout) -> None:
    import torch

    for path, value in _walk(state):
        if not isinstance(value, torch.Tensor):
            continue
        kind = type(value).__name__
        placements = getattr(value, "placements", ())
        if kind == "ShardedTensor" or any(not p.is_replicate() for p in placements):
            name = ".".join(str(p) for p in path)
            raise RuntimeError(
                f"elastic_nb.checkpoint: {directory} is not shared by every rank (the ranks "
                f"{list(layout.groups)} each see a different one), and this state is sharded "
                f"({name} is a {kind} shard, as FSDP makes): no node holds a whole copy to resume "
                "from. Either put the checkpoints on storage every node mounts (directory= or "
                f"${DIRECTORY_ENV}: an NFS or Lustre path, or an fsspec URL such as "
                "s3://bucket/run), or keep the model replicated (DDP) so that each node keeps a "
                "whole copy, or save a full state dict yourself (get_state_dict with "
                "StateDictOptions(full_state_dict=True, cpu_offload=True)) from one rank."
            )


def _rng_state() -> dict[str, Any]:
    import torch

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    return state


def _set_rng_state(state: Mapping[str, Any]) -> None:
    import torch

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])


def _quiet_no_dist() -> None:
    """DCP warns on every save and load with no_dist=True (state_dict_saver.py, _loader.py),
    which is how a node's own copy is written and read without shared storage; the warning is
    raised in DCP's upload thread too, where warnings.catch_warnings is not safe."""
    warnings.filterwarnings(
        "ignore",
        message=r"torch\.distributed is disabled, unavailable or uninitialized, assuming the "
        r"intent is to (save|load) in a single process",
    )


def _record(event: dict[str, Any]) -> None:
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return
    try:
        # One write of one line in append mode: lines of two writers never interleave.
        with open(os.path.join(run_dir, RECORD_FILE), "a") as f:
            f.write(json.dumps(event) + "\n")
    except OSError as e:
        log.warning("elastic_nb.checkpoint: could not record %s in %s: %s", event, run_dir, e)


class Checkpoints:
    """The checkpoints in one directory, from one rank. `save` and `load` are collective: every
    rank calls them, in the same order. One save is in flight at a time: the next save, a load
    and `wait` wait for it."""

    def __init__(self, directory: str | os.PathLike[str] | None = None) -> None:
        self.directory = os.fspath(directory) if directory is not None else default_directory()
        self._files = _Files(self.directory)
        self._layout: tuple[Any, _Layout] | None = None  # (the group it was probed on, layout)
        self._pending: Future[None] | None = None
        self._thread: ThreadPoolExecutor | None = None
        self._stager: Any = None

    @property
    def shared(self) -> bool | None:
        """Whether every rank sees this directory (None until the first save or load)."""
        return None if self._layout is None else self._layout[1].shared

    @property
    def in_flight(self) -> bool:
        """Whether an async save is still being written or committed."""
        return self._pending is not None and not self._pending.done()

    def steps(self) -> list[int]:
        """The committed steps this rank's storage holds, oldest first (no collective)."""
        return sorted({step for step, _, _ in self._committed()})

    # -- saving ---------------------------------------------------------------------------

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
        *,
        extra: Mapping[str, Any] | None = None,
        keep: int | None = 3,
        async_save: bool = False,
        rng: bool = True,
    ) -> None:
        """Save `step` from every rank: the model, the optimizer, `extra` (small picklable values
        such as the epoch or the sampler's position, taken from rank 0) and every rank's RNG
        states (torch, CUDA, Python's, NumPy's). The step counts once every rank wrote its part;
        then all but the `keep` newest steps are removed (None keeps all).

        With `async_save`, the state is copied to memory and written by a thread while training
        goes on; `wait()` (or the next save or load) waits for it and raises its error."""
        if step < 0 or (keep is not None and keep < 1):
            raise ValueError(f"step must be >= 0 and keep >= 1 or None (got {step}, {keep})")
        self.wait()
        started = time.time()
        comm, layout = self._prepare()
        from torch.distributed.checkpoint.state_dict import get_state_dict

        model_state, optim_state = get_state_dict(model, _optimizers(optimizer))
        if not layout.shared:
            _refuse_sharded(model_state, self.directory, layout)
        leader = comm.rank == layout.leader
        newest = None
        if leader:
            self._clean()
            committed = self._committed()
            newest = committed[-1][0] if committed else None
        mine: dict[str, Any] = {"rng": _rng_state() if rng else None, "newest": newest}
        if comm.rank == 0:
            mine.update(extra=dict(extra or {}), nonce=secrets.token_hex(4))
        # Also the barrier between the leaders' cleaning above and anyone's writing below.
        everyone = comm.all_gather(mine)
        newest = max((e["newest"] for e in everyone if e["newest"] is not None), default=None)
        if newest is not None and step < newest:
            raise ValueError(
                f"elastic_nb.checkpoint: step {step} is before the newest step saved in "
                f"{self.directory} ({newest}), so it would never be the one loaded; load() "
                "first to resume, or give a new run a directory of its own"
            )
        name = f"step-{step:012d}-{everyone[0]['nonce']}"
        meta = {
            "step": step,
            "extra": everyone[0]["extra"],
            "rng": [e["rng"] for e in everyone],
            "world_size": comm.world,
        }
        state = {"model": model_state, "optim": optim_state, _META: pickle.dumps(meta)}
        path = self._files.join(name)
        # Shared: every rank writes its part through DCP's collectives. A directory per node:
        # each node's leader writes a whole copy alone (the state is replicated: checked above).
        kwargs: dict[str, Any] | None = None
        if layout.shared:
            kwargs = {"process_group": comm.group, "no_dist": comm.group is None}
        elif leader:
            kwargs = {"no_dist": True}
        if kwargs is not None and kwargs["no_dist"]:
            _quiet_no_dist()
        commit = _Commit(self, comm, layout, step, name, started, async_save, keep)
        import torch.distributed.checkpoint as dcp

        if not async_save:
            error = None
            if kwargs is not None:
                try:
                    dcp.save(state, checkpoint_id=path, **kwargs)
                except Exception as e:
                    error = e
            commit(error)
            return
        future: Future[Any] | None = None
        error = None
        if kwargs is not None:
            try:
                response = dcp.async_save(
                    state, checkpoint_id=path, async_stager=self._async_stager(), **kwargs
                )
                # An AsyncSaveResponse only with asynchronous staging, which ours does not ask for.
                future = getattr(response, "upload_completion", response)
            except Exception as e:
                error = e  # still to the commit: the other ranks wait there for this one's word
        commit.returned = time.time()
        if self._thread is None:
            self._thread = ThreadPoolExecutor(1, thread_name_prefix="elastic_nb-checkpoint")
        self._pending = self._thread.submit(commit.after, future, error)

    def wait(self) -> None:
        """Wait until the save in flight (if any) is committed; raise its error if it failed."""
        pending, self._pending = self._pending, None
        if pending is not None:
            pending.result()

    def close(self) -> None:
        """Wait for the save in flight, then free the memory async saves keep their copy in."""
        try:
            self.wait()
        finally:
            if self._stager is not None:
                self._stager.close()
                self._stager = None
            if self._thread is not None:
                self._thread.shutdown(wait=True)
                self._thread = None

    # -- loading --------------------------------------------------------------------------

    def load(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
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
        comm, layout = self._prepare()
        newest: tuple[int, str, dict[str, Any]] | None = None
        if comm.rank == layout.leader:
            self._clean()
            committed = self._committed()
            newest = committed[-1] if committed else None
        everyone = comm.all_gather(newest)
        held = [(e[0], r) for r, e in enumerate(everyone) if e is not None]
        if not held:
            if comm.rank == 0:
                _record(
                    {
                        "event": "loaded",
                        "step": None,
                        "time": time.time(),
                        "path": self.directory,
                        "seconds": time.time() - started,
                        "world_size": comm.world,
                    }
                )
            return None
        # The ranks agree on the newest step; it is read from the lowest rank that holds it.
        step = max(s for s, _ in held)
        src = min(r for s, r in held if s == step)
        _, name, info = everyone[src]
        path = self._files.join(name)
        from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

        model_state, optim_state = get_state_dict(model, _optimizers(optimizer))
        state: dict[str, Any] = {"model": model_state, "optim": optim_state, _META: b""}
        import torch.distributed.checkpoint as dcp

        if layout.shared:
            dcp.load(
                state, checkpoint_id=path, process_group=comm.group, no_dist=comm.group is None
            )
            source = "shared"
        else:
            _refuse_sharded(model_state, self.directory, layout)
            state = self._load_and_broadcast(state, path, src, comm)
            source = f"rank {src}"
        set_state_dict(
            model,
            _optimizers(optimizer),
            model_state_dict=state["model"],
            optim_state_dict=state["optim"],
        )
        meta = pickle.loads(state[_META])
        if rng and comm.rank < len(meta["rng"]) and meta["rng"][comm.rank] is not None:
            _set_rng_state(meta["rng"][comm.rank])
        if extra is not None:
            extra.update(meta["extra"])
        if comm.rank == 0:
            _record(
                {
                    "event": "loaded",
                    "step": step,
                    "time": time.time(),
                    "path": path,
                    "bytes": info.get("bytes"),
                    "seconds": time.time() - started,
                    "from": source,
                    "world_size": comm.world,
                    "saved_world_size": meta["world_size"],
                    "saved_time": info.get("time"),
                }
            )
        return step

    def _load_and_broadcast(
        self, state: dict[str, Any], path: str, src: int, comm: _Comm
    ) -> dict[str, Any]:
        """Without shared storage: `src` reads its node's whole copy, then sends it to every rank
        (the structure and plain values as one object, the tensors one by one, in place)."""
        import torch
        import torch.distributed.checkpoint as dcp

        error = None
        if comm.rank == src:
            _quiet_no_dist()
            try:
                dcp.load(state, checkpoint_id=path, no_dist=True)
            except Exception as e:
                error = f"rank {src} could not read {path}: {type(e).__name__}: {e}"
        tensors = [(p, v) for p, v in _walk(state) if isinstance(v, torch.Tensor)]
        signature = [(p, tuple(v.shape), v.dtype) for p, v in tensors]
        plain = [(p, v) for p, v in _walk(state) if not isinstance(v, torch.Tensor)]
        sent = comm.broadcast_object((signature, plain, error), src)
        if sent[2]:
            raise RuntimeError(f"elastic_nb.checkpoint: {sent[2]}")
        if not comm.all_ok(sent[0] == signature):
            raise RuntimeError(
                "elastic_nb.checkpoint: the ranks' models or optimizers differ (parameter names, "
                f"shapes or dtypes), so rank {src}'s state cannot be sent to every rank"
            )
        for _, tensor in tensors:
            comm.broadcast_tensor(tensor, src)
        for p, value in sent[1]:
            state = _replace(state, p, value)
        return state

    # -- the directory --------------------------------------------------------------------

    def _prepare(self) -> tuple[_Comm, _Layout]:
        comm = _Comm()
        if self._layout is None or self._layout[0] is not comm.group:
            self._layout = (comm.group, _probe(self._files, comm))
        return comm, self._layout[1]

    def _committed(self) -> list[tuple[int, str, dict[str, Any]]]:
        """(step, name, what COMMITTED says) of every committed step here, oldest first."""
        found = []
        for name in self._files.listdir():
            m = _STEP_DIR.match(name)
            raw = self._files.read(self._files.join(name, _COMMITTED)) if m else None
            if m and raw is not None:
                with contextlib.suppress(ValueError):
                    found.append((int(m.group(1)), name, json.loads(raw)))
        found.sort(key=lambda e: (e[0], e[2].get("time", 0.0)))
        return found

    def _clean(self, keep: int | None = None) -> None:
        """Remove what no load may read (uncommitted steps, a step saved again before its newer
        copy, probe files a killed rank left) and all but the `keep` newest steps. Only a leader
        runs it, and never while a step of this job is being written; a step is un-committed (its
        COMMITTED removed) before its files go, so no reader ever sees half of it."""
        committed = self._committed()
        newest_copy = {step: name for step, name, _ in committed}  # the latest commit wins
        kept = set(newest_copy.values())
        if keep is not None:
            kept -= {newest_copy[s] for s in sorted(newest_copy)[:-keep]}
        for name in self._files.listdir():
            path = self._files.join(name)
            if _STEP_DIR.match(name) and name not in kept:
                self._files.remove(self._files.join(name, _COMMITTED))
                self._files.rmtree(path)
            elif name.startswith(_PROBE):
                self._files.remove(path)

    def _async_stager(self) -> Any:
        # One stager for every async save: it keeps its copy of the state between saves and
        # refreshes it in place (torch/distributed/checkpoint/_state_dict_stager.py caches
        # storages), instead of allocating the whole state again at each step.
        if self._stager is None:
            from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

            self._stager = DefaultStager(StagingOptions(False, False, False, False))
        return self._stager


def _replace(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    """`obj` with the leaf at `path` replaced (tuples rebuilt, dicts and lists changed in place)."""
    if not path:
        return value
    head, rest = path[0], path[1:]
    if isinstance(obj, tuple):
        items = list(obj)
        items[head] = _replace(items[head], rest, value)
        return type(obj)(items)
    obj[head] = _replace(obj[head], rest, value)
    return obj


@dataclass
class _Commit:
    """What happens once a step's files are written: every rank's outcome is compared, the
    leaders write COMMITTED and keep the last K, and rank 0 records the save. For an async save
    it runs in our thread once DCP's upload future completed; nothing else uses the checkpoint's
    group meanwhile (a save, a load and wait() first wait for it)."""

    owner: Checkpoints
    comm: _Comm
    layout: _Layout
    step: int
    name: str
    started: float
    async_save: bool
    keep: int | None
    returned: float | None = None  # when save() gave control back to training (async)

    def after(self, future: Future[Any] | None, error: BaseException | None) -> None:
        if future is not None:
            try:
                future.result()
            except Exception as e:
                error = e
        try:
            self(error)
        except Exception:
            log.exception("elastic_nb.checkpoint: step %d was not saved", self.step)
            raise

    def __call__(self, error: BaseException | None) -> None:
        files, leader = self.owner._files, self.comm.rank == self.layout.leader
        path = files.join(self.name)
        if error is not None and leader:
            files.rmtree(path)  # the next save or load would remove it too
        if not self.comm.all_ok(error is None):
            if error is not None:
                raise error
            raise RuntimeError(
                f"elastic_nb.checkpoint: step {self.step} was not saved: another rank failed to "
                "write its part (its log says why)"
            )
        committed = time.time()
        size, failed = 0, None
        if leader:
            try:
                size = files.size(path)
                marker = {"step": self.step, "time": committed, "bytes": size}
                marker.update(world_size=self.comm.world, shared=self.layout.shared)
                files.write(files.join(self.name, _COMMITTED), json.dumps(marker).encode())
                self.owner._clean(self.keep)
            except OSError as e:
                failed = e
        if not self.comm.all_ok(failed is None):
            raise RuntimeError(
                f"elastic_nb.checkpoint: step {self.step} was written but not committed"
                + (f": {failed}" if failed else " by every node (see the other ranks' logs)")
            )
        if self.comm.rank == 0:
            returned = self.returned if self.returned is not None else committed
            _record(
                {
                    "event": "saved",
                    "step": self.step,
                    "time": committed,
                    "path": path,
                    "bytes": size,
                    "seconds": committed - self.started,
                    "async": self.async_save,
                    "blocked_s": returned - self.started,
                    "overlapped_s": committed - returned if self.async_save else None,
                    "world_size": self.comm.world,
                    "shared": self.layout.shared,
                }
            )


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
    optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
    *,
    extra: Mapping[str, Any] | None = None,
    keep: int | None = 3,
    async_save: bool = False,
    rng: bool = True,
    directory: str | os.PathLike[str] | None = None,
) -> None:
    """`Checkpoints(directory).save(...)`: the default directory is one per notebook."""
    _checkpoints(directory).save(
        step, model, optimizer, extra=extra, keep=keep, async_save=async_save, rng=rng
    )


def load(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | Iterable[torch.optim.Optimizer] | None = None,
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
