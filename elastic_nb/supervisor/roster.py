"""The kernel's jobs and sessions, by id: each placed (on this machine, or across machines a
round at a time), started as a task of the supervisor's, stopped, asked for its ranks' stacks,
listed, and forgotten once old. The service (service.py) answers the kernel's requests with
them; what they are and do is runs/ and sessions/.
"""

from __future__ import annotations

import os
import secrets
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
from anyio.abc import TaskGroup

from elastic_nb import protocol
from elastic_nb.common.rundir import RunDir
from elastic_nb.common.spec import JobSpec
from elastic_nb.common.submission import Submission
from elastic_nb.supervisor.nodes.cluster import Cluster
from elastic_nb.supervisor.processes.launcher_pool import LauncherPool
from elastic_nb.supervisor.processes.local_site import LocalSite
from elastic_nb.supervisor.runs.job import Job
from elastic_nb.supervisor.runs.reporter import Send
from elastic_nb.supervisor.runs.rounds import Machines
from elastic_nb.supervisor.sessions.session import Session
from elastic_nb.supervisor.sessions.session_cell import SessionCell

__all__ = ["KEEP_FINISHED", "Roster", "forget_old_jobs"]

KEEP_FINISHED = 200  # finished jobs `%elastic jobs` lists; older ones live on disk only


