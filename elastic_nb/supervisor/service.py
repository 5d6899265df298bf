"""The supervisor: one process per kernel, owning every job that kernel starts.

It listens on a Unix socket the kernel created in an owner-only directory (the kernel hands the
listening descriptor over, so there is no race to connect), runs each job as a task, and lives
exactly as long as its kernel: when the kernel's connection closes or the kernel's pid exits
(SIGKILL included), every job is torn down and the supervisor exits.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import signal
import socket
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import anyio
import psutil
from anyio.abc import SocketListener, SocketStream, TaskGroup

from elastic_nb import protocol
from elastic_nb.common import procs, registry
from elastic_nb.common.rundir import RunDir
from elastic_nb.common.spec import JobSpec
from elastic_nb.common.submission import Submission
from elastic_nb.supervisor import overview
from elastic_nb.supervisor.nodes.cluster import Cluster
from elastic_nb.supervisor.processes.launcher_pool import LauncherPool
from elastic_nb.supervisor.processes.local_node import LocalNode
from elastic_nb.supervisor.runs.job import Job
from elastic_nb.supervisor.runs.rounds import Machines
from elastic_nb.supervisor.sessions.session import Session
from elastic_nb.supervisor.sessions.session_cell import SessionCell

__all__ = ["Supervisor"]

log = logging.getLogger(__name__)

KEEP_FINISHED = 200  # finished jobs `%elastic jobs` lists; older ones live on disk only


# A connection to the supervisor's socket (the kernel's, or the panel's): its frames are checked
# a request at a time (Supervisor._handle), so that a request that does not fit is refused in
# its reply, and the connection serves on.
Connection = protocol.connection.AsyncConnection[protocol.wire.Frame]


class Supervisor:
    def __init__(
        self, listen_fd: int, kernel_pid: int, log_path: str, kernel_id: str | None = None
    ) -> None:
        self._listen_fd = listen_fd
        self._kernel_pid = kernel_pid
        self._kernel_id = kernel_id
        # Launchers log beside us until they have a job (then into its run directory).
        self._launchers = LauncherPool(log_path.removesuffix(".log"))
        self._jobs: dict[str, Job] = {}
        self._sessions: dict[str, Session] = {}
        self._socket_dir: Path | None = None
        self._started = time.time()
        self._tg: TaskGroup | None = None
        self._cluster: Cluster | None = None  # the join agents, once a join command is asked

    async def run(self) -> None:
        procs.set_child_subreaper()
        sock = socket.socket(fileno=self._listen_fd)
        path = sock.getsockname()
        self._socket_dir = Path(path).parent  # owner-only: sessions' sockets go there too
        listener = await SocketListener.from_socket(sock)
        # For the JupyterLab panel (elastic_nb.server) to find us; removed when we exit.
        registration = registry.register(
            registry.Registration(
                os.getpid(), self._kernel_pid, self._kernel_id, path, self._started
            )
        )
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                self._launchers.attach(tg, dict(os.environ))
                tg.start_soon(self._watch_kernel)
                tg.start_soon(self._watch_signals)
                tg.start_soon(self._reap_periodically)
                await listener.serve(self._serve_connection, task_group=tg)
        finally:
            self._launchers.close()
            with anyio.CancelScope(shield=True):
                await listener.aclose()
            with contextlib.suppress(OSError):
                os.unlink(path)
            with contextlib.suppress(OSError):
                registration.unlink()

    # ---- lifeline ---------------------------------------------------------------------------

    async def _watch_kernel(self) -> None:
        fd = procs.pidfd_open(self._kernel_pid)
        if fd is None:
            while procs.zombie_exit_code(self._kernel_pid) is None and _pid_alive(self._kernel_pid):
                await anyio.sleep(0.2)
        else:
            try:
                await anyio.wait_readable(fd)
            finally:
                os.close(fd)
        self._shutdown()

    async def _watch_signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGHUP) as signals:
            async for _ in signals:
                self._shutdown()
                return

    async def _reap_periodically(self) -> None:
        while True:
            await anyio.sleep(1.0)
            self.reap()

    def _launcher_pids(self) -> set[int]:
        keep = {j.launcher_pid for j in self._owners() if j.launcher_pid}
        return keep | self._launchers.pids()

    def reap(self) -> None:
        procs.reap_orphans(keep=self._launcher_pids())

    def orphans(self) -> list[psutil.Process]:
        """What we inherited as a subreaper: left behind by some job's processes."""
        return procs.orphans(keep=self._launcher_pids())

    def _local_node(self, spec: JobSpec, group_id: str) -> LocalNode:
        """This machine, for one job or session (its run directory)."""
        return LocalNode(
            RunDir.of(spec.log_dir, group_id), self._launchers, self.orphans, self.reap
        )

    def _place(self, spec: JobSpec, group_id: str, env: dict[str, str]) -> dict[str, Any]:
        """Where a group runs: this machine's node, or, across machines, the cluster's nodes
        a round at a time (its rendezvous store a process of this machine's pool)."""
        if not spec.multi_node:
            return {"node": self._local_node(spec, group_id), "machines": None}
        if self._cluster is None or self._cluster.listener is None:
            raise RuntimeError(
                f"--nnodes {spec.nnodes_min}:{spec.nnodes_max} needs joined nodes, and none can "
                "join yet: %elastic join-command opens this notebook to them and prints the "
                "line to run on each"
            )
        port = int(spec.rdzv_endpoint.rsplit(":", 1)[1])
        return {
            "node": None,
            "machines": Machines(
                cluster=self._cluster,
                local=lambda: self._local_node(spec, group_id),
                store=lambda: self._launchers.store(env, port),
                end_store=self._launchers.end_store,
            ),
        }

    def _shutdown(self) -> None:
        """Stop every job; the task group ends when the last one has torn down."""
        self._launchers.close()
        for job in self._owners():
            job.request_stop("shutdown")
        assert self._tg is not None
        self._tg.start_soon(self._cancel_when_jobs_end)

    async def _cancel_when_jobs_end(self) -> None:
        while any(j.running for j in self._owners()):
            await anyio.sleep(0.05)
        if self._cluster is not None:
            await self._cluster.close()  # the agents hear it now, not from our silence
        assert self._tg is not None
        self._tg.cancel_scope.cancel()

    # ---- requests ---------------------------------------------------------------------------

    async def _serve_connection(self, stream: SocketStream) -> None:
        conn = Connection(stream, _unchecked)
        is_kernel = greeted = False
        try:
            # A frame that is no message ends this connection only (ProtocolError); a request
            # the supervisor cannot serve is refused in its reply.
            async for frame, blob in conn:
                if not greeted and frame["kind"] != protocol.kernel.HELLO:
                    raise protocol.wire.ProtocolError(f"{frame['kind']!r} before hello")
                if frame["kind"] == protocol.kernel.HELLO:
                    hello = protocol.kernel.kernel_request(frame)
                    assert hello["kind"] == protocol.kernel.HELLO
                    try:
                        protocol.kernel.check_hello(hello)
                    except protocol.wire.ProtocolError as e:
                        await conn.send(_hello(error=str(e)))
                        return
                    is_kernel, greeted = hello.get("role") == protocol.kernel.ROLE_KERNEL, True
                    await conn.send(_hello(pid=os.getpid()))
                    continue
                await self._handle(conn, frame, blob)
        except protocol.wire.ProtocolError as e:
            log.warning("dropped a %s connection: %s", "kernel" if is_kernel else "client", e)
        except Exception:  # a bug of ours ends this connection, never the supervisor
            log.exception("a connection failed")
        finally:
            await conn.aclose()
            if is_kernel:
                self._shutdown()  # the kernel closed its lifeline: it is gone or shutting down

    async def _handle(
        self, conn: Connection, frame: protocol.wire.Frame, blob: bytes | None
    ) -> None:
        req = frame.get("req") if type(frame.get("req")) is int else None
        try:
            reply = await self._serve(conn, protocol.kernel.kernel_request(frame), blob)
        except Exception as e:  # a bad request fails alone; the supervisor serves on
            kind = frame.get("kind")
            log.info(
                "refused %r: %s", kind, e, exc_info=not isinstance(e, protocol.wire.ProtocolError)
            )
            error = f"{type(e).__name__}: {e}"
            await conn.send(
                protocol.kernel.Reply(
                    kind=protocol.kernel.REPLY, req=req, ok=False, data={}, error=error
                )
            )
            return
        await conn.send(
            protocol.kernel.Reply(kind=protocol.kernel.REPLY, req=req, ok=True, data=dict(reply))
        )

    async def _serve(
        self, conn: Connection, msg: protocol.kernel.KernelRequest, blob: bytes | None
    ) -> Mapping[str, object]:
        """What a request asks for, by its kind's handler (`_REQUESTS`); raises what refuses it."""
        handler = _REQUESTS.get(msg["kind"])
        if handler is None:  # a hello after the first: the channel's, but no request
            raise protocol.wire.ProtocolError(f"{msg['kind']!r} is not a request")
        return await handler(self, conn, msg, blob)

    # ---- the requests (each its handler in _REQUESTS) --------------------------------------------

    async def _on_stop(
        self, _c: Connection, msg: protocol.kernel.Stop, _b: Blob
    ) -> protocol.kernel.Stopping:
        return self._stop(msg["job"], msg["reason"])

    async def _on_stacks(
        self, _c: Connection, msg: protocol.kernel.Stacks, _b: Blob
    ) -> protocol.kernel.StackText:
        text, owner = await self._stacks(msg["job"])
        return {"text": text, "pids": overview.rank_pids(owner)}

    async def _on_warm(
        self, _c: Connection, msg: protocol.kernel.Warm, _b: Blob
    ) -> protocol.kernel.Done:
        self._launchers.keep_warm(msg["on"])
        return {}

    async def _on_jobs(
        self, _c: Connection, _m: protocol.kernel.Jobs, _b: Blob
    ) -> protocol.kernel.JobList:
        return {"jobs": [_info(j) for j in self._jobs.values()]}

    async def _on_status(
        self, _c: Connection, _m: protocol.kernel.Status, _b: Blob
    ) -> protocol.kernel.SupervisorStatus:
        return {
            "pid": os.getpid(),
            "uptime_s": time.time() - self._started,
            "running": [j.id for j in self._jobs.values() if j.running],
            "sessions": [s.info() for s in self._sessions.values() if s.running],
            "warm": self._launchers.describe(),
            "memory": {
                g.id: g.memory_now()
                for g in (*self._jobs.values(), *self._sessions.values())
                if g.running
            },
        }

    async def _on_up(
        self, conn: Connection, msg: protocol.kernel.Up, _b: Blob
    ) -> protocol.kernel.SessionUp:
        return await self._up(conn, msg)

    async def _on_down(
        self, _c: Connection, msg: protocol.kernel.Down, _b: Blob
    ) -> protocol.kernel.Done:
        self._session(msg["session"]).down(msg.get("reason", "user"))
        return {}

    async def _on_session(
        self, _c: Connection, msg: protocol.kernel.SessionInfo, _b: Blob
    ) -> protocol.kernel.SessionState:
        return self._session(msg["session"]).info()

    async def _on_overview(
        self, _c: Connection, _m: protocol.kernel.Overview, _b: Blob
    ) -> protocol.kernel.PanelList:
        return {"jobs": overview.entries(self._jobs.values(), self._sessions.values())}

    async def _on_events(
        self, _c: Connection, msg: protocol.kernel.Events, _b: Blob
    ) -> protocol.kernel.EventList:
        report = overview.reporter_of(msg["job"], self._jobs, self._sessions)
        return {"events": report.events_since(msg["since"]), "seq": report.seq}

    async def _on_nodes(
        self, _c: Connection, _m: protocol.kernel.Nodes, _b: Blob
    ) -> protocol.kernel.MachineList:
        return self._nodes()

    async def _on_join(
        self, _c: Connection, msg: protocol.kernel.Join, _b: Blob
    ) -> protocol.kernel.JoinLine:
        return await self._join(msg)

    # ---- nodes ---------------------------------------------------------------------------------

    def _nodes(self) -> protocol.kernel.MachineList:
        """This machine and the join agents (%elastic nodes, the panel)."""
        if self._cluster is None:
            from elastic_nb.common import machine

            here = machine.describe(machine.primary_address(), "")
            return protocol.kernel.MachineList(
                listening=None,
                here=protocol.kernel.Machine(**here, node=0, state="here"),
                agents=[],
            )
        return self._cluster.describe()

    async def _join(self, msg: protocol.kernel.Join) -> protocol.kernel.JoinLine:
        """The join command (the agents' channel opened at the first ask); a new token drops
        the agents holding the old one."""
        assert self._tg is not None
        if self._cluster is None:
            self._cluster = Cluster(self._tg)
        if self._cluster.listener is None:
            await self._cluster.serve(msg["host"], msg["port"])
        elif msg["port"] and msg["port"] != self._cluster.listener.port:
            raise ValueError(
                f"agents already join on port {self._cluster.listener.port}: --port cannot "
                "change it while this supervisor runs"
            )
        dropped = await self._cluster.new_token() if msg["new_token"] else 0
        return {"command": self._cluster.join_command(), "dropped": dropped}

    async def _submit(
        self, conn: Connection, msg: protocol.kernel.Submit, blob: bytes | None
    ) -> protocol.kernel.Submitted:
        job_id = msg["job"] or secrets.token_hex(4)
        if job_id in self._jobs or self._cell_session(job_id) or not job_id.isalnum():
            raise ValueError(f"job id {job_id!r} is taken or malformed")
        submitted = Submission.of(msg, job_id, blob)
        if submitted.session:
            session = self._session(submitted.session)
            cell = SessionCell(submitted, conn.send)
            await anyio.to_thread.run_sync(cell.prepare)
            session.submit(cell)
            return {"job": job_id}
        env = msg["env"] or dict(os.environ)
        spec = submitted.spec
        job = Job(submitted, env=env, send=conn.send, **self._place(spec, job_id, env))
        self._forget_old_jobs()
        self._jobs[job_id] = job  # the id is taken from here on, even while prepare runs
        try:
            await anyio.to_thread.run_sync(job.prepare)  # payloads can be large: off the loop
        except BaseException:
            del self._jobs[job_id]
            raise
        assert self._tg is not None
        self._tg.start_soon(job.run)
        return {"job": job_id}

    def _forget_old_jobs(self) -> None:
        """A kernel may run thousands of cells: keep the latest finished jobs only (their run
        directories stay on disk)."""
        done = [j for j in self._jobs if not self._jobs[j].running]
        for job_id in done[: max(0, len(done) - KEEP_FINISHED)]:
            del self._jobs[job_id]

    async def _stacks(self, job_id: str | None) -> tuple[str, Job | Session]:
        """Every rank's stack now, and whose ranks they are."""
        session = self._cell_session(job_id) if job_id else None
        if session is not None and session.running:
            return await session.stacks(), session
        running: list[Job | Session] = [j for j in self._owners() if j.running]
        if job_id is not None:
            running = [j for j in running if j.id == job_id]
        if not running:
            raise KeyError(f"no running job {job_id}" if job_id else "no running job")
        return await running[-1].stacks(), running[-1]

    def _stop(self, job_id: str | None, reason: str) -> protocol.kernel.Stopping:
        """Stop jobs, or interrupt a session's cells (the session stays: %elastic down ends it)."""
        if job_id and (session := self._cell_session(job_id)) is not None:
            running = session.cells[job_id].running
            session.stop_cell(job_id, reason)
            return {"stopping": [job_id] if running else []}
        if job_id is not None and job_id not in self._jobs:
            raise KeyError(f"no job {job_id!r}")
        targets = [self._jobs[job_id]] if job_id else list(self._jobs.values())
        stopping = [j.id for j in targets if j.running]
        for j in targets:
            if j.running:
                j.request_stop(reason)
        if job_id is None:
            for s in self._sessions.values():
                for cell in [c for c in s.cells.values() if c.running]:
                    s.stop_cell(cell.id, reason)
                    stopping.append(cell.id)
        return {"stopping": stopping}

    # ---- sessions -----------------------------------------------------------------------------

    def _owners(self) -> list[Job | Session]:
        """Whatever owns a launcher and ranks: jobs and sessions."""
        return [*self._jobs.values(), *self._sessions.values()]

    def _session(self, session_id: str | None) -> Session:
        session = self._sessions.get(session_id or "")
        if session is None or not session.running:
            raise KeyError(f"no session {session_id!r} is up")
        return session

    def _cell_session(self, job_id: str | None) -> Session | None:
        for s in self._sessions.values():
            if job_id in s.cells:
                return s
        return None

    async def _up(self, conn: Connection, msg: protocol.kernel.Up) -> protocol.kernel.SessionUp:
        spec = JobSpec.from_dict(msg["spec"])
        session_id = msg["session"] or secrets.token_hex(4)
        if session_id in self._sessions or session_id in self._jobs or not session_id.isalnum():
            raise ValueError(f"session id {session_id!r} is taken or malformed")
        assert self._socket_dir is not None
        env = msg["env"] or dict(os.environ)
        session = Session(
            session_id,
            spec,
            env=env,
            send=conn.send,
            socket_dir=self._socket_dir,
            **self._place(spec, session_id, env),
        )
        self._sessions[session_id] = session
        try:
            await anyio.to_thread.run_sync(session.prepare)
        except BaseException:
            del self._sessions[session_id]
            raise
        assert self._tg is not None
        self._tg.start_soon(session.run)
        return {"session": session_id, "run_dir": str(session.rd)}


