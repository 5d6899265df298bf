"""Launcher processes, started before their jobs, and the pool that keeps one warm.

A launcher (``python -m elastic_nb.launcher``) imports torch, starts its fork server (which
imports torch and the ``--preload`` modules once, for every rank it will fork), says ``ready``
and waits on stdin for a job. Nothing of a job is in it until then, so it can be started
ahead: the pool keeps one ready for the next cell, hands it to the next job that comes, and
warms another once that job's ranks run if the machine has cores to spare for it, else once
the job has ended (the warm-up would take CPU from the ranks). Each launcher serves one job and exits with it, so nothing of one job (its
environment, working directory, imported modules, sys.argv) can reach the next.

A launcher is started with the environment of the last job (the kernel's), a blank slot for
the job marker (procs.mark_process), and this supervisor's pid; a job whose environment
differs where a process cannot change it later (the dynamic loader's variables) gets a fresh
one. A warm launcher that dies while it waits is replaced; one that fails to start three times
running turns warming off until a job succeeds in starting one.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import psutil
from anyio.abc import TaskGroup

from elastic_nb import procs, protocol
from elastic_nb.spec import JobSpec

__all__ = ["Launcher", "LauncherPool"]

log = logging.getLogger(__name__)

# Read by the dynamic loader or the interpreter at process start: a launcher started with other
# values cannot serve the job.
_AT_START = ("LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONHOME", "PYTHONPATH", "PYTHONSAFEPATH")
MAX_FAILED_WARMUPS = 3
WARMUP_CORES = 2  # a warm-up imports torch in two processes (the launcher, its fork server)


class Launcher:
    """One launcher process, from its start to the job it is given."""

    def __init__(self, env: dict[str, str], preload: tuple[str, ...], log_path: Path) -> None:
        self.preload = preload
        self.start_key = _start_key(env)
        self.log_path = log_path
        self.decoder = protocol.FrameDecoder()
        self.ready = False
        self.started = time.time()
        self.job: str | None = None  # who it was handed to
        self.last_tick: float | None = None  # its agent's monitor loop, last heard (monotonic)
        self.result: dict[str, Any] | None = None  # what elastic_launch returned or raised
        self.closed = anyio.Event()  # its pipe reached EOF: the launcher is exiting
        self.discarded = False  # ended by us while idle, not died
        # One reader of the pipe for the launcher's life (`read`); the job that takes it
        # receives its messages from this stream.
        self._forward, self.messages = anyio.create_memory_object_stream[dict[str, Any]](math.inf)
        with open(log_path, "ab") as log:
            # start_new_session: the launcher, its fork server and every rank are one process
            # group the job's teardown signals as a whole. Started from the supervisor's main
            # thread: the launcher's PDEATHSIG follows the thread that started it.
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "elastic_nb.launcher"],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                env={**env, "ELASTIC_NB_LAUNCHER_LOG": str(log_path)},
                start_new_session=True,
            )
        assert self.proc.stdout is not None
        os.set_blocking(self.proc.stdout.fileno(), False)

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

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
                for msg, _ in self.decoder.feed(data):
                    kind = msg["kind"]
                    if kind == protocol.TICK:
                        self.last_tick = time.monotonic()
                        continue
                    if kind == protocol.RESULT:
                        self.result = msg
                    if kind == protocol.READY:
                        self.ready = True
                        if self.job is None:
                            continue  # said while idle: nothing a job needs to hear
                    self._forward.send_nowait(msg)
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

    def assign(self, job_id: str, run_dir: str, env: dict[str, str]) -> bytes:
        """Make it the job's; returns the assignment for the caller to write (off the loop:
        an environment can be larger than a pipe's buffer). The ranks get the job's
        environment, marked with its id (procs.MARKER: how its processes are found)."""
        self.job = job_id
        env = {**env, procs.MARKER: job_id, "ELASTIC_NB_SUPERVISOR_PID": str(os.getpid())}
        if "matplotlib_inline" in env.get("MPLBACKEND", ""):
            env["MPLBACKEND"] = "Agg"  # the kernel's inline backend means nothing in a rank
        return json.dumps({"job": job_id, "run_dir": run_dir, "env": env}).encode() + b"\n"

    def outcome(self, log: Path) -> tuple[str, str]:
        """How the job ends by the launcher's account, once it has exited."""
        if self.result and self.result.get("ok"):
            return "succeeded", "elastic_launch returned"
        if self.result:
            return "failed", f"torchelastic gave up: {self.result.get('error')}"
        return "failed", f"the launcher {procs.describe_exit(self.proc.poll())} (see {log})"

    def write_assignment(self, line: bytes) -> None:
        assert self.proc.stdin is not None
        with contextlib.suppress(BrokenPipeError):  # it died: its reader sees EOF and says so
            self.proc.stdin.write(line)
            self.proc.stdin.close()

    def discard(self) -> None:
        """End an idle launcher and its fork server (one process group), and reap it. Its pipe
        is `read`'s to close, at the EOF this brings."""
        self.discarded = True
        procs.signal_group(self.pid, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(timeout=5)
        if self.proc.stdin is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()
        with contextlib.suppress(OSError):
            self.log_path.unlink()


class LauncherPool:
    def __init__(self, log_stem: str) -> None:
        self._log_stem = log_stem
        self._count = 0
        self._idle: Launcher | None = None
        self._tg: TaskGroup | None = None
        self._last: tuple[dict[str, str], JobSpec] | None = None  # what the next one is made for
        self._failed_warmups = 0
        self._closed = False

    def attach(self, tg: TaskGroup) -> None:
        self._tg = tg

    @property
    def idle(self) -> Launcher | None:
        return self._idle

    def take(self, spec: JobSpec, env: dict[str, str]) -> Launcher:
        """A launcher for this job: the warm one if it can serve it (and the job did not say
        --no-warm), else a new one."""
        if not spec.session or self._last is None:
            self._last = (env, spec)  # what the next warm launcher is made for: a cell's
        warm, self._idle = self._idle, None
        # A session's ranks are forked from its launcher's server for its whole life, restarts
        # included: it must have imported what the session preloads (a job's ranks import a
        # missing --preload module themselves; the warm start still wins for them).
        preloaded = not spec.session or set(spec.preload) <= set(warm.preload if warm else ())
        if (
            spec.warm
            and warm is not None
            and warm.alive
            and warm.start_key == _start_key(env)
            and preloaded
        ):
            return warm
        if warm is not None:
            warm.discard()
        return self._start(env, spec)

    def job_running(self, spec: JobSpec) -> None:
        """Every rank of a job is up: warm the next launcher now if this machine has cores to
        spare for it (a back-to-back cell is then warm too); else wait for the job's end."""
        if spec.warm and _cores() - spec.nproc >= WARMUP_CORES:
            self._warm()

    def job_ended(self, spec: JobSpec, started: bool) -> None:
        """After a job: keep one warm for the next cell, unless the job said --no-warm."""
        if started:
            self._failed_warmups = 0
        if not spec.warm:
            self.drop_idle()
            return
        self._warm()

    def describe(self) -> dict[str, Any] | None:
        """The idle launcher, for %elastic status: its pid, whether it is ready, its memory."""
        w = self._idle
        if w is None:
            return None
        rss = pss = 0
        with contextlib.suppress(psutil.Error):
            tree = psutil.Process(w.pid)
            for p in [tree, *tree.children(recursive=True)]:
                mem = p.memory_full_info()
                rss, pss = rss + mem.rss, pss + mem.pss
        return {
            "pid": w.pid,
            "ready": w.ready,
            "age_s": time.time() - w.started,
            "preload": list(w.preload),
            "rss_mb": rss / 2**20,
            "pss_mb": pss / 2**20,
        }

    def drop_idle(self) -> None:
        idle, self._idle = self._idle, None
        if idle is not None:
            idle.discard()

    def close(self) -> None:
        self._closed = True
        self.drop_idle()

    def _warm(self) -> None:
        if (
            self._closed
            or self._idle is not None
            or self._last is None
            or self._failed_warmups >= MAX_FAILED_WARMUPS
        ):
            return
        env, spec = self._last
        self._idle = self._start(env, spec)
        assert self._tg is not None
        self._tg.start_soon(self._keep, self._idle)

    def _start(self, env: dict[str, str], spec: JobSpec) -> Launcher:
        self._count += 1
        start_env = {
            **{k: v for k, v in env.items() if k != procs.MARKER},
            procs.SLOT: procs.SLOT_BLANK,
            "ELASTIC_NB_SUPERVISOR_PID": str(os.getpid()),
            "ELASTIC_NB_PRELOAD": json.dumps(list(spec.preload)),
            "ELASTIC_NB_SYS_PATH": json.dumps(list(spec.sys_path)),
        }
        launcher = Launcher(
            start_env, spec.preload, Path(f"{self._log_stem}-launcher-{self._count}.log")
        )
        assert self._tg is not None
        self._tg.start_soon(launcher.read)
        return launcher

    async def _keep(self, launcher: Launcher) -> None:
        """Watch a warm launcher while it waits; replace it if it dies before a job takes it.
        A bug here must not take the supervisor down: it only costs the warm start."""
        try:
            await self._watch(launcher)
        except Exception:
            log.exception("watching warm launcher %s", launcher.pid)

    async def _watch(self, launcher: Launcher) -> None:
        await launcher.closed.wait()
        if launcher.job is not None or launcher.discarded:
            return  # a job took it (and watches it now), or we ended it
        # It died waiting: say why, and warm another (not forever, if it never got ready).
        tail = _tail(launcher.log_path)
        launcher.discard()
        log.warning(
            "warm launcher %s exited (%s) before any job took it: %s",
            launcher.pid,
            procs.describe_exit(launcher.proc.returncode),
            tail,
        )
        if self._idle is launcher:
            self._idle = None
            if not launcher.ready:
                self._failed_warmups += 1
            self._warm()


def _cores() -> int:
    return len(os.sched_getaffinity(0))


def _start_key(env: dict[str, Any]) -> tuple[str | None, ...]:
    return tuple(env.get(k) for k in _AT_START)


def _tail(path: Path, n: int = 5) -> str:
    with contextlib.suppress(OSError):
        return " | ".join(path.read_text(errors="replace").splitlines()[-n:]) or "no output"
    return "no log"