class Roster:
    def __init__(
        self,
        launchers: LauncherPool,
        tg: TaskGroup,
        socket_dir: Path,
        orphans: Callable[[], list[Any]],
        reap: Callable[[], None],
    ) -> None:
        """`socket_dir`: owner-only, where sessions' sockets go; `orphans`, `reap`: what this
        machine's sites do with the processes the supervisor inherits as a subreaper."""
        self.jobs: dict[str, Job] = {}
        self.sessions: dict[str, Session] = {}
        self.cluster: Cluster | None = None  # the join agents, once a join command is asked
        self._launchers, self._tg, self._socket_dir = launchers, tg, socket_dir
        self._orphans, self._reap = orphans, reap

    def owners(self) -> list[Job | Session]:
        """Whatever owns a launcher and ranks: jobs and sessions."""
        return [*self.jobs.values(), *self.sessions.values()]

    def launcher_pids(self) -> set[int]:
        """Every launcher a group holds, and the pool's: not orphans."""
        keep = {j.launcher_pid for j in self.owners() if j.launcher_pid}
        return keep | self._launchers.pids()

    # ---- start -------------------------------------------------------------------------------

    async def submit(
        self, msg: protocol.kernel.Submit, blob: bytes | None, send: Send
    ) -> protocol.kernel.Submitted:
        """A job, or a cell on a session's ranks."""
        job_id = msg["job"] or secrets.token_hex(4)
        if job_id in self.jobs or self.cell_session(job_id) or not job_id.isalnum():
            raise ValueError(f"job id {job_id!r} is taken or malformed")
        submitted = Submission.of(msg, job_id, blob)
        if submitted.session:
            session = self.session(submitted.session)
            cell = SessionCell(submitted, send)
            await anyio.to_thread.run_sync(cell.prepare)
            session.submit(cell)
            return protocol.kernel.Submitted(job=job_id)
        env = msg["env"] or dict(os.environ)
        job = Job(submitted, env=env, send=send, **self._place(submitted.spec, job_id, env))
        forget_old_jobs(self.jobs)
        self.jobs[job_id] = job  # the id is taken from here on, even while prepare runs
        try:
            await anyio.to_thread.run_sync(job.prepare)  # payloads can be large: off the loop
        except BaseException:
            del self.jobs[job_id]
            raise
        self._tg.start_soon(job.run)
        return protocol.kernel.Submitted(job=job_id)

    async def up(self, msg: protocol.kernel.Up, send: Send) -> protocol.kernel.SessionUp:
        """A session: ranks kept up across cells."""
        spec = JobSpec.from_dict(msg["spec"])
        session_id = msg["session"] or secrets.token_hex(4)
        if session_id in self.sessions or session_id in self.jobs or not session_id.isalnum():
            raise ValueError(f"session id {session_id!r} is taken or malformed")
        env = msg["env"] or dict(os.environ)
        session = Session(
            session_id,
            spec,
            env=env,
            send=send,
            socket_dir=self._socket_dir,
            **self._place(spec, session_id, env),
        )
        self.sessions[session_id] = session
        try:
            await anyio.to_thread.run_sync(session.prepare)
        except BaseException:
            del self.sessions[session_id]
            raise
        self._tg.start_soon(session.run)
        return protocol.kernel.SessionUp(session=session_id, run_dir=str(session.rd))

    def _local_site(self, spec: JobSpec, group_id: str) -> LocalSite:
        """This machine, for one job or session (its run directory)."""
        return LocalSite(
            RunDir.of(spec.log_dir, group_id), self._launchers, self._orphans, self._reap
        )

    def _place(self, spec: JobSpec, group_id: str, env: dict[str, str]) -> dict[str, Any]:
        """Where a group runs: this machine's site, or, across machines, a site on each of the
        cluster's nodes a round at a time (its rendezvous store a process of this machine's
        pool)."""
        if not spec.multi_node:
            return {"site": self._local_site(spec, group_id), "machines": None}
        if self.cluster is None or self.cluster.listener is None:
            raise RuntimeError(
                f"--nnodes {spec.nnodes_min}:{spec.nnodes_max} needs joined nodes, and none can "
                "join yet: %elastic join-command opens this notebook to them and prints the "
                "line to run on each"
            )
        port = int(spec.rdzv_endpoint.rsplit(":", 1)[1])
        return {
            "site": None,
            "machines": Machines(
                cluster=self.cluster,
                local=lambda: self._local_site(spec, group_id),
                store=lambda: self._launchers.store(env, port),
                end_store=self._launchers.end_store,
            ),
        }

    # ---- find, ask, stop ---------------------------------------------------------------------

    def session(self, session_id: str | None) -> Session:
        session = self.sessions.get(session_id or "")
        if session is None or not session.running:
            raise KeyError(f"no session {session_id!r} is up")
        return session

    def ranks_of(self, job_id: str) -> Job | Session:
        """Whose ranks run a job: the job's own, or a session cell's session's."""
        if job_id in self.jobs:
            return self.jobs[job_id]
        session = self.cell_session(job_id)
        if session is None:
            raise KeyError(f"no job {job_id!r}")
        return session

    def cell_session(self, job_id: str | None) -> Session | None:
        for s in self.sessions.values():
            if job_id in s.cells:
                return s
        return None

    async def stacks(self, job_id: str | None) -> tuple[str, Job | Session]:
        """Every rank's stack now, and whose ranks they are."""
        session = self.cell_session(job_id) if job_id else None
        if session is not None and session.running:
            return await session.stacks(), session
        running: list[Job | Session] = [j for j in self.owners() if j.running]
        if job_id is not None:
            running = [j for j in running if j.id == job_id]
        if not running:
            raise KeyError(f"no running job {job_id}" if job_id else "no running job")
        return await running[-1].stacks(), running[-1]

    def stop(self, job_id: str | None, reason: str) -> protocol.kernel.Stopping:
        """Stop jobs, or interrupt a session's cells (the session stays: %elastic down ends it)."""
        if job_id and (session := self.cell_session(job_id)) is not None:
            running = session.cells[job_id].running
            session.stop_cell(job_id, reason)
            return protocol.kernel.Stopping(stopping=[job_id] if running else [])
        if job_id is not None and job_id not in self.jobs:
            raise KeyError(f"no job {job_id!r}")
        targets = [self.jobs[job_id]] if job_id else list(self.jobs.values())
        stopping = [j.id for j in targets if j.running]
        for j in targets:
            if j.running:
                j.request_stop(reason)
        if job_id is None:
            for s in self.sessions.values():
                for cell in [c for c in s.cells.values() if c.running]:
                    s.stop_cell(cell.id, reason)
                    stopping.append(cell.id)
        return protocol.kernel.Stopping(stopping=stopping)

    def rows(self) -> list[protocol.kernel.JobRow]:
        """The jobs as %elastic jobs lists them."""
        return [_row(j) for j in self.jobs.values()]


def _row(job: Job) -> protocol.kernel.JobRow:
    s = job.summary
    return protocol.kernel.JobRow(
        job=job.id,
        state=job.state,
        attempt=job.attempt,
        world_size=job.spec.world_size,
        run_dir=str(job.rd),
        created=job.created,
        outcome=s["outcome"] if s else None,
        wall_s=s["wall_s"] if s else time.time() - job.created,
    )


def forget_old_jobs(jobs: dict[str, Any]) -> None:
    """A kernel may run thousands of cells: keep the latest finished jobs only (their run
    directories stay on disk), and every running one."""
    done = [j for j in jobs if not jobs[j].running]
    for job_id in done[: max(0, len(done) - KEEP_FINISHED)]:
        del jobs[job_id]
