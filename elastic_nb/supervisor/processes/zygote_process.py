"""The supervisor's side of the zygote (launcher/zygote.py): start it, wait until it has imported
torch, ask it for launchers, end it.

A launcher forked by the zygote is the supervisor's child (adopted: the supervisor is a
subreaper), but not a `subprocess.Popen`: `ForkedProcess` gives the teardown and the pool the
part of Popen's interface they use, over waitpid.
"""

from __future__ import annotations

import array
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Any

import anyio

from elastic_nb.common import modules

__all__ = ["ForkedProcess", "Zygote", "ZygoteFailed", "log_tail"]

FORK_TIMEOUT_S = 10.0  # a fork is milliseconds: this only bounds a zygote that stopped answering
_MAX_REPLY = 1 << 16


class ZygoteFailed(RuntimeError):
    """The zygote could not give a launcher (it died, or the fork failed)."""


class ForkedProcess:
    """A child of ours we did not start through subprocess: its pid, and its pipes."""

    def __init__(self, pid: int, stdin: IO[bytes], stdout: IO[bytes]) -> None:
        self.pid = pid
        self.stdin: IO[bytes] | None = stdin
        self.stdout: IO[bytes] | None = stdout
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:  # reaped elsewhere: as subprocess.Popen does, call it 0
                pid, status = self.pid, 0
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while (code := self.poll()) is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout or 0)
            time.sleep(0.005)
        return code


class Child:
    """A process of ours (a zygote, a launcher): its pid and whether it lives, from `proc`."""

    proc: ForkedProcess | subprocess.Popen[bytes]

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None


class Zygote(Child):
    """One zygote process, started with the environment its launchers' interpreters need (what
    is read at process start: `start_key`)."""

    def __init__(
        self, env: dict[str, str], start_key: tuple[str | None, ...], log_path: Path
    ) -> None:
        self.start_key = start_key
        self.log_path = log_path
        self.ready = False
        self._settled = anyio.Event()  # ready, or failed: `failure` says why
        self.failure: str | None = None
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            with open(log_path, "ab") as log:
                # Its own session: no job's teardown signals it. Started from the supervisor's
                # main thread: its parent-death signal follows that thread.
                self.proc = subprocess.Popen(
                    [sys.executable, "-m", modules.LAUNCHER, str(theirs.fileno())],
                    pass_fds=[theirs.fileno()],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    env=env,
                    start_new_session=True,
                )
        finally:
            theirs.close()

    async def read_ready(self) -> None:
        """Its first message, once it has imported torch (the pool's task, one per zygote)."""
        try:
            while not self.ready and self.failure is None:
                await anyio.wait_readable(self._sock)
                try:
                    reply = self._sock.recv(_MAX_REPLY, socket.MSG_DONTWAIT)
                except BlockingIOError:
                    continue
                if not reply:
                    self.failure = (
                        f"the zygote exited before it was ready: {log_tail(self.log_path)}"
                    )
                else:
                    self.ready = "ready" in json.loads(reply)
        except (OSError, anyio.ClosedResourceError) as e:
            self.failure = self.failure or f"the zygote's socket failed: {e}"
        finally:
            self._settled.set()

    async def wait_ready(self) -> None:
        """Until it has imported torch; raises ZygoteFailed if it died or was closed first."""
        await self._settled.wait()
        if not self.ready:
            raise ZygoteFailed(self.failure or "the zygote is not ready")

    def fork(self, env: dict[str, str], stdin: int, stdout: int, stderr: int) -> int:
        """A launcher, forked with this environment and these descriptors as its 0, 1, 2;
        returns its pid, by then our child. Blocking (milliseconds), so that no task runs
        between the launcher's adoption and its caller knowing its pid (teardowns end the
        children they do not know)."""
        if not self.ready:
            raise ZygoteFailed("the zygote is not ready")
        fds = array.array("i", [stdin, stdout, stderr])
        try:
            self._sock.settimeout(FORK_TIMEOUT_S)
            self._sock.sendmsg(
                [json.dumps(env).encode()], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, fds)]
            )
            reply = self._sock.recv(_MAX_REPLY)
        except OSError as e:
            raise ZygoteFailed(f"the zygote did not answer ({e}): {log_tail(self.log_path)}") from e
        finally:
            self._sock.settimeout(None)
        if not reply:
            raise ZygoteFailed(f"the zygote exited: {log_tail(self.log_path)}")
        answer: dict[str, Any] = json.loads(reply)
        if "pid" not in answer:
            raise ZygoteFailed(f"the zygote could not fork a launcher: {answer.get('error')}")
        return int(answer["pid"])

    def close(self) -> None:
        """End it (it holds torch's memory) and reap it; its launchers live on."""
        if not self._settled.is_set():
            self.failure = "the zygote was ended before it was ready"
            self._settled.set()
        with contextlib.suppress(RuntimeError):  # no event loop: nobody waits on the socket
            anyio.notify_closing(self._sock)
        with contextlib.suppress(OSError):
            self._sock.close()
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        with contextlib.suppress(OSError):
            self.log_path.unlink()


def log_tail(path: Path, n: int = 5) -> str:
    with contextlib.suppress(OSError):
        return " | ".join(path.read_text(errors="replace").splitlines()[-n:]) or "no output"
    return "no log"
