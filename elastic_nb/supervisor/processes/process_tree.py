"""Ending a job's process tree: the launcher, its fork server, every rank, and whatever the cell
started, found by what they are (never by name): the launcher's process group, the job's marker
in a process's environment, and the supervisor's orphans. The supervisor is a subreaper: a
process whose rank died (one that left the process group and dropped its environment) becomes
its child, and any child of it that is not a launcher is such a leftover.

SIGTERM goes to the launcher, every marked process and every orphan; SIGKILL after the grace to
the whole process group and all of those again; what still lives after that is named, by pid.
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable

import anyio
import psutil

from elastic_nb import protocol
from elastic_nb.common import procs
from elastic_nb.supervisor.processes.zygote_process import ForkedProcess

__all__ = ["ProcessTree"]

POLL_S = 0.05
LEFTOVER_GRACE_S = 0.5  # after a successful launcher exits, its helpers' time to follow it


class ProcessTree:
    def __init__(
        self,
        job_id: str,
        launcher: ForkedProcess,
        orphans: Callable[[], list[psutil.Process]],
    ) -> None:
        self.job_id = job_id
        self.launcher = launcher
        self._orphans = orphans

    def leftovers(self) -> list[psutil.Process]:
        """What the cell left: processes with the job's marker, and the supervisor's orphans.
        Orphans in a launcher's process group are not among them (procs.orphans): they are its
        own helpers (its fork server, multiprocessing's resource tracker), which exit once it
        has gone; waiting for them would only delay the end (0.12 s a job, measured)."""
        found = {p.pid: p for p in [*procs.job_processes([self.job_id]), *self._orphans()]}
        return list(found.values())

    def alive(self, leftovers_too: bool = True) -> bool:
        if self.launcher.poll() is None:
            return True
        return leftovers_too and bool(self.leftovers())

    async def wait_gone(self, timeout: float, leftovers_too: bool = True) -> None:
        with anyio.move_on_after(timeout):
            while self.alive(leftovers_too):
                await anyio.sleep(POLL_S)

    async def leftovers_after_success(
        self, grace: float, stuck: Callable[[], bool]
    ) -> list[protocol.records.Leftover]:
        """torch has joined the ranks and the launcher is on its way out: wait for it (unless the
        agent is known stuck), then name what still carries the marker, left behind by the cell."""
        with anyio.move_on_after(grace):
            while self.alive(leftovers_too=False) and not stuck():
                await anyio.sleep(POLL_S)
        if self.launcher.poll() is None:
            return []
        # Helpers of the launcher (multiprocessing's resource tracker, a fork server) exit on
        # their own once it has gone: give them a moment before blaming the cell.
        await self.wait_gone(LEFTOVER_GRACE_S)
        left = [_describe(p) for p in self.leftovers()]
        # What remains in the launcher's group is its helpers on their way out, or a child of
        # the cell that dropped the marker but kept the group: end them all now.
        procs.signal_pgid(self.launcher.pid, signal.SIGTERM)
        return left

    async def stop(self, grace: float, on_signal: Callable[[str, list[int]], None]) -> list[int]:
        """SIGTERM, `grace`, SIGKILL; returns the pids that survived it all."""
        pid = self.launcher.pid
        for sig, wait in ((signal.SIGTERM, grace), (signal.SIGKILL, procs.KILL_WAIT_S)):
            if not self.alive():
                break
            if sig == signal.SIGTERM:
                # The launcher and every process marked with the job, not the whole group: the
                # fork server lives on to tell the launcher how each forked rank ended, and exits
                # when the launcher does. SIGKILL, if it comes to that, takes the whole group.
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
                procs.signal_pgid(pid, signal.SIGCONT)  # a stopped one too
            else:
                procs.signal_pgid(pid, sig)
            stray = []
            for p in self.leftovers():
                with contextlib.suppress(psutil.Error):
                    p.send_signal(sig)
                    stray.append(p.pid)
            on_signal(signal.Signals(sig).name, stray)
            await self.wait_gone(wait)
        if self.launcher.poll() is not None and procs.signal_pgid(pid, signal.SIGKILL):
            # Left in the launcher's group: its helpers, or a child of the cell that dropped
            # the marker but kept the group. Nothing of the job needs them any more.
            on_signal(signal.SIGKILL.name, [])
        survivors = [p.pid for p in self.leftovers()]
        if self.launcher.poll() is None:
            survivors.insert(0, pid)
        return survivors


def _describe(p: psutil.Process) -> protocol.records.Leftover:
    try:
        return protocol.records.Leftover(pid=p.pid, cmd=" ".join(p.cmdline())[:80])
    except psutil.Error:
        return protocol.records.Leftover(pid=p.pid, cmd="?")
