"""How many GPUs a rank would see, for `--nproc gpu|auto`, counted without initialising CUDA here.

The kernel must never hold a CUDA context: it would pin GPU memory for the kernel's lifetime, and a
process that has initialised CUDA cannot hand CUDA to a child it forks. So the count comes from
NVML (common/nvml.py: the driver's management library, which creates no context), read with CUDA's rules for
`CUDA_VISIBLE_DEVICES`, the same rules torch.cuda applies on its own NVML path:

- unset: every GPU; an empty value: none;
- ordinals: the list stops at the first entry that is not a number, is negative, or names no
  GPU ("0,1,-1,2" is two GPUs, "0,7" on a 2-GPU machine is one); a repeated ordinal hides all;
- `GPU-` UUIDs (or unique prefixes of them): the list stops at the first that matches none; an
  ambiguous prefix ends it too; a repeat hides all.

MIG is what those rules cannot answer: how CUDA enumerates MIG devices (one per process, or
several) depends on the driver. When the variable names MIG devices, or a visible GPU has MIG
mode on, CUDA itself counts them in a throwaway process given the job's environment.
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Callable, Mapping

from elastic_nb.common import nvml
from elastic_nb.common.nvml import Gpu

CUDA_COUNT_TIMEOUT_S = 60.0  # cuInit on a GPU without persistence mode can take many seconds


def visible_gpu_count(
    env: Mapping[str, str] | None = None,
    *,
    gpus: Callable[[], list[Gpu] | None] | None = None,
    cuda_count: Callable[[Mapping[str, str]], int] | None = None,
) -> int:
    """The number of CUDA devices a process with `env` would see (0 without an NVIDIA driver).

    `gpus` and `cuda_count` default to NVML and a throwaway CUDA process; tests pass stand-ins.
    """
    env = os.environ if env is None else env
    wanted = parse_visible_devices(env.get("CUDA_VISIBLE_DEVICES"))
    if wanted == []:
        return 0
    if any(isinstance(w, str) and w.startswith("MIG-") for w in wanted or ()):
        return (cuda_count or _count_with_cuda)(env)
    found = (gpus or nvml_gpus)()
    if not found:
        return 0
    if wanted is None:
        chosen = list(range(len(found)))
    elif isinstance(wanted[0], str):
        chosen = _uuids_to_ordinals([str(w) for w in wanted], [g.uuid for g in found])
    else:
        chosen = [int(w) for w in _until_out_of_range(wanted, len(found))]
    if any(found[i].mig for i in chosen):
        return (cuda_count or _count_with_cuda)(env)
    return len(chosen)


def parse_visible_devices(value: str | None) -> list[int] | list[str] | None:
    """`CUDA_VISIBLE_DEVICES` as CUDA reads it, before looking at the GPUs (None: unset, all)."""
    if value is None:
        return None
    if value.startswith(("GPU-", "MIG-")):
        prefix = value[:4]
        uuids: list[str] = []
        for entry in value.split(","):
            if entry in uuids:
                return []
            if not entry.startswith(prefix):
                break
            uuids.append(entry)
        return uuids
    ordinals: list[int] = []
    for entry in value.split(","):
        n = _leading_number(entry.strip())
        if n in ordinals:
            return []
        if n < 0:
            break
        ordinals.append(n)
    return ordinals


def _leading_number(text: str) -> int:
    """What C's strtoul reads from the start of `text` (an optional sign, then digits); -1 if none."""
    digits = text[1:] if text[:1] in "+-" else text
    end = 0
    while end < len(digits) and digits[end].isdigit():
        end += 1
    if end == 0:
        return -1
    n = int(digits[:end])
    return -n if text.startswith("-") else n


def _until_out_of_range(ordinals: list, count: int) -> list:
    for i, n in enumerate(ordinals):
        if n >= count:
            return ordinals[:i]
    return ordinals


def _uuids_to_ordinals(candidates: list[str], uuids: list[str]) -> list[int]:
    chosen: list[int] = []
    for candidate in candidates:
        matches = [i for i, uuid in enumerate(uuids) if uuid.startswith(candidate)]
        if len(matches) != 1:
            break
        if matches[0] in chosen:
            return []
        chosen.append(matches[0])
    return chosen


def nvml_gpus() -> list[Gpu] | None:
    """Every GPU the driver knows, from NVML; None when there is no NVIDIA driver."""
    return nvml.gpus()


_CUDA_COUNT = """
import ctypes
cuda = ctypes.CDLL("libcuda.so.1")
n = ctypes.c_int(0)
rc = cuda.cuInit(0)
if rc == 0:
    rc = cuda.cuDeviceGetCount(ctypes.byref(n))
print(n.value if rc == 0 else (0 if rc == 100 else -rc))  # 100: CUDA_ERROR_NO_DEVICE
"""


def _count_with_cuda(env: Mapping[str, str]) -> int:
    """Ask the CUDA driver in a throwaway process (never in the kernel), with the job's env."""
    try:
        done = subprocess.run(
            [sys.executable, "-c", _CUDA_COUNT],
            env=dict(env),
            capture_output=True,
            text=True,
            timeout=CUDA_COUNT_TIMEOUT_S,
        )
        n = int(done.stdout.strip())
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return 0
    return max(n, 0)
