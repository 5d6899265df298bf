"""Where this user's supervisors are: each registers itself beside its socket in the owner-only
runtime directory (`sup-KERNELPID-HEX.json`) and removes the file when it exits; the server
extension (elastic_nb.server) reads them. A registration whose pid is gone (a SIGKILLed
supervisor) is stale, and removed by whoever finds it."""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path

__all__ = ["Registration", "find", "register"]


@dataclass(frozen=True)
class Registration:
    pid: int
    kernel_pid: int
    kernel_id: str | None  # Jupyter's id of the kernel: which notebook the jobs run for
    socket: str
    started: float


def register(reg: Registration) -> Path:
    """Write it beside its socket (atomically, owner-only); returns the file to remove at exit."""
    path = Path(reg.socket).with_suffix(".json")
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(reg)))
    tmp.chmod(0o600)
    tmp.replace(path)
    return path


def find(directory: Path) -> list[Registration]:
    """Every live supervisor registered in `directory`; stale registrations are removed."""
    found = []
    for path in sorted(directory.glob("sup-*.json")):
        try:
            reg = Registration(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            continue  # not one of ours, or from another version: not ours to judge
        if not _alive(reg.pid) or not Path(reg.socket).exists():
            with contextlib.suppress(OSError):
                path.unlink()
            continue
        found.append(reg)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie (exited, not yet reaped by its kernel) is gone too.
    with contextlib.suppress(OSError):
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return stat[stat.rfind(b")") + 2 : stat.rfind(b")") + 3] != b"Z"
    return True
