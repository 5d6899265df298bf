"""What travels between the kernel and the ranks: cloudpickle, with device tensors on the CPU.

Both directions go through `dumps`: pushed objects (kernel -> every rank) and the cell's result
and ``--pull`` objects (a rank -> kernel). A tensor on a GPU travels as a CPU tensor:

* the kernel must never touch CUDA when it loads a result (it would hold a context, and memory,
  on a GPU the ranks need);
* a pushed CUDA tensor would be restored on its original device (usually cuda:0) in every rank,
  before the cell picks its own: N CUDA contexts on GPU 0. The cell moves it where it belongs.

Imported by the worker in every rank: torch is looked up, never imported here.
"""

from __future__ import annotations

import io
import pickle
import sys
from typing import Any

__all__ = ["dumps"]


def dumps(obj: Any) -> bytes:
    buf = io.BytesIO()
    _pickler(buf).dump(obj)
    return buf.getvalue()


def _identity(x: Any) -> Any:
    return x


def _pickler(buf: io.BytesIO) -> pickle.Pickler:
    import cloudpickle

    class CpuPickler(cloudpickle.Pickler):
        def reducer_override(self, obj: Any) -> Any:
            torch = sys.modules.get("torch")
            if (
                torch is not None
                and isinstance(obj, torch.Tensor)
                and obj.device.type not in ("cpu", "meta")  # a meta tensor has no data to move
            ):
                cpu = obj.detach().cpu()
                if isinstance(obj, torch.nn.Parameter):
                    return torch.nn.Parameter, (cpu, obj.requires_grad)
                return _identity, (cpu.requires_grad_(obj.requires_grad),)
            return super().reducer_override(obj)

    return CpuPickler(buf, protocol=pickle.HIGHEST_PROTOCOL)
