"""One launcher process, from its fork (by the zygote) to the end of the job it is given: its
pipe to the supervisor, its readiness, its agent's ticks and elastic_launch's result.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import subprocess
import time
from pathlib import Path

import anyio

from elastic_nb import protocol
from elastic_nb.common import procs, report
from elastic_nb.supervisor.processes.site import Work
from elastic_nb.supervisor.processes.zygote_process import Child, ForkedProcess, Zygote

__all__ = ["Launcher"]


class Launcher(Child):
    """One launcher process, from its start to the job it is given."""

    proc: ForkedProcess  # a fork of a zygote

    def __init__(
        self, zygote: Zygote, env: dict[str, str], preload: tuple[str, ...], log_path: Path
    ) -> None:
        self.preload = preload
        self.sys_path = tuple(json.loads(env.get("ELASTIC_NB_SYS_PATH") or "[]"))
        self.start_key = zygote.start_key
        self.log_path = log_path
        self.decoder = protocol.wire.FrameDecoder()
        self.ready = False
        self.started = time.time()
        self.job: str | None = None  # who it was handed to
        self.last_tick: float | None = None  # its agent's monitor loop, last heard (monotonic)
        self.result: protocol.launcher.Result | None = (
            None  # what elastic_launch returned or raised
        )
        self.closed = anyio.Event()  # its pipe reached EOF: the launcher is exiting
        self.discarded = False  # ended by us while idle, not died
        # One reader of the pipe for the launcher's life (`read`); the job that takes it
        # receives its messages from this stream.
        self._forward, self.messages = anyio.create_memory_object_stream[
            protocol.launcher.LauncherNews
        ](math.inf)
        self._heard = _Heard(self)
        stdin_r, stdin_w = os.pipe()
        stdout_r, stdout_w = os.pipe()
        try:
            with open(log_path, "ab") as log:
                pid = zygote.fork(
                    {**env, "ELASTIC_NB_LAUNCHER_LOG": str(log_path)},
                    stdin_r,
                    stdout_w,
                    log.fileno(),
                )
        except BaseException:
            os.close(stdin_w)
            os.close(stdout_r)
            raise
        finally:
            os.close(stdin_r)
            os.close(stdout_w)
        # The launcher, its fork server and every rank are one process group (the launcher's
        # own session) that the job's teardown signals as a whole.
        self.proc = ForkedProcess(pid, os.fdopen(stdin_w, "wb"), os.fdopen(stdout_r, "rb"))
        assert self.proc.stdout is not None
        os.set_blocking(self.proc.stdout.fileno(), False)

    async def read(self) -> None:
        """Read its pipe until EOF (the launcher is exiting). READY marks it ready, TICK is
        kept as `last_tick`, RESULT as `result`; the rest, once a job has it, goes to
        `messages`, which ends at EOF."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        try:
            while True:
                await anyio.wait_readable(fd)
                try:
                    data = os.read(fd, 1 << 16)
                except BlockingIOError:
                    continue
                if not data:
                    return
                for frame, _ in self.decoder.feed(data):
                    protocol.launcher.hear(protocol.launcher.launcher_news(frame), self._heard)
        finally:
            self._forward.close()
            self.proc.stdout.close()
            self.closed.set()

    async def exited(self) -> int:
        """Wait for the process to end (its pidfd), reap it, and return its status."""
        fd = procs.pidfd_open(self.pid)
        if fd is not None:
            try:
                await anyio.wait_readable(fd)
            finally:
                os.close(fd)
        while (code := self.proc.poll()) is None:  # no pidfd: an old kernel
            await anyio.sleep(0.02)
        return code

    def assign(self, work: Work, run_dir: str) -> bytes:
        """Make it the group's; returns the assignment for the caller to write (off the loop:
        an environment can be larger than a pipe's buffer). The ranks get the group's
        environment, marked with its id (procs.MARKER: how its processes are found)."""
        job_id = self.job = work.group
        env = {**work.env, procs.MARKER: job_id, "ELASTIC_NB_SUPERVISOR_PID": str(os.getpid())}
        if "matplotlib_inline" in env.get("MPLBACKEND", ""):
            env["MPLBACKEND"] = "Agg"  # the kernel's inline backend means nothing in a rank
        line = protocol.launcher.Assignment(job=job_id, run_dir=run_dir, env=env, round=work.plan)
        return json.dumps(line).encode() + b"\n"

    def outcome(self, log: Path) -> tuple[str, str]:
        """How the job ends by the launcher's account, once it has exited."""
        if self.result and self.result.get("ok"):
            return "succeeded", "elastic_launch returned"
        if self.result:
            return "failed", f"torchelastic gave up: {self.result.get('error')}"
        return "failed", f"the launcher {report.describe_exit(self.proc.poll())} (see {log})"

    def write_assignment(self, line: bytes) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # it died: its reader sees EOF and says so
            self.proc.stdin.write(line)
            self.proc.stdin.close()

    def discard(self) -> None:
        """End an idle launcher and its fork server (one process group), and reap it. Its pipe
        is `read`'s to close, at the EOF this brings."""
        self.discarded = True
        procs.signal_pgid(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        with contextlib.suppress(OSError):
            self.log_path.unlink()


class _Heard(protocol.launcher.Listener):
    """What the pipe's reader does with each kind: the launcher's own state, or on to its job."""

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher

    def tick(self, msg: protocol.launcher.Tick) -> None:
        self.launcher.last_tick = time.monotonic()

    def result(self, msg: protocol.launcher.Result) -> None:
        self.launcher.result = msg
        self.other(msg)

    def ready(self, msg: protocol.launcher.Ready) -> None:
        self.launcher.ready = True
        if self.launcher.job is not None:  # said while idle: nothing a job needs to hear
            self.other(msg)

    def other(self, msg: protocol.launcher.LauncherNews) -> None:
        self.launcher._forward.send_nowait(msg)
