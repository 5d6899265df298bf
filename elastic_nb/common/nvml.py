"""NVML, the NVIDIA driver's management library, read through ctypes: which GPUs the machine has,
how much memory each has and uses, and how much each process holds on them. It creates no CUDA
context (the kernel and the supervisor must never hold one: it pins GPU memory for their
lifetime, and a process that initialised CUDA cannot hand it to a child it forks). Everything
returns None (or nothing) where there is no NVIDIA driver.
"""

from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Any

__all__ = ["Gpu", "GpuMemory", "gpus", "memory", "names"]

_SUCCESS = 0
_INSUFFICIENT_SIZE = 7
_NOT_AVAILABLE = (1 << 64) - 1  # NVML_VALUE_NOT_AVAILABLE: a process whose usage NVML cannot see


@dataclass(frozen=True)
class Gpu:
    uuid: str  # "GPU-…", as NVML names it
    mig: bool  # MIG mode currently enabled


@dataclass(frozen=True)
class GpuMemory:
    """The machine's GPUs' memory now: each device's total and used bytes, and what each process
    holds (its CUDA context and NCCL's buffers included: what torch's allocator does not count)."""

    total: dict[int, int]  # device index -> bytes
    used: dict[int, int]
    by_pid: dict[int, tuple[int, int]]  # pid -> (device index, bytes)


class _Memory(ctypes.Structure):
    _fields_ = [
        ("total", ctypes.c_ulonglong),
        ("free", ctypes.c_ulonglong),
        ("used", ctypes.c_ulonglong),
    ]


class _Process(ctypes.Structure):  # nvmlProcessInfo_v2_t (the _v3 and _v2 calls take it)
    _fields_ = [
        ("pid", ctypes.c_uint),
        ("usedGpuMemory", ctypes.c_ulonglong),
        ("gpuInstanceId", ctypes.c_uint),
        ("computeInstanceId", ctypes.c_uint),
    ]


_lib: Any = None
_lock = threading.Lock()


def _nvml() -> Any:
    """The library, initialised once for the process's life (a reading every second must not
    pay for nvmlInit each time); None without a driver."""
    global _lib
    with _lock:
        if _lib is None:
            try:
                lib = ctypes.CDLL("libnvidia-ml.so.1")
            except OSError:
                _lib = False
                return None
            _lib = lib if lib.nvmlInit_v2() == _SUCCESS else False
        return _lib or None


def _handles(nvml: Any) -> list[Any] | None:
    count = ctypes.c_uint(0)
    if nvml.nvmlDeviceGetCount_v2(ctypes.byref(count)) != _SUCCESS:
        return None
    handles = []
    for index in range(count.value):
        handle = ctypes.c_void_p()
        if nvml.nvmlDeviceGetHandleByIndex_v2(index, ctypes.byref(handle)) != _SUCCESS:
            return None
        handles.append(handle)
    return handles


def gpus() -> list[Gpu] | None:
    """Every GPU the driver knows; None when there is no NVIDIA driver."""
    nvml = _nvml()
    handles = _handles(nvml) if nvml else None
    if handles is None:
        return None
    found = []
    for handle in handles:
        buf = ctypes.create_string_buffer(96)
        if nvml.nvmlDeviceGetUUID(handle, buf, len(buf)) != _SUCCESS:
            return None
        current, pending = ctypes.c_uint(0), ctypes.c_uint(0)
        # NVML_ERROR_NOT_SUPPORTED on GPUs without MIG: mode stays 0 (disabled).
        nvml.nvmlDeviceGetMigMode(handle, ctypes.byref(current), ctypes.byref(pending))
        found.append(Gpu(uuid=buf.value.decode("ascii"), mig=current.value == 1))
    return found


def names() -> list[str]:
    """Every GPU's product name ("NVIDIA H100 80GB HBM3"), in NVML's order; [] without a
    driver."""
    nvml = _nvml()
    handles = _handles(nvml) if nvml else None
    found = []
    for handle in handles or []:
        buf = ctypes.create_string_buffer(96)
        if nvml.nvmlDeviceGetName(handle, buf, len(buf)) == _SUCCESS:
            found.append(buf.value.decode("utf-8", "replace"))
    return found


def memory() -> GpuMemory | None:
    """Every GPU's memory and every process's share of it, now; None without a driver."""
    nvml = _nvml()
    handles = _handles(nvml) if nvml else None
    if not handles:
        return None
    total: dict[int, int] = {}
    used: dict[int, int] = {}
    by_pid: dict[int, tuple[int, int]] = {}
    running = getattr(nvml, "nvmlDeviceGetComputeRunningProcesses_v3", None) or getattr(
        nvml, "nvmlDeviceGetComputeRunningProcesses_v2", None
    )
    for index, handle in enumerate(handles):
        info = _Memory()
        if nvml.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(info)) == _SUCCESS:
            total[index], used[index] = int(info.total), int(info.used)
        if running is None:
            continue
        count = ctypes.c_uint(0)
        rc = running(handle, ctypes.byref(count), None)  # how many, first
        if rc not in (_SUCCESS, _INSUFFICIENT_SIZE) or not count.value:
            continue
        count = ctypes.c_uint(count.value + 8)  # room for processes that start meanwhile
        procs = (_Process * count.value)()
        if running(handle, ctypes.byref(count), procs) != _SUCCESS:
            continue
        for p in procs[: count.value]:
            if p.usedGpuMemory != _NOT_AVAILABLE:
                by_pid[int(p.pid)] = (index, int(p.usedGpuMemory))
    return GpuMemory(total, used, by_pid)
