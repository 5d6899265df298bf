"""Where this user's supervisors are: each registers itself beside its socket in the owner-only
runtime directory (`sup-KERNELPID-HEX.json`) and removes the file when it exits; the server
extension (elastic_nb.server) reads them. `runtime_dir` is that directory: the kernel's client
binds its supervisor's socket there.

A registration is stale when its supervisor is gone without removing it (SIGKILL): its pid is
gone, a zombie, or now another process's (started after the registration was written), or its
socket refuses connections. Whoever finds one removes it, with the socket left beside it.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import psutil

__all__ = ["Registration", "find", "forget", "register", "runtime_dir"]

# psutil's create_time has a whole-second boot time under it: a process created this much after
# the registration was written cannot be the supervisor that wrote it.
_CLOCK_SLACK_S = 2.0


def runtime_dir() -> Path:
    """Owner-only directory for sockets: $XDG_RUNTIME_DIR/elastic_nb or /tmp/elastic_nb-UID."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isdir(base) and os.access(base, os.W_OK):
        path = Path(base) / "elastic_nb"
    else:
        path = Path(tempfile.gettempdir()) / f"elastic_nb-{os.getuid()}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = path.lstat()
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
        raise RuntimeError(f"{path} is not a directory owned by this user; refusing to use it")
    if st.st_mode & 0o077:
        path.chmod(0o700)
    return path


@dataclass(frozen=True)
class Registration:
    pid: int
    kernel_pid: int
    kernel_id: str | None  # Jupyter's id of the kernel: which notebook the jobs run for
    socket: str
    started: float  # time.time() when the supervisor started, after its process was created

    @property
    def path(self) -> Path:
        return Path(self.socket).with_suffix(".json")


def register(reg: Registration) -> Path:
    """Write it beside its socket (atomically, owner-only); returns the file to remove at exit."""
    tmp = reg.path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(reg)))
    tmp.chmod(0o600)
    tmp.replace(reg.path)
    return reg.path


def find(directory: Path) -> list[Registration]:
    """Every supervisor registered in `directory` whose process lives; the stale are removed."""
    found = []
    for path in sorted(directory.glob("sup-*.json")):
        try:
            reg = Registration(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue  # not one of ours, or from another version: not ours to judge
        if reg.path != path:
            continue
        if not _alive(reg) or not Path(reg.socket).exists():
            forget(reg)
            continue
        found.append(reg)
    return found


def forget(reg: Registration) -> None:
    """Remove a stale registration and its socket: nothing listens on it any more."""
    for path in (reg.path, Path(reg.socket)):
        with contextlib.suppress(OSError):
            path.unlink()


def _alive(reg: Registration) -> bool:
    try:
        p = psutil.Process(reg.pid)
        if p.status() == psutil.STATUS_ZOMBIE:  # exited, not yet reaped by its kernel
            return False
        return bool(p.create_time() <= reg.started + _CLOCK_SLACK_S)
    except psutil.NoSuchProcess:
        return False
    except psutil.AccessDenied:
        return True
