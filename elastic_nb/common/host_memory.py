"""This machine's memory as the kernel counts it for a process: its resident memory, its memory
cgroup's limit and use (or the machine's), and the OOM killer's kills there. What the memory
watch samples each second and a join agent reads for its ranks; no process is touched.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from pathlib import Path

__all__ = ["MemoryLimit", "memory_limit", "oom_kills", "rss"]

# Where the kernel shows processes and cgroups (the tests point these at trees of their own).
PROC = "/proc"
CGROUP = "/sys/fs/cgroup"


def _memory_cgroups(pid: int | str) -> list[tuple[int, Path, Path]]:
    """The memory cgroups of a process, (version, its hierarchy's root, its directory): v2's
    unified hierarchy (mounted at /sys/fs/cgroup, or /sys/fs/cgroup/unified beside v1), v1's
    memory controller."""
    try:
        with open(f"{PROC}/{pid}/cgroup") as f:
            groups = [line.strip().split(":", 2) for line in f]
    except OSError:
        return []
    found: list[tuple[int, Path, Path]] = []
    for fields in groups:
        if len(fields) != 3:
            continue
        hierarchy, controllers, path = fields
        if hierarchy == "0" and not controllers:
            for root in (CGROUP, f"{CGROUP}/unified"):
                d = Path(root + path)
                if (d / "memory.max").exists() or (d / "memory.events").exists():
                    found.append((2, Path(root), d))
                    break
        elif "memory" in controllers.split(","):
            found.append((1, Path(f"{CGROUP}/memory"), Path(f"{CGROUP}/memory{path}")))
    return found


def oom_kills(pid: int | str = "self") -> int | None:
    """How many processes the kernel's OOM killer has ended in `pid`'s memory cgroup (v2
    memory.events, or v1 memory.oom_control); None where neither is readable. Never the
    machine-wide count: an unrelated OOM kill elsewhere must not relabel a rank's SIGKILL.
    Compare two readings."""
    for version, _, d in _memory_cgroups(pid):
        name = d / ("memory.events" if version == 2 else "memory.oom_control")
        with contextlib.suppress(OSError, ValueError, StopIteration), open(name) as f:
            return next(int(line.split()[1]) for line in f if line.startswith("oom_kill "))
    return None


_PAGE = os.sysconf("SC_PAGE_SIZE")
_UNLIMITED = 1 << 62  # v1 says "no limit" with a number near 2**63 (rounded to pages)


def rss(pid: int) -> int | None:
    """A process's resident memory in bytes, from /proc/PID/statm; None once it is gone, and
    while it goes: an exiting process, its memory released but not yet reaped (a zombie), reads
    all zeros, and a sample of 0 bytes would end a rank's curve, and its growth, in a fall."""
    try:
        with open(f"{PROC}/{pid}/statm") as f:
            pages = int(f.read().split()[1])
    except (OSError, IndexError, ValueError):
        return None
    return pages * _PAGE if pages else None


@dataclass(frozen=True)
class MemoryLimit:
    """What bounds a process's memory, and how much of that is used (bytes)."""

    used: int
    limit: int
    what: str  # "its cgroup's memory.max (/path)", or "this machine's memory"


def memory_limit(pid: int | str = "self") -> MemoryLimit | None:
    """The tightest bound on `pid`'s memory: its memory cgroup's limit, or an ancestor's (v2
    memory.max, v1 memory.limit_in_bytes), with what that cgroup uses less the page cache the
    kernel would drop first (inactive_file: the working set, as the kubelet counts it); the
    machine's memory (total less available) where no cgroup sets one. None if nothing can be
    read. Tightest: the least room left, not the smallest limit (an ancestor's larger limit
    that its other children nearly fill is reached first)."""
    best: MemoryLimit | None = None
    for version, root, d in _memory_cgroups(pid):
        if version == 2:
            names = ("memory.max", "memory.current", "inactive_file")
        else:
            names = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
        limit_file, usage_file, inactive = names
        for group in [d, *d.parents]:
            if not group.is_relative_to(root):
                break
            with contextlib.suppress(OSError, ValueError):
                text = (group / limit_file).read_text().strip()
                limit = _UNLIMITED if text == "max" else int(text)
                if limit >= _UNLIMITED:
                    continue
                used = max(int((group / usage_file).read_text()) - _stat(group, inactive), 0)
                if best is None or limit - used < best.limit - best.used:
                    name = f"/{group.relative_to(root)}" if group != root else "/"
                    best = MemoryLimit(used, limit, f"its cgroup's {limit_file} ({name})")
    if best is not None:
        return best
    try:
        with open(f"{PROC}/meminfo") as f:
            info = {k: int(v.split()[0]) * 1024 for k, v in (line.split(":", 1) for line in f)}
        return MemoryLimit(
            info["MemTotal"] - info["MemAvailable"], info["MemTotal"], "this machine's memory"
        )
    except (OSError, KeyError, ValueError):
        return None


def _stat(group: Path, key: str) -> int:
    """One figure of a cgroup's memory.stat (0 if it is not there)."""
    with contextlib.suppress(OSError, ValueError):
        for line in (group / "memory.stat").read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    return 0
