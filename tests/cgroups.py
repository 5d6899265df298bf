"""A memory cgroup of the test's own (root only): a directory under cgroup v2's unified hierarchy
with the memory controller, or under v1's memory hierarchy. A kernel started with `prefix`
moves itself into it before it execs, so its supervisor and every rank run there too; the
directory is removed once its processes are gone."""

from __future__ import annotations

import contextlib
import os
import secrets
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

V2 = Path("/sys/fs/cgroup")
V1 = Path("/sys/fs/cgroup/memory")


@dataclass(frozen=True)
class MemoryCgroup:
    path: Path
    version: int

    @property
    def prefix(self) -> list[str]:
        """A command prefix that runs the rest of the command in this cgroup."""
        return ["sh", "-c", f'echo $$ > {self.path}/cgroup.procs && exec "$@"', "sh"]

    @property
    def limit_file(self) -> str:
        return "memory.max" if self.version == 2 else "memory.limit_in_bytes"

    @property
    def usage_file(self) -> str:
        return "memory.current" if self.version == 2 else "memory.usage_in_bytes"

    @property
    def inactive_key(self) -> str:
        return "inactive_file" if self.version == 2 else "total_inactive_file"

    def no_swap_line(self, limit: str) -> str:
        """A line of Python that keeps the group from swapping instead of being OOM-killed
        (`limit`: the name holding its memory limit), where the machine could swap."""
        if self.version == 2:
            name, value = "memory.swap.max", '"0"'
        else:
            name, value = "memory.memsw.limit_in_bytes", f"str({limit})"
        if not (self.path / name).exists():
            return "pass"
        return f"(cgroup / {name!r}).write_text({value})"


def _root() -> tuple[Path, int] | None:
    """Where a memory cgroup can be made here: v2's root with the memory controller, else v1's."""
    if "memory" in _read(V2 / "cgroup.controllers").split():
        return V2, 2
    if (V1 / "memory.limit_in_bytes").exists():
        return V1, 1
    return None


def unusable() -> str | None:
    """Why no memory cgroup can be made here, or None."""
    if os.geteuid() != 0:
        return "needs root to make a memory cgroup"
    root = _root()
    if root is None:
        return "no memory cgroup controller (v2 memory.max or v1 memory.limit_in_bytes)"
    if not os.access(root[0], os.W_OK):
        return f"{root[0]} is not writable here"
    if root[1] == 2 and "memory" not in _read(V2 / "cgroup.subtree_control").split():
        try:
            (V2 / "cgroup.subtree_control").write_text("+memory")
        except OSError as e:
            return f"cannot enable the memory controller for children of {V2}: {e}"
    return None


@contextlib.contextmanager
def memory_cgroup() -> Iterator[MemoryCgroup]:
    root = _root()
    assert root is not None, unusable()
    path = root[0] / f"elastic-nb-test-{secrets.token_hex(4)}"
    path.mkdir()
    try:
        yield MemoryCgroup(path, root[1])
    finally:
        # Its processes are gone by now (the kernel's shutdown waited for them); the kernel
        # removes an empty cgroup's directory on rmdir.
        deadline = time.monotonic() + 10
        while _read(path / "cgroup.procs").strip() and time.monotonic() < deadline:
            time.sleep(0.05)
        path.rmdir()


def _read(path: Path) -> str:
    try:
        return path.read_text()
    except OSError:
        return ""
