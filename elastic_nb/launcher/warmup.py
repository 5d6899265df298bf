"""What a launcher's fork server imports once, before any job, for every rank it will fork.

The fork server (multiprocessing's, started by the launcher while it waits for a job) imports
this module; each rank is a fork of that server, so torch, torch.distributed, the worker
bootstrap and the ``--preload`` modules are already in it. Importing torch does not touch
CUDA, so forking afterwards is safe; a ``--preload`` module that initialises CUDA at import
would not be, and must not be preloaded.

`PID` tells a rank whether it inherited this module (a fork) or imported it itself; `CUDA_BY`
names the preload after which CUDA was initialised here, if one was (the rank then refuses to
run: a process forked after CUDA's initialisation cannot use CUDA).
"""

from __future__ import annotations

import gc
import importlib
import json
import os
import sys

from elastic_nb.common import modules

__all__ = ["CUDA_BY", "FAILED", "IMPORTED", "PID"]

PID = os.getpid()
IMPORTED: list[str] = []
FAILED: dict[str, str] = {}  # module -> the error its import raised (reported by the ranks)
CUDA_BY: str | None = None

# A preloaded module that asks torch.cuda.is_available() at import must not initialise CUDA
# here: with this, torch answers from NVML (torch/cuda/__init__.py, _nvml_based_avail). Ranks
# adopt their job's environment, so it stays the server's.
_NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK" not in os.environ
os.environ.setdefault("PYTORCH_NVML_BASED_CUDA_CHECK", "1")

_ALWAYS = ("torch", "torch.distributed", modules.RANK_BOOTSTRAP, modules.RANK_SESSION_LOOP)


def _preload() -> None:
    global CUDA_BY
    # The kernel's sys.path, so that the notebook's own modules can be preloaded too.
    extra = json.loads(os.environ.get("ELASTIC_NB_SYS_PATH") or "[]")
    sys.path[:0] = [p for p in extra if p not in sys.path]
    for name in (*_ALWAYS, *json.loads(os.environ.get("ELASTIC_NB_PRELOAD") or "[]")):
        try:
            importlib.import_module(name)
            IMPORTED.append(name)
        except BaseException as e:  # multiprocessing would swallow it: keep it for the ranks
            FAILED[name] = f"{type(e).__name__}: {e}"
        cuda = sys.modules.get("torch.cuda")
        if CUDA_BY is None and getattr(cuda, "_initialized", False):
            CUDA_BY = name


_preload()
if _NVML_CHECK:
    del os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"]  # ours, for the imports: not the ranks'
# Everything imported so far lives as long as the ranks: out of the collector's way, so that its
# passes neither walk those objects nor write to (and so copy) the pages ranks share with us.
gc.freeze()
