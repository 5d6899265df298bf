"""multiprocessing's fork server (and resource tracker) as forks of the launcher, not new
interpreters.

The launcher is a fork of the zygote, torch already imported: a fork server started the standard
way (a fresh `python -c "from multiprocessing.forkserver import main; ..."`) would import torch
again, about 1.5 s of CPU, and hold a second copy of it. multiprocessing starts both helpers
through `util.spawnv_passfds(exe, [exe, *flags, "-c", CMD], fds)`; while the fork server starts
(`ensure_running`), that function forks instead and runs CMD in the child, which keeps only the
descriptors multiprocessing passes, as an exec would. Everything else ensure_running does (the
listener, the alive pipe, the bookkeeping torch's forkserver start method relies on) stays the
standard library's, whatever its version.
"""

from __future__ import annotations

import contextlib
import multiprocessing.forkserver
import multiprocessing.resource_tracker
import multiprocessing.util
import os
import sys
import threading
from collections.abc import Sequence
from typing import Any

from elastic_nb.launcher.forked import run_then_exit

__all__ = ["start"]

_SPAWN = multiprocessing.util.spawnv_passfds


def start(preload: list[str]) -> None:
    """ensure_running(), with the helpers forked from this process."""
    multiprocessing.set_forkserver_preload(preload)
    multiprocessing.util.spawnv_passfds = _fork_passfds
    try:
        multiprocessing.forkserver.ensure_running()
    finally:
        multiprocessing.util.spawnv_passfds = _SPAWN


def _fork_passfds(path: Any, args: Sequence[Any], passfds: Sequence[int]) -> int:
    # typeshed says bytes and ints; multiprocessing passes sys.executable and strings
    if len(args) < 2 or args[-2] != "-c":  # not the form this module knows: exec, as usual
        return _SPAWN(path, args, passfds)
    pid = os.fork()
    if pid:
        return pid
    # (its buffers are the launcher's, written there already: not flushed a second time)
    run_then_exit(lambda: _helper(args[-1], passfds), flush=False)


def _helper(command: str, passfds: Sequence[int]) -> None:
    """In the forked helper: its descriptors and locks as an exec would leave them, then its
    command."""
    _keep_only(set(map(int, passfds)))
    # The launcher points sys.stdout at stderr (agent.main); torch redirects a rank's stdout
    # through sys.stdout.fileno() (elastic/multiprocessing/redirects.py): fd 1 again.
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    # Forked inside ensure_running: the helpers' locks are held in this copy, and a rank
    # that starts a helper of its own (a DataLoader's semaphores) would wait on them forever.
    owners: tuple[Any, ...] = (
        multiprocessing.forkserver._forkserver,
        multiprocessing.resource_tracker._resource_tracker,
    )
    for owner in owners:
        reentrant = isinstance(owner._lock, type(threading.RLock()))
        owner._lock = threading.RLock() if reentrant else threading.Lock()
    exec(command, {"__name__": "__mp_helper__"})


def _keep_only(keep: set[int]) -> None:
    """Close every descriptor above stderr that multiprocessing did not pass (the launcher's
    protocol pipe among them: the supervisor reads its EOF as the launcher's exit)."""
    for name in os.listdir("/proc/self/fd"):
        fd = int(name)
        if fd > 2 and fd not in keep:
            with contextlib.suppress(OSError):
                os.close(fd)
