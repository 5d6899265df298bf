"""What the ranks exchange for a checkpoint: its collectives on a process group of its own, every
rank's RNG states, and a replicated state sent from the rank that has it to every other (how a
node without the newest step, or with none, starts from the same state when there is no shared
storage: the pattern of kubetorch's dynamic-world-size example)."""

from __future__ import annotations

import random
import sys
from collections.abc import Iterable, Mapping
from typing import Any

# The checkpoint's own group, made once per default group: (default group, ours).
_GROUP: tuple[Any, Any] | None = None


class Ranks:
    """This rank, its world, and collectives on the checkpoint's own gloo group; one process
    when torch.distributed is not initialised.

    A group of its own because an async save runs DCP's collectives in the package's thread:
    on the training's group they could interleave with the training's own collectives in a
    different order on different ranks, and gloo matches collectives by their order. gloo
    because those collectives (pickled plans and results) then run beside training on no GPU
    stream (torch's own async_save asserts a CPU backend, state_dict_saver.py), and an NCCL-only
    default group has none."""

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
        """Whether every rank says ok (and a barrier)."""
        if self.group is None:
            return ok
        import torch
        import torch.distributed as dist

        flag = torch.tensor([1 if ok else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=self.group)
        return bool(flag.item())

    def broadcast_state(self, state: dict[str, Any], src: int, error: str | None) -> dict[str, Any]:
        """`src`'s `state` on every rank: its structure and plain values as one object, then its
        tensors one by one into this rank's own (the same model and optimizer: same names, shapes
        and dtypes, checked first). `error` is src's reason it has no state to send."""
        import torch
        import torch.distributed as dist

        tensors = [(p, v) for p, v in walk(state) if isinstance(v, torch.Tensor)]
        signature = [(p, tuple(v.shape), v.dtype) for p, v in tensors]
        plain = [(p, v) for p, v in walk(state) if not isinstance(v, torch.Tensor)]
        box = [(signature, plain, error)]
        dist.broadcast_object_list(box, src=src, group=self.group)
        their_signature, their_plain, their_error = box[0]
        if their_error:
            raise RuntimeError(f"elastic_nb.checkpoint: {their_error}")
        if not self.all_ok(their_signature == signature):
            raise RuntimeError(
                "elastic_nb.checkpoint: the ranks' models or optimizers differ (parameter names, "
                f"shapes or dtypes), so rank {src}'s state cannot be sent to every rank"
            )
        for _, tensor in tensors:
            if tensor.device.type == "cpu" and tensor.is_contiguous():
                dist.broadcast(tensor, src=src, group=self.group)
            else:  # gloo moves CPU tensors
                buffer = tensor.detach().to("cpu", copy=True).contiguous()
                dist.broadcast(buffer, src=src, group=self.group)
                tensor.copy_(buffer)
        for path, value in their_plain:
            state = _replace(state, path, value)
        return state


def walk(obj: Any, path: tuple[Any, ...] = ()) -> Iterable[tuple[tuple[Any, ...], Any]]:
    """Every leaf of nested dicts, lists and tuples, with its path."""
    if isinstance(obj, dict):
        for key, value in obj.items():
            yield from walk(value, (*path, key))
    elif isinstance(obj, (list, tuple)):
        for i, value in enumerate(obj):
            yield from walk(value, (*path, i))
    else:
        yield path, obj


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


def sharded(state: Mapping[str, Any]) -> tuple[str, str] | None:
    """The first tensor of `state` that holds only part of its value on this rank (a DTensor
    shard, as FSDP2 makes, or a ShardedTensor): (its name, its kind), or None."""
    import torch

    for path, value in walk(state):
        if isinstance(value, torch.Tensor):
            kind = type(value).__name__
            placements = getattr(value, "placements", ())
            if kind == "ShardedTensor" or any(not p.is_replicate() for p in placements):
                return ".".join(str(p) for p in path), kind
    return None


def rng_state() -> dict[str, Any]:
    """This rank's random number generators: torch's, CUDA's (once CUDA is in use), Python's,
    NumPy's (once NumPy is imported)."""
    import torch

    state: dict[str, Any] = {"python": random.getstate(), "torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state_all()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        state["numpy"] = numpy.random.get_state()
    return state


def set_rng_state(state: Mapping[str, Any]) -> None:
    import torch

    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
    cuda = state.get("cuda")
    if cuda is not None and torch.cuda.is_available() and len(cuda) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(cuda)
    if "numpy" in state:
        import numpy

        numpy.random.set_state(state["numpy"])