def _hello(pid: int | None = None, error: str | None = None) -> protocol.kernel.Hello:
    hello = protocol.kernel.Hello(kind=protocol.kernel.HELLO, version=protocol.wire.VERSION)
    if pid is not None:
        hello["pid"] = pid
    if error is not None:
        hello["error"] = error
    return hello


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def _info(job: Job) -> protocol.kernel.JobRow:
    """One job as %elastic jobs lists it."""
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


def _unchecked(frame: protocol.wire.Frame) -> protocol.wire.Frame:
    return frame


Blob = bytes | None
# Each request of the kernel's channel, and its handler (a Supervisor method), which returns the
# reply's data (of the type protocol.kernel.REPLIES names). The hello is the channel's too, but
# it is the handshake's (Supervisor._serve_connection), no request.
_REQUESTS: dict[
    str, Callable[[Supervisor, Connection, Any, Blob], Awaitable[Mapping[str, object]]]
] = {
    protocol.kernel.SUBMIT: Supervisor._submit,
    protocol.kernel.STOP: Supervisor._on_stop,
    protocol.kernel.STACKS: Supervisor._on_stacks,
    protocol.kernel.WARM: Supervisor._on_warm,
    protocol.kernel.JOBS: Supervisor._on_jobs,
    protocol.kernel.STATUS: Supervisor._on_status,
    protocol.kernel.UP: Supervisor._on_up,
    protocol.kernel.DOWN: Supervisor._on_down,
    protocol.kernel.SESSION: Supervisor._on_session,
    protocol.kernel.OVERVIEW: Supervisor._on_overview,
    protocol.kernel.EVENTS: Supervisor._on_events,
    protocol.kernel.NODES: Supervisor._on_nodes,
    protocol.kernel.JOIN: Supervisor._on_join,
}
