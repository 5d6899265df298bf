"""`python -m elastic_nb.launcher FD`: import torch once, then fork launchers on request.

Importing torch costs a launcher and its fork server about 1.5 s of CPU each; on a 2-core machine
a cell sent back to back (Run All) used to pay it, and two copies of torch sat in memory for the
warm pair. The zygote imports what a launcher needs once and then only waits: each launcher is a
fork of it (milliseconds), and its fork server a fork of that launcher (agent.py), so the three
share torch's pages.

It never starts a thread of its own (importing torch starts one native thread, which a fork does
not copy; the fork server has always forked ranks with it) and holds no lock while it forks, so
a fork is as safe here as the fork server's.

The supervisor talks to it over a SOCK_SEQPACKET socket (FD): a request is the launcher's
environment as JSON with three descriptors (the launcher's stdin, its stdout pipe to the
supervisor, its log); the reply is the launcher's pid. Each launcher is forked twice over, so
that it is orphaned at once and becomes the supervisor's child (the supervisor is a subreaper):
the supervisor waits for it, signals its process group and reaps it as it did the launchers it
started itself. The zygote's parent-death signal ends it with the supervisor.
"""

from __future__ import annotations

import array
import contextlib
import ctypes
import gc
import json
import os
import signal
import socket
import sys
import time
from typing import Any

from elastic_nb.common import modules
from elastic_nb.launcher.forked import run_then_exit

_PR_SET_PDEATHSIG = 1
_FDS = 3  # the launcher's stdin, stdout (the protocol pipe) and stderr (its log)
_MAX_REQUEST = 1 << 22  # an environment, as JSON
REPARENT_TIMEOUT_S = 5.0

# What every launcher imports (agent.main and the torch modules elastic_launch loads for a
# single-node c10d job), imported here once for all of them.
PRELOAD = (
    "torch",
    "torch.distributed",
    "torch.distributed.launcher.api",
    "torch.distributed.elastic.multiprocessing",
    "torch.distributed.elastic.multiprocessing.errors",
    "torch.distributed.elastic.rendezvous.dynamic_rendezvous",
    "torch.distributed.elastic.rendezvous.c10d_rendezvous_backend",
    "torch.distributed.elastic.rendezvous.static_tcp_rendezvous",
    "torch.distributed.elastic.agent.server.local_elastic_agent",
    modules.LAUNCHER_AGENT,
    modules.RANK_BOOTSTRAP,
    modules.RANK_SESSION_LOOP,
)


def main(fd: int) -> None:
    supervisor = os.getppid()
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != supervisor or str(supervisor) != os.environ.get("ELASTIC_NB_SUPERVISOR_PID"):
        sys.exit(1)  # the supervisor died before the signal was armed
    sock = socket.socket(fileno=fd)
    import importlib

    for name in PRELOAD:
        with contextlib.suppress(ImportError):  # a module another torch lays out elsewhere
            importlib.import_module(name)
    # What torch allocated lives as long as every launcher: out of the collector's way. Else a
    # full collection walks it in the launcher, wherever the job's allocations happen to
    # trigger one: about 80 ms inside the rendezvous, measured (P1), and the pages it writes
    # are copied out of the zygote's.
    gc.collect()
    gc.freeze()
    sys.stdout.flush()
    sys.stderr.flush()
    sock.send(json.dumps({"ready": os.getpid()}).encode())
    while True:
        try:
            data, fds = _receive(sock)
        except (ConnectionError, OSError):
            return
        if not data:
            return  # the supervisor closed its end: no more launchers
        try:
            pid = _fork_launcher(sock, json.loads(data), fds, supervisor)
            reply: dict[str, Any] = {"pid": pid}
        except Exception as e:
            reply = {"error": f"{type(e).__name__}: {e}"}
        finally:
            for f in fds:
                os.close(f)
        sock.send(json.dumps(reply).encode())


def _receive(sock: socket.socket) -> tuple[bytes, list[int]]:
    fds = array.array("i")
    data, ancdata, _, _ = sock.recvmsg(_MAX_REQUEST, socket.CMSG_LEN(_FDS * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return data, list(fds)


def _fork_launcher(
    sock: socket.socket, env: dict[str, str], fds: list[int], supervisor: int
) -> int:
    if len(fds) != _FDS:
        raise ValueError(f"expected {_FDS} descriptors, got {len(fds)}")
    read, write = os.pipe()
    middle = os.fork()
    if middle == 0:  # the intermediate: fork the launcher, tell its pid, and go
        try:
            os.close(read)
            launcher = os.fork()
            if launcher == 0:
                os.close(write)
                run_then_exit(lambda: _become_launcher(sock, env, fds, supervisor))
            os.write(write, str(launcher).encode())
        finally:
            os._exit(0)
    os.close(write)
    try:
        with os.fdopen(read, "rb") as f:
            answer = f.read()
    finally:
        os.waitpid(middle, 0)
    if not answer:
        raise RuntimeError("the launcher's fork failed")
    return int(answer)


def _become_launcher(
    sock: socket.socket, env: dict[str, str], fds: list[int], supervisor: int
) -> None:
    """In the launcher: its own session and descriptors, its environment, then agent.main."""
    sock.close()
    os.setsid()  # its process group is the job's: the teardown signals it as a whole
    for target, f in enumerate(fds):
        if f != target:
            os.dup2(f, target)
            os.close(f)
    # Orphaned when the intermediate exits, adopted by the supervisor (a subreaper): wait for
    # it, so that the parent-death signal agent.main arms follows the supervisor.
    deadline = time.monotonic() + REPARENT_TIMEOUT_S
    while os.getppid() != supervisor:
        if time.monotonic() > deadline:
            raise RuntimeError("the supervisor did not adopt this launcher")
        time.sleep(0.001)
    os.environ.clear()
    os.environ.update(env)
    sys.argv = [sys.argv[0]]
    if env.get(modules.ROLE_ENV) == modules.STORE_ROLE:
        from elastic_nb.launcher.store_host import main as launcher_main
    else:
        from elastic_nb.launcher.torch_agent import main as launcher_main
    launcher_main()
