"""The supervisor: one process per kernel, owning every job that kernel starts.

It listens on a Unix socket the kernel created in an owner-only directory (the kernel hands the
listening descriptor over, so there is no race to connect), answers the kernel's requests (the
kernel channel's handler table, `_REQUESTS`) with its jobs and sessions (roster.py), and lives
exactly as long as its kernel: when the kernel's connection closes or the kernel's pid exits
(SIGKILL included), every job is torn down and the supervisor exits.
"""

from __future__ import annotations

import contextlib
import logging
import os
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
from elastic_nb.common import machine, procs, registry
from elastic_nb.supervisor import overview
from elastic_nb.supervisor.nodes.cluster import Cluster
from elastic_nb.supervisor.processes.launcher_pool import LauncherPool
from elastic_nb.supervisor.roster import Roster

__all__ = ["Supervisor"]

log = logging.getLogger(__name__)


# A connection to the supervisor's socket (the kernel's, or the panel's): its frames are checked
# a request at a time (Supervisor._handle), so that a request that does not fit is refused in
# its reply, and the connection serves on.
KernelConnection = protocol.connection.AsyncConnection[protocol.wire.Frame]


class Supervisor:
    def __init__(
        self, listen_fd: int, kernel_pid: int, log_path: str, kernel_id: str | None = None
    ) -> None:
        self._listen_fd = listen_fd
        self._kernel_pid = kernel_pid
        self._kernel_id = kernel_id
        # Launchers log beside us until they have a job (then into its run directory).
        self._launchers = LauncherPool(log_path.removesuffix(".log"))
        self._started = time.time()
        self._tg: TaskGroup | None = None
        self._roster: Roster | None = None  # its jobs and sessions, once it runs

    async def run(self) -> None:
        procs.set_child_subreaper()
        sock = socket.socket(fileno=self._listen_fd)
        path = sock.getsockname()
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
                # owner-only, the socket's directory: sessions' sockets go there too
                self._roster = Roster(
                    self._launchers, tg, Path(path).parent, self.orphans, self.reap
                )
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

    def reap(self) -> None:
        procs.reap_orphans(keep=self.roster.launcher_pids())

    def orphans(self) -> list[psutil.Process]:
        """What we inherited as a subreaper: left behind by some job's processes."""
        return procs.orphans(keep=self.roster.launcher_pids())

    @property
    def roster(self) -> Roster:
        assert self._roster is not None, "the supervisor runs"
        return self._roster

    def _shutdown(self) -> None:
        """Stop every job; the task group ends when the last one has torn down."""
        self._launchers.close()
        for job in self.roster.owners():
            job.request_stop("shutdown")
        assert self._tg is not None
        self._tg.start_soon(self._cancel_when_jobs_end)

    async def _cancel_when_jobs_end(self) -> None:
        while any(j.running for j in self.roster.owners()):
            await anyio.sleep(0.05)
        if self.roster.cluster is not None:
            await self.roster.cluster.close()  # the agents hear it now, not from our silence
        assert self._tg is not None
        self._tg.cancel_scope.cancel()

    # ---- requests ---------------------------------------------------------------------------

    async def _serve_connection(self, stream: SocketStream) -> None:
        conn = KernelConnection(stream, _unchecked)
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
        self, conn: KernelConnection, frame: protocol.wire.Frame, blob: bytes | None
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
        self, conn: KernelConnection, msg: protocol.kernel.KernelRequest, blob: bytes | None
    ) -> Mapping[str, object]:
        """What a request asks for, by its kind's handler (`_REQUESTS`); raises what refuses it."""
        handler = _REQUESTS.get(msg["kind"])
        if handler is None:  # a hello after the first: the channel's, but no request
            raise protocol.wire.ProtocolError(f"{msg['kind']!r} is not a request")
        return await handler(self, conn, msg, blob)

    # ---- the requests (each its handler in _REQUESTS) --------------------------------------------

    async def _on_submit(
        self, conn: KernelConnection, msg: protocol.kernel.Submit, blob: Blob
    ) -> protocol.kernel.Submitted:
        return await self.roster.submit(msg, blob, conn.send)

    async def _on_stop(
        self, _c: KernelConnection, msg: protocol.kernel.Stop, _b: Blob
    ) -> protocol.kernel.Stopping:
        return self.roster.stop(msg["job"], msg["reason"])

    async def _on_stacks(
        self, _c: KernelConnection, msg: protocol.kernel.Stacks, _b: Blob
    ) -> protocol.kernel.StackText:
        text, owner = await self.roster.stacks(msg["job"])
        return protocol.kernel.StackText(text=text, pids=overview.rank_pids(owner))

    async def _on_warm(
        self, _c: KernelConnection, msg: protocol.kernel.Warm, _b: Blob
    ) -> protocol.kernel.Done:
        self._launchers.keep_warm(msg["on"])
        return protocol.kernel.Done()

    async def _on_jobs(
        self, _c: KernelConnection, _m: protocol.kernel.Jobs, _b: Blob
    ) -> protocol.kernel.JobList:
        return protocol.kernel.JobList(jobs=self.roster.rows())

    async def _on_status(
        self, _c: KernelConnection, _m: protocol.kernel.Status, _b: Blob
    ) -> protocol.kernel.SupervisorStatus:
        roster = self.roster
        return protocol.kernel.SupervisorStatus(
            pid=os.getpid(),
            uptime_s=time.time() - self._started,
            running=[j.id for j in roster.jobs.values() if j.running],
            sessions=[s.info() for s in roster.sessions.values() if s.running],
            warm=self._launchers.describe(),
            memory={g.id: g.memory_now() for g in roster.owners() if g.running},
        )

    async def _on_up(
        self, conn: KernelConnection, msg: protocol.kernel.Up, _b: Blob
    ) -> protocol.kernel.SessionUp:
        return await self.roster.up(msg, conn.send)

    async def _on_down(
        self, _c: KernelConnection, msg: protocol.kernel.Down, _b: Blob
    ) -> protocol.kernel.Done:
        self.roster.session(msg["session"]).down(msg.get("reason", "user"))
        return protocol.kernel.Done()

    async def _on_session(
        self, _c: KernelConnection, msg: protocol.kernel.SessionInfo, _b: Blob
    ) -> protocol.kernel.SessionState:
        return self.roster.session(msg["session"]).info()

    async def _on_overview(
        self, _c: KernelConnection, _m: protocol.kernel.Overview, _b: Blob
    ) -> protocol.kernel.PanelList:
        roster = self.roster
        return protocol.kernel.PanelList(
            jobs=overview.entries(roster.jobs.values(), roster.sessions.values())
        )

    async def _on_events(
        self, _c: KernelConnection, msg: protocol.kernel.Events, _b: Blob
    ) -> protocol.kernel.EventList:
        report = overview.reporter_of(msg["job"], self.roster.jobs, self.roster.sessions)
        return protocol.kernel.EventList(events=report.events_since(msg["since"]), seq=report.seq)

    async def _on_input(
        self, _c: KernelConnection, msg: protocol.kernel.Input, _b: Blob
    ) -> protocol.kernel.Done:
        ranks = self.roster.ranks_of(msg["job"])
        await ranks.answer_input(msg["attempt"], msg["rank"], msg["ask"], msg["text"], msg["why"])
        return protocol.kernel.Done()

    async def _on_nodes(
        self, _c: KernelConnection, _m: protocol.kernel.Nodes, _b: Blob
    ) -> protocol.kernel.MachineList:
        return self._nodes()

    async def _on_join(
        self, _c: KernelConnection, msg: protocol.kernel.Join, _b: Blob
    ) -> protocol.kernel.JoinLine:
        return await self._join(msg)

    # ---- nodes ---------------------------------------------------------------------------------

    def _nodes(self) -> protocol.kernel.MachineList:
        """This machine and the join agents (%elastic nodes, the panel)."""
        if self.roster.cluster is None:
            here = machine.describe(machine.primary_address(), "")
            return protocol.kernel.MachineList(
                listening=None,
                here=protocol.kernel.Machine(**here, node=0, state="here"),
                agents=[],
            )
        return self.roster.cluster.describe()

    async def _join(self, msg: protocol.kernel.Join) -> protocol.kernel.JoinLine:
        """The join command (the agents' channel opened at the first ask); a new token drops
        the agents holding the old one."""
        assert self._tg is not None
        cluster = self.roster.cluster
        if cluster is None:
            cluster = self.roster.cluster = Cluster(self._tg)
        if cluster.listener is None:
            await cluster.serve(msg["host"], msg["port"])
        elif msg["port"] and msg["port"] != cluster.listener.port:
            raise ValueError(
                f"agents already join on port {cluster.listener.port}: --port cannot "
                "change it while this supervisor runs"
            )
        dropped = await cluster.new_token() if msg["new_token"] else 0
        return protocol.kernel.JoinLine(command=cluster.join_command(), dropped=dropped)


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


def _unchecked(frame: protocol.wire.Frame) -> protocol.wire.Frame:
    return frame


Blob = bytes | None
# Each request of the kernel's channel, and its handler (a Supervisor method), which returns the
# reply's data (of the type protocol.kernel.REPLIES names). The hello is the channel's too, but
# it is the handshake's (Supervisor._serve_connection), no request.
_REQUESTS: dict[
    str, Callable[[Supervisor, KernelConnection, Any, Blob], Awaitable[Mapping[str, object]]]
] = {
    protocol.kernel.SUBMIT: Supervisor._on_submit,
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
    protocol.kernel.INPUT: Supervisor._on_input,
}
