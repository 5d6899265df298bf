"""Launcher processes, started before their jobs, and the pool that keeps one warm.

A launcher is a fork of the zygote (zygote.py; torch imported once, for every launcher): it
forks its fork server (which imports the ``--preload`` modules, for every rank it will fork),
says ``ready`` and waits on stdin for a job. Nothing of a job is in it until then, so it can be
made ahead: the pool keeps one ready for the next cell, hands it to the next job that comes, and
forks another as soon as that job's ranks run (a fork takes milliseconds of CPU from them). Each
launcher serves one job and exits with it, so nothing of one job (its environment, working
directory, imported modules, sys.argv) can reach the next.

A launcher gets the environment of the last job (the kernel's), a blank slot for the job marker
(procs.mark_process: the slot is in the zygote's start environment, so in every fork's), and this
supervisor's pid; a job whose environment differs where a process cannot change it later (the
dynamic loader's variables) gets a zygote of its own. A warm launcher that dies while it waits is
replaced; warming that fails three times running is turned off until a job starts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from pathlib import Path
from typing import Any

import anyio
import psutil
from anyio.abc import TaskGroup

from elastic_nb import protocol
from elastic_nb.common import modules, procs, report
from elastic_nb.common.spec import JobSpec
from elastic_nb.supervisor.processes.launcher_process import Launcher
from elastic_nb.supervisor.processes.zygote_process import Zygote, ZygoteFailed, log_tail

__all__ = ["Launcher", "LauncherPool"]  # Launcher: launcher.py

log = logging.getLogger(__name__)

# Read by the dynamic loader or the interpreter at process start: a launcher started with other
# values cannot serve the job.
_AT_START = ("LD_LIBRARY_PATH", "LD_PRELOAD", "PYTHONHOME", "PYTHONPATH", "PYTHONSAFEPATH")
MAX_FAILED_WARMUPS = 3


class LauncherPool:
    """One zygote (torch imported, forks launchers), and one launcher forked ahead of the next
    cell. Both start with the supervisor, made for a cell in the kernel's environment; a job
    whose start key differs gets a zygote for its own. `--no-warm` keeps neither."""

    def __init__(self, log_stem: str) -> None:
        self._log_stem = log_stem
        self._count = 0
        self._idle: Launcher | None = None
        self._stores: set[Launcher] = set()
        self._zygote: Zygote | None = None
        self._tg: TaskGroup | None = None
        # What the next warm launcher is made for: a cell's environment, preload and sys.path.
        self._last: tuple[dict[str, str], tuple[str, ...], tuple[str, ...]] | None = None
        self._failed_warmups = 0
        self._warming = False
        self._off = False  # %elastic config --no-warm
        self._closed = False

    def attach(self, tg: TaskGroup, env: dict[str, str]) -> None:
        """Warm from the start, for a cell run in this environment (the kernel's)."""
        self._tg = tg
        self._last = (env, (), ())
        self._warm()

    @property
    def idle(self) -> Launcher | None:
        return self._idle

    async def warmed(self, timeout: float) -> bool:
        """Until a launcher is ready for the next job (torch imported, its fork server up), at
        most `timeout`; whether one is."""
        with anyio.move_on_after(timeout):
            while not (self._idle is not None and self._idle.ready):
                await anyio.sleep(0.05)
        return self._idle is not None and self._idle.ready

    def pids(self) -> set[int]:
        """Our children the pool owns: the zygote, the idle launcher, the rendezvous stores."""
        return {p.pid for p in (self._zygote, self._idle, *self._stores) if p is not None}

    async def store(self, env: dict[str, str], port: int) -> tuple[Launcher, int]:
        """A multi-node group's rendezvous store: a fork of the zygote in the store role, serving
        on 127.0.0.1 (`port`; 0: a free one). Returns it and its port; `end_store` ends it."""
        zygote = self._zygote_for(env)
        role = {modules.ROLE_ENV: modules.STORE_ROLE, modules.STORE_PORT_ENV: str(port)}
        store = await self._fork(zygote, {**env, **role}, (), ())
        self._stores.add(store)
        serving = _Serving()
        async for msg in store.messages:
            protocol.launcher.hear(msg, serving)
            if serving.port is not None:
                return store, serving.port
        self.end_store(store)
        raise ZygoteFailed(f"the rendezvous store did not start: {log_tail(store.log_path)}")

    def end_store(self, store: Launcher) -> None:
        self._stores.discard(store)
        store.discard()

    async def take(self, spec: JobSpec, env: dict[str, str]) -> Launcher:
        """A launcher for this job: the warm one if it can serve it, else a fork of the zygote
        (a new zygote if the job's start key differs, or the job said --no-warm)."""
        if not spec.session or self._last is None:
            self._last = (env, spec.preload, spec.sys_path)
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
        if not spec.warm:
            self._drop_zygote()  # from scratch: a zygote of its own, not kept
        zygote = self._zygote_for(env)
        try:
            return await self._fork(zygote, env, spec.preload, spec.sys_path)
        finally:
            if not spec.warm:
                self._drop_zygote()

    def job_running(self, spec: JobSpec) -> None:
        """Every rank of a job is up: fork the next launcher now (milliseconds, from the
        zygote), so that a cell sent the moment this one ends is warm too. Its fork server
        imports the --preload modules (seconds, for heavy ones): with those, only on a machine
        with a core to spare beside the ranks; else once the job has ended."""
        if spec.warm and (not spec.preload or _cores() > spec.nproc):
            self._warm()

    def job_ended(self, spec: JobSpec, started: bool) -> None:
        """After a job: keep one warm for the next cell, unless the job said --no-warm."""
        if started:
            self._failed_warmups = 0
        if not spec.warm:
            self.drop_idle()
            return
        self._warm()

    def keep_warm(self, on: bool) -> None:
        """%elastic config --no-warm ends the zygote and the idle launcher now (their memory);
        --warm starts them again."""
        self._off = not on
        if on:
            self._warm()
        else:
            self.drop_idle()
            self._drop_zygote()

    def describe(self) -> protocol.kernel.WarmLauncher | None:
        """The idle launcher and the zygote, for %elastic status: pids, readiness, memory."""
        w, z = self._idle, self._zygote
        if w is None and z is None:
            return None
        rss = pss = 0
        for root in (w, z):
            if root is None:
                continue
            with contextlib.suppress(psutil.Error):
                tree = psutil.Process(root.pid)
                for p in [tree, *tree.children(recursive=True)]:
                    mem = p.memory_full_info()
                    rss, pss = rss + mem.rss, pss + mem.pss
        return protocol.kernel.WarmLauncher(
            pid=w.pid if w else None,
            ready=bool(w and w.ready),
            age_s=time.time() - w.started if w else 0.0,
            preload=list(w.preload) if w else [],
            zygote=z.pid if z else None,
            zygote_ready=bool(z and z.ready),
            rss_mb=rss / 2**20,
            pss_mb=pss / 2**20,
        )

    def drop_idle(self) -> None:
        idle, self._idle = self._idle, None
        if idle is not None:
            idle.discard()

    def close(self) -> None:
        self._closed = True
        self.drop_idle()
        for store in list(self._stores):
            self.end_store(store)
        self._drop_zygote()

    def _zygote_for(self, env: dict[str, str]) -> Zygote:
        key = _start_key(env)
        z = self._zygote
        if z is not None and z.alive and z.start_key == key:
            return z
        self._drop_zygote()
        self._count += 1
        zygote_env = {
            **{k: v for k, v in env.items() if k != procs.MARKER},
            # In its start environment, so in every launcher's and rank's: mark_process
            # writes the job's marker there.
            procs.SLOT: procs.SLOT_BLANK,
            "ELASTIC_NB_SUPERVISOR_PID": str(os.getpid()),
        }
        z = Zygote(zygote_env, key, Path(f"{self._log_stem}-zygote-{self._count}.log"))
        assert self._tg is not None
        self._tg.start_soon(z.read_ready)
        self._zygote = z
        return z

    def _drop_zygote(self) -> None:
        z, self._zygote = self._zygote, None
        if z is not None:
            z.close()

    async def _fork(
        self,
        zygote: Zygote,
        env: dict[str, str],
        preload: tuple[str, ...],
        sys_path: tuple[str, ...],
    ) -> Launcher:
        await zygote.wait_ready()
        self._count += 1
        launcher_env = {
            **{k: v for k, v in env.items() if k != procs.MARKER},
            procs.SLOT: procs.SLOT_BLANK,
            "ELASTIC_NB_SUPERVISOR_PID": str(os.getpid()),
            "ELASTIC_NB_PRELOAD": json.dumps(list(preload)),
            "ELASTIC_NB_SYS_PATH": json.dumps(list(sys_path)),
        }
        log_path = Path(f"{self._log_stem}-launcher-{self._count}.log")
        launcher = Launcher(zygote, launcher_env, preload, log_path)
        assert self._tg is not None
        self._tg.start_soon(launcher.read)
        return launcher

    def _warm(self) -> None:
        if self._idle is not None and not self._fits(self._idle):
            self.drop_idle()  # made for a cell before the last one (its --preload, its sys.path)
        if (
            self._closed
            or self._off
            or self._warming
            or self._idle is not None
            or self._last is None
            or self._failed_warmups >= MAX_FAILED_WARMUPS
        ):
            return
        self._warming = True
        assert self._tg is not None
        self._tg.start_soon(self._warm_one)

    async def _warm_one(self) -> None:
        """Fork the next launcher (starting a zygote first if there is none). A failure here
        must not take the supervisor down: it only costs the warm start."""
        assert self._last is not None
        env, preload, sys_path = self._last
        zygote = None
        try:
            zygote = self._zygote_for(env)
            launcher = await self._fork(zygote, env, preload, sys_path)
        except Exception as e:
            # A zygote ended on purpose meanwhile (--no-warm, another start key) is no failure.
            if zygote is None or zygote is self._zygote:
                self._failed_warmups += 1
                log.warning(
                    "warming a launcher failed: %s", e, exc_info=not isinstance(e, ZygoteFailed)
                )
            return
        finally:
            self._warming = False
        if self._closed or self._off or self._idle is not None or not self._fits(launcher):
            launcher.discard()  # --no-warm, or a cell that asked for another, came meanwhile
            self._warm()
            return
        self._idle = launcher
        assert self._tg is not None
        self._tg.start_soon(self._keep, launcher)

    def _fits(self, launcher: Launcher) -> bool:
        """Made for the cell the next warm launcher is for."""
        if self._last is None:
            return True
        env, preload, sys_path = self._last
        return (launcher.preload, launcher.sys_path, launcher.start_key) == (
            preload,
            sys_path,
            _start_key(env),
        )

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
        tail = log_tail(launcher.log_path)
        launcher.discard()
        log.warning(
            "warm launcher %s exited (%s) before any job took it: %s",
            launcher.pid,
            report.describe_exit(launcher.proc.returncode),
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


class _Serving(protocol.launcher.Listener):
    """A rendezvous store's word that it serves, and where."""

    port: int | None = None

    def store_up(self, msg: protocol.launcher.StoreUp) -> None:
        self.port = msg["port"]
