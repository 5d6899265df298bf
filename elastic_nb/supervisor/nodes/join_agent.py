"""A join agent (``elastic-nb join HOST:PORT --token T``): another machine's part in the notebook's
jobs, for as long as the notebook's supervisor lives.

It is a supervisor of its own machine's processes, the notebook's supervisor's hands there: a
zygote and a warm launcher of its own (remote cells start warm), and, for each group (a job or a
session) the supervisor opens on it, a `LocalNode` that starts that group's launcher for each
round, watches its ranks, signals them, asks for their stacks and flight recorders, and ends
their processes, exactly as on the notebook's machine. What its ranks leave in their run
directory is mirrored to the notebook's (files.Mirror); their connections to the rendezvous store
and to a session are relayed through the channel, so that nothing of a job listens beyond this
machine's loopback but what gloo and NCCL must (and rank 0's process-group store).

It hears the supervisor's heartbeat: if the supervisor goes silent (its kernel died, the network
was cut) the agent ends every process of its groups within `ORPHAN_BOUND_S` and exits, or with
``--rejoin``, waits to join again.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import shutil
import signal
import socket
import struct
import sys
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import anyio
import psutil
from anyio.abc import ByteStream, SocketListener, TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from elastic_nb import protocol
from elastic_nb.common import machine, procs
from elastic_nb.common.rundir import CHECKPOINTS, RunDir
from elastic_nb.common.spec import JobSpec
from elastic_nb.supervisor.nodes.channel import MAX_FRAME, Dialer, Keys
from elastic_nb.supervisor.nodes.files import Mirror, owner, unpack
from elastic_nb.supervisor.processes.launcher_pool import LauncherPool
from elastic_nb.supervisor.processes.node import LocalNode
from elastic_nb.supervisor.ranks.rank_state import RankState

__all__ = ["ORPHAN_BOUND_S", "JoinAgent", "connected_from"]

log = logging.getLogger(__name__)

JOIN_WAIT_S = 15.0  # for the handshake and the welcome
WARM_WAIT_S = 60.0  # for the first warm launcher (torch's import), before the hello
MIRROR_S = 0.05  # how often what the ranks wrote is sent (the supervisor tails every 0.05 s)
MEMORY_S = 1.0
STOP_GRACE_S = 1.0  # ranks' SIGTERM -> SIGKILL once the supervisor is gone
# The supervisor's silence, the grace, SIGKILL's wait: the most the ranks outlive the notebook.
ORPHAN_BOUND_S = protocol.agents.LOST_AFTER_S + STOP_GRACE_S + 2.0
REJOIN_EVERY_S = 2.0
_READ = 1 << 16


class _Group:
    """One group (a job or a session) the supervisor runs here: its run directory and per-job
    working directory, its listeners, and the current round's node."""

    def __init__(self, group_id: str, rd: RunDir, cwd: Path, session: bool) -> None:
        self.id = group_id
        self.rd = rd
        self.cwd = cwd
        self.session = session
        self.spec: JobSpec | None = None
        self.node: LocalNode | None = None
        self.ranks: dict[tuple[int, int], RankState] = {}
        # (attempt, rank) the supervisor has been told the launcher started: their files may go
        # (files.NodeFiles refuses a rank's file it has not heard of).
        self.told: set[tuple[int, int]] = set()
        # What the supervisor sends to each relayed connection, in order (one writer each).
        self.streams: dict[int, MemoryObjectSendStream[bytes]] = {}
        self.store: SocketListener | None = None  # launchers' connections to the rendezvous
        self.store_port = 0
        self.sessions: SocketListener | None = None  # session ranks' connections
        self.socket_path: Path | None = None
        self.oom_base: int | None = None


class JoinAgent:
    def __init__(
        self,
        host: str,
        port: int,
        keys: Keys,
        workdir: Path,
        addr: str | None = None,
        rejoin: bool = False,
    ) -> None:
        self.host, self.port, self.keys = host, port, keys
        self.workdir = workdir
        self.addr = addr
        self.rejoin = rejoin
        self.info: protocol.agents.NodeInfo | None = None
        self.node_number: int | None = None
        self._dialer: Dialer | None = None
        self._pool: LauncherPool | None = None
        self._groups: dict[str, _Group] = {}
        self._stream_ids = itertools.count(1)
        # A group's opening, stop and close, one at a time (an order may not overtake the one
        # before it: a stop overtaking an open would leave its ranks running).
        self._lifecycle: dict[str, anyio.Lock] = {}
        self._last_heard = time.monotonic()
        self._mirror = Mirror(self._send_file, self._may_send)
        self._tg: TaskGroup | None = None
        self._leaving: str | None = None  # why this membership ends
        self._stopped = False  # a signal said to leave for good
        self._said_bye = False  # the supervisor said bye (it ended, or dropped this agent)

    # ---- life ------------------------------------------------------------------------------

    async def run(self) -> int:
        """Join, serve until the supervisor is gone (or says bye); the exit status."""
        procs.set_child_subreaper()
        for d in ("runs", "jobs", "logs", "sockets"):
            (self.workdir / d).mkdir(parents=True, exist_ok=True, mode=0o700)
        self._pool = LauncherPool(str(self.workdir / "logs" / "agent"))
        code = 0
        try:
            async with anyio.create_task_group() as tg:
                self._tg = tg
                self._pool.attach(tg, dict(os.environ))
                tg.start_soon(self._watch_signals)
                while True:
                    code = await self._serve_once()
                    if not self.rejoin or code == 2 or self._stopped:
                        break
                    await anyio.sleep(REJOIN_EVERY_S)
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                await self._end_groups()
            self._pool.close()
        return code

    async def _serve_once(self) -> int:
        """One membership: join, serve, and end every group once the supervisor is gone."""
        self._leaving = None
        self._said_bye = False
        dialer = self._dialer = Dialer(self.keys, self.host, self.port)
        try:
            with anyio.fail_after(JOIN_WAIT_S):
                await dialer.handshake()
            # Joined means warm: a job that takes this node starts its ranks in a fraction of a
            # second, not after an import of torch.
            assert self._pool is not None
            await self._pool.warmed(WARM_WAIT_S)
            with anyio.fail_after(JOIN_WAIT_S):
                addr = self.addr or _local_address(dialer)
                self.info = machine.describe(addr, str(self.workdir))
                hello = protocol.agents.NodeHello(
                    kind=protocol.agents.NODE_HELLO, version=protocol.wire.VERSION, info=self.info
                )
                await dialer.send(hello, (_local_endpoint(dialer) or "").encode())
                frame, _ = await dialer.receive()
        except PermissionError as e:
            _say(f"elastic-nb join: refused: {e}")
            dialer.close()
            return 2
        except TimeoutError:
            _say(f"elastic-nb join: no supervisor answered at {self.host}:{self.port}")
            dialer.close()
            return 1
        msg = protocol.agents.node_order(frame)
        if msg["kind"] == protocol.agents.REFUSED:
            _say(f"elastic-nb join: refused: {msg['error']}")
            dialer.close()
            return 2
        assert msg["kind"] == protocol.agents.WELCOME and self.info is not None
        self.node_number = msg["node"]
        _say(
            f"elastic-nb join: node {msg['node']} ({self.info['name']}, {self.info['addr']}) of "
            f"the notebook's supervisor on {msg['info']['name']}, {self.host}:{self.port}; "
            "serving its jobs until it is gone"
        )
        self._last_heard = time.monotonic()
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self._receive)
                tg.start_soon(self._beat)
                tg.start_soon(self._mirror_loop)
                tg.start_soon(self._memory_loop)
                tg.start_soon(self._reap_loop)
                await self._until_gone()
                tg.cancel_scope.cancel()
        finally:
            with anyio.CancelScope(shield=True):
                ended = await self._end_groups()
                if not self._said_bye:
                    with anyio.move_on_after(1):
                        await dialer.send(
                            protocol.agents.NodeBye(kind=protocol.agents.BYE, reason="leaving")
                        )
                dialer.close()
                self._dialer = None
        _say(f"elastic-nb join: {self._leaving}" + (f"; ended {ended}" if ended else ""))
        return 0 if self._said_bye or self._stopped else 1

    async def _until_gone(self) -> None:
        while self._leaving is None:
            await anyio.sleep(protocol.agents.BEAT_S / 2)
            if time.monotonic() - self._last_heard > protocol.agents.LOST_AFTER_S:
                self._leaving = f"the notebook's supervisor has been silent for {protocol.agents.LOST_AFTER_S:g} s"

    async def _watch_signals(self) -> None:
        with anyio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
            async for sig in signals:
                self.rejoin = False
                self._stopped = True
                self._leaving = f"stopped by {signal.Signals(sig).name}"
                if self._dialer is None:  # between memberships: nothing runs to end
                    assert self._tg is not None
                    self._tg.cancel_scope.cancel()
                return

    async def _end_groups(self) -> str:
        """End every process of every group (SIGTERM, a short grace, SIGKILL)."""
        groups = list(self._groups.values())
        count = 0
        for g in groups:
            if g.node is not None and g.node.running():
                count += 1
                await g.node.stop(STOP_GRACE_S, lambda sig, pids: None)
            await self._forget(g)
        self._groups.clear()
        return f"the processes of {count} job(s)" if count else ""

    # ---- the channel ---------------------------------------------------------------------------

    async def _send(self, msg: protocol.Message, blob: bytes | None = None) -> None:
        if self._dialer is not None:
            await self._dialer.send(msg, blob)

    async def _beat(self) -> None:
        while True:
            groups = {g.id: self._group_beat(g) for g in self._groups.values() if g.node}
            await self._send(
                protocol.agents.Beat(kind=protocol.agents.BEAT, t=time.time(), groups=groups)
            )
            await anyio.sleep(protocol.agents.BEAT_S)

    def _group_beat(self, g: _Group) -> protocol.agents.GroupBeat:
        node = g.node
        assert node is not None
        agent = node.agent() if node.launcher_pid else None
        kills = node.oom_kills()
        return protocol.agents.GroupBeat(
            launcher=node.launcher_pid,
            launcher_alive=node.launcher_alive(),
            state=list(agent.state) if agent and agent.state else None,
            tick_age=time.monotonic() - agent.last_tick if agent and agent.last_tick else None,
            running=node.running(),
            zombies=[[r.attempt, r.rank] for r in g.ranks.values() if node.unreaped(r)],
            oom_kills=None if kills is None or g.oom_base is None else kills - g.oom_base,
        )

    async def _receive(self) -> None:
        assert self._dialer is not None
        while True:
            frame, blob = await self._dialer.receive()
            self._last_heard = time.monotonic()
            try:
                msg = protocol.agents.node_order(frame)
            except protocol.wire.ProtocolError as e:
                log.warning("dropped a message from the supervisor: %s", e)
                continue
            if msg["kind"] == protocol.agents.BYE:
                assert msg["kind"] == protocol.agents.BYE
                self._leaving = f"the notebook's supervisor said bye: {msg['reason']}"
                self._said_bye = True
                return
            if msg["kind"] in (protocol.agents.STREAM_DATA, protocol.agents.STREAM_CLOSE):
                self._relay(msg, blob)  # here, in the order it came
                continue
            assert self._tg is not None
            self._tg.start_soon(self._handle, msg, blob)

    def _relay(self, msg: protocol.agents.NodeOrder, blob: bytes | None) -> None:
        """The supervisor's side of a relayed connection: to its writer here."""
        assert msg["kind"] in (protocol.agents.STREAM_DATA, protocol.agents.STREAM_CLOSE)
        known = self._groups.get(msg["group"])
        inbox = known.streams.get(msg["stream"]) if known else None
        if inbox is None:
            return
        if msg["kind"] == protocol.agents.STREAM_DATA and blob:
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                inbox.send_nowait(blob)
        elif msg["kind"] == protocol.agents.STREAM_CLOSE:
            inbox.close()

    async def _handle(self, msg: protocol.agents.NodeOrder, blob: bytes | None) -> None:
        req = msg.get("req")
        try:
            if msg["kind"] in (protocol.agents.OPEN, protocol.agents.STOP, protocol.agents.CLOSE):
                lock = self._lifecycle.setdefault(str(msg.get("group")), anyio.Lock())
                async with lock:
                    data = await self._serve(msg, blob)
            else:
                data = await self._serve(msg, blob)
        except Exception as e:
            log.exception("the supervisor's %s failed", msg["kind"])
            if isinstance(req, int):
                error = f"{type(e).__name__}: {e}"
                await self._send(
                    protocol.agents.Answer(
                        kind=protocol.agents.ANSWER, req=req, ok=False, data={}, error=error
                    )
                )
            return
        if isinstance(req, int):
            await self._send(
                protocol.agents.Answer(kind=protocol.agents.ANSWER, req=req, ok=True, data=data)
            )

    async def _serve(self, msg: protocol.agents.NodeOrder, blob: bytes | None) -> dict[str, Any]:
        """What an order asks for, by its kind's handler (`_ORDERS`)."""
        handler = _ORDERS.get(msg["kind"])
        if handler is None:  # the handshake's (welcome, refused), or one _receive takes
            raise protocol.wire.ProtocolError(f"{msg['kind']!r} is not an order")
        return await handler(self, msg, blob)

    # ---- the orders (each its handler in _ORDERS) ----------------------------------------------

    async def _on_beat(self, _m: protocol.agents.Beat, _b: Blob) -> Data:
        return {}

    async def _on_open(self, msg: protocol.agents.Open, blob: Blob) -> Data:
        return await self._open(msg, blob or b"")

    async def _on_cell(self, msg: protocol.agents.CellFiles, blob: Blob) -> Data:
        g = self._group(msg["group"])
        cell = self.workdir / "runs" / msg["cell"]
        cell.mkdir(mode=0o700, exist_ok=True)
        await anyio.to_thread.run_sync(unpack, blob or b"", {"run": cell, "cwd": g.cwd})
        self._rewrite_spec(RunDir(cell), g)
        self._mirror.roots[cell] = (g.id, msg["cell"])
        return {"run_dir": str(cell)}

    async def _on_signal(self, msg: protocol.agents.Signal, _b: Blob) -> Data:
        g = self._group(msg["group"])
        r = g.ranks.get((msg["attempt"], msg["rank"]))
        if g.node is not None and r is not None:
            g.node.signal(r, msg["sig"])
        return {}

    async def _on_ranks_up(self, msg: protocol.agents.RanksUp, _b: Blob) -> Data:
        g = self._group(msg["group"])
        if g.node is not None and g.spec is not None:
            g.node.ranks_up(g.spec)
        return {}

    async def _on_close(self, msg: protocol.agents.Close, _b: Blob) -> Data:
        g = self._group(msg["group"])
        if g.node is not None:
            # Closed with its launcher still running (the supervisor's teardown came first):
            # stopped now. Only the launcher counts: the group's processes are found by its
            # marker, which on a machine shared with other nodes of the job marks theirs too.
            if g.node.running(leftovers_too=False):
                await g.node.stop(STOP_GRACE_S, lambda sig, pids: None)
            g.node.close()  # its launcher's log into the run directory, the pool warmed
            g.node = None
        await self._mirror.sweep(g.id)
        if msg["ended"]:
            await self._forget(g)
            self._groups.pop(g.id, None)
            self._lifecycle.pop(g.id, None)
        return {}

    async def _on_stacks(self, msg: protocol.agents.NodeStacks, _b: Blob) -> Data:
        g, node = self._round(msg["group"])
        ranks = [g.ranks[(a, r)] for a, r in msg["ranks"] if (a, r) in g.ranks]
        dumps = await node.stacks(ranks, msg["wait_s"])
        # The answer is one frame of the channel: each rank's dump keeps its last lines (the
        # main thread's, which faulthandler writes last) within an even share of it.
        share = MAX_FRAME // 2 // max(1, len(dumps))
        return {
            "dumps": {
                str(rank): {"text": _tail(d.text, share), "state": d.state, "asked": d.asked}
                for rank, d in dumps.items()
            }
        }

    async def _on_probe(self, msg: protocol.agents.Probe, _b: Blob) -> Data:
        g, node = self._round(msg["group"])
        r = g.ranks.get((msg["attempt"], msg["rank"]))
        record = await node.probe(r, msg["what"], msg["wait_s"]) if r else None
        return {"record": record}

    async def _on_leftovers(self, msg: protocol.agents.Leftovers, _b: Blob) -> Data:
        _, node = self._round(msg["group"])
        stuck = msg["stuck"]
        left = await node.leftovers_after_success(msg["grace"], lambda: stuck)
        return {"leftovers": left}

    async def _on_stop(self, msg: protocol.agents.NodeStop, _b: Blob) -> Data:
        g, node = self._round(msg["group"])
        signals: list[list[Any]] = []
        survivors = await node.stop(msg["grace"], lambda sig, pids: signals.append([sig, pids]))
        await self._mirror.sweep(g.id)  # everything the ranks left, before the answer
        return {
            "survivors": [[s.pid, s.state] for s in survivors],
            "signals": signals,
        }

    def _round(self, group_id: str) -> tuple[_Group, LocalNode]:
        """The group and its round's node here (an order about ranks needs one)."""
        g = self._group(group_id)
        if g.node is None:
            raise RuntimeError(f"group {g.id} has no round running here")
        return g, g.node

    def _group(self, group_id: str) -> _Group:
        g = self._groups.get(group_id)
        if g is None:
            raise KeyError(f"no group {group_id} here")
        return g

    # ---- a group's round -----------------------------------------------------------------------

    async def _open(self, msg: protocol.agents.Open, blob: bytes) -> dict[str, Any]:
        group_id = msg["group"]
        if not group_id.isalnum():
            raise ValueError(f"group id {group_id!r} is malformed")
        g = self._groups.get(group_id)
        if g is None:
            g = await self._new_group(group_id, msg, blob)
        spec = g.spec
        assert spec is not None and self._pool is not None and self.info is not None
        if g.node is not None:
            raise RuntimeError(f"group {group_id}'s last round here has not been closed")
        plan = msg["round"]
        addr = self.info["addr"]
        launch = protocol.launcher.LaunchRound(
            attempt=int(plan["attempt"]),
            nnodes=int(plan["nnodes"]),
            run_id=str(plan["run_id"]),
            endpoint=f"127.0.0.1:{g.store_port}",
            addr=addr,
            ifname=machine.interface_holding(addr),
            key=str(plan["key"]),
        )
        node = LocalNode(g.rd, self._pool, self._orphans, self._reap)
        g.node = node
        kills = node.oom_kills()
        g.oom_base = kills
        env = dict(os.environ)
        if g.socket_path is not None:
            env[protocol.sessions.SESSION_SOCKET_ENV] = str(g.socket_path)
        env.update(msg["env"])
        warm = await node.start(group_id, spec, env, launch)
        assert self._tg is not None
        self._tg.start_soon(self._read_launcher, g, node)
        return {"warm": warm, "launcher": node.launcher_pid}

    async def _new_group(self, group_id: str, msg: protocol.agents.Open, blob: bytes) -> _Group:
        rd = RunDir(self.workdir / "runs" / group_id)
        cwd = self.workdir / "jobs" / group_id
        rd.path.mkdir(mode=0o700, exist_ok=True)
        cwd.mkdir(mode=0o700, exist_ok=True)
        await anyio.to_thread.run_sync(unpack, blob, {"run": rd.path, "cwd": cwd})
        g = _Group(group_id, rd, cwd, session=msg["session"])
        g.spec = self._rewrite_spec(rd, g, JobSpec.from_dict(msg["spec"]))
        self._groups[group_id] = g
        self._mirror.roots[rd.path] = (group_id, "")
        self._mirror.renames["launcher.log"] = f"nodes/{self._node_dir()}/launcher.log"
        assert self._tg is not None
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # on loopback alone
        sock.bind(("127.0.0.1", 0))
        sock.listen(socket.SOMAXCONN)
        store = await SocketListener.from_socket(sock)
        g.store, g.store_port = store, sock.getsockname()[1]
        self._tg.start_soon(
            _serve, store, lambda s: self._stream(g, s, protocol.agents.STREAM_STORE), self._tg
        )
        if g.session:
            g.socket_path = self.workdir / "sockets" / f"session-{group_id}.sock"
            with contextlib.suppress(FileNotFoundError):
                g.socket_path.unlink()
            sessions = await anyio.create_unix_listener(g.socket_path)
            g.sessions = sessions
            os.chmod(g.socket_path, 0o600)
            self._tg.start_soon(
                _serve,
                sessions,
                lambda s: self._stream(g, s, protocol.agents.STREAM_SESSION),
                self._tg,
            )
        return g

    def _rewrite_spec(self, rd: RunDir, g: _Group, spec: JobSpec | None = None) -> JobSpec:
        """The spec as this machine runs it: the job's working directory here (the notebook's
        modules in it, first on sys.path), its run directories under the agent's."""
        from dataclasses import replace

        spec = spec or JobSpec.from_json(rd.spec.read_text())
        spec = replace(
            spec, cwd=str(g.cwd), sys_path=(str(g.cwd),), log_dir=str(self.workdir / "runs")
        )
        rd.spec.write_text(spec.to_json())
        return spec

    def _node_dir(self) -> str:
        assert self.info is not None
        return f"{self.node_number}-{self.info['name']}"

    async def _read_launcher(self, g: _Group, node: LocalNode) -> None:
        """The round's launcher: what it says, to the supervisor; a watcher per rank it starts."""
        assert self._tg is not None
        async for msg in node.messages():
            if msg["kind"] == protocol.launcher.START:
                r = RankState(msg["attempt"], msg["rank"], pid=msg["pid"], started_at=time.time())
                g.ranks[(r.attempt, r.rank)] = r
                self._tg.start_soon(self._watch_rank, g, node, r)
            await self._send(
                protocol.agents.LauncherSaid(
                    kind=protocol.agents.LAUNCHER, group=g.id, msg=dict(msg)
                )
            )
            if msg["kind"] == protocol.launcher.START:
                g.told.add((msg["attempt"], msg["rank"]))
        await node.launcher_exited()
        outcome, reason = node.launcher_outcome(g.rd.launcher_log)
        await self._mirror.sweep(g.id)
        await self._send(
            protocol.agents.LauncherExit(
                kind=protocol.agents.LAUNCHER_EXIT, group=g.id, outcome=outcome, reason=reason
            )
        )

    async def _watch_rank(self, g: _Group, node: LocalNode, r: RankState) -> None:
        seen, _ = await node.wait_gone(r)
        r.died_at = seen
        # What it left (its last lines, its record), before the supervisor hears it went.
        prefix = f"rank-{r.rank}."
        await self._mirror.sweep(g.id, only=lambda p: p.name.startswith(prefix))
        await self._send(
            protocol.agents.RankGone(
                kind=protocol.agents.RANK_GONE,
                group=g.id,
                attempt=r.attempt,
                rank=r.rank,
                t=seen,
                code=r.exit_code,
            )
        )

    async def _stream(self, g: _Group, stream: ByteStream, to: str) -> None:
        """A connection to one of the group's listeners here, relayed to the supervisor: what
        it sends, read here; what the supervisor sends back, written by one task, in order."""
        if to == protocol.agents.STREAM_STORE:
            # torch's agent, the store's one client, unpickles its state: another local user's
            # process must not reach the notebook's store.
            launcher = g.node.launcher_pid if g.node is not None else None
            sock = stream.extra(anyio.abc.SocketAttribute.raw_socket)
            if not await anyio.to_thread.run_sync(connected_from, launcher, sock):
                await stream.aclose()
                return
        n = next(self._stream_ids)
        inbox, outbox = anyio.create_memory_object_stream[bytes](math.inf)
        g.streams[n] = inbox
        peer = _peer_pid(stream) if to == protocol.agents.STREAM_SESSION else None
        try:
            await self._send(
                protocol.agents.StreamOpen(
                    kind=protocol.agents.STREAM_OPEN, group=g.id, stream=n, to=to, peer=peer
                )
            )
            async with anyio.create_task_group() as tg:
                tg.start_soon(_write_all, stream, outbox)
                while True:
                    try:
                        data = await stream.receive(_READ)
                    except (
                        anyio.EndOfStream,
                        anyio.BrokenResourceError,
                        anyio.ClosedResourceError,
                    ):
                        break
                    await self._send(
                        protocol.agents.StreamData(
                            kind=protocol.agents.STREAM_DATA, group=g.id, stream=n
                        ),
                        data,
                    )
                tg.cancel_scope.cancel()
        finally:
            g.streams.pop(n, None)
            inbox.close()
            with contextlib.suppress(Exception):  # the channel may be gone with the supervisor
                await self._send(
                    protocol.agents.StreamClose(
                        kind=protocol.agents.STREAM_CLOSE, group=g.id, stream=n
                    )
                )
            with contextlib.suppress(Exception):
                await stream.aclose()

    async def _forget(self, g: _Group) -> None:
        """A group has ended here: its listeners and streams closed, its files removed (the
        notebook's run directory has them all)."""
        for inbox in g.streams.values():
            inbox.close()  # its writer closes the connection
        for listener in (g.store, g.sessions):
            if listener is not None:
                with contextlib.suppress(Exception):
                    await listener.aclose()
        cells = [top for top, (group, root) in self._mirror.roots.items() if group == g.id and root]
        self._mirror.drop(g.id)
        if g.socket_path is not None:
            with contextlib.suppress(OSError):
                g.socket_path.unlink()
        for path in (g.rd.path, g.cwd, *cells):
            shutil.rmtree(path, ignore_errors=True)

    # ---- loops ---------------------------------------------------------------------------------

    async def _send_file(self, group: str, root: str, path: str, offset: int, data: bytes) -> None:
        await self._send(
            protocol.agents.FileChunk(
                kind=protocol.agents.FILE, group=group, root=root, path=path, offset=offset
            ),
            data,
        )

    def _may_send(self, group: str, rel: str) -> bool:
        """A rank's file once the supervisor knows its launcher started it (files.NodeFiles)."""
        g = self._groups.get(group)
        if g is None:
            return False
        if rel == CHECKPOINTS:
            return any(r == 0 for _, r in g.told)  # rank 0 keeps them
        rank = owner(rel)
        return rank is None or rank in g.told

    async def _mirror_loop(self) -> None:
        while True:
            await self._mirror.sweep()
            await anyio.sleep(MIRROR_S)

    async def _memory_loop(self) -> None:
        while True:
            await anyio.sleep(MEMORY_S)
            for g in list(self._groups.values()):
                node = g.node
                live = [r for r in g.ranks.values() if r.died_at is None and r.pid is not None]
                if node is None or not live:
                    continue
                reading = node.read_memory(live)
                limit = reading.limit
                await self._send(
                    protocol.agents.MemoryRead(
                        kind=protocol.agents.MEMORY,
                        group=g.id,
                        rss={str(k): v for k, v in reading.rss.items()},
                        gpu={str(k): v for k, v in reading.gpu.items()},
                        limit=None if limit is None else vars(limit),
                        gpus=reading.gpus,
                    )
                )

    async def _reap_loop(self) -> None:
        while True:
            await anyio.sleep(1.0)
            self._reap()

    def _keep(self) -> set[int]:
        assert self._pool is not None
        live = {g.node.launcher_pid for g in self._groups.values() if g.node}
        return {p for p in live if p} | self._pool.pids()

    def _reap(self) -> None:
        procs.reap_orphans(keep=self._keep())

    def _orphans(self) -> list[Any]:
        return procs.orphans(keep=self._keep())


async def _serve(listener: SocketListener, handler: Any, tg: TaskGroup) -> None:
    """Each connection to `handler`, in `tg`, until the listener is closed (the group ended)."""
    while True:
        try:
            stream = await listener.accept()
        except (anyio.ClosedResourceError, anyio.BrokenResourceError, OSError):
            return
        tg.start_soon(handler, stream)


async def _write_all(stream: ByteStream, outbox: MemoryObjectReceiveStream[bytes]) -> None:
    """What the supervisor sends to a relayed connection, in order; the connection closed
    once it has said its last (or the connection broke)."""
    async with outbox:
        async for data in outbox:
            try:
                await stream.send(data)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                return
    with contextlib.suppress(Exception):
        await stream.aclose()


def _tail(text: str, limit: int) -> str:
    """`text`'s last whole lines within `limit` bytes (UTF-8)."""
    data = text.encode()
    if len(data) <= limit:
        return text
    kept = data[-limit:]
    return "...\n" + kept[kept.find(b"\n") + 1 :].decode(errors="replace")


def connected_from(pid: int | None, sock: socket.socket) -> bool:
    """Whether the process at the other end of a loopback connection we accepted is `pid`."""
    if pid is None:
        return False
    try:
        ours, theirs = _end(sock.getsockname()), _end(sock.getpeername())
    except OSError:
        return False
    for c in psutil.net_connections("tcp"):
        if c.laddr and c.raddr and (_end(c.laddr), _end(c.raddr)) == (theirs, ours):
            return bool(c.pid == pid)
    return False


def _end(address: Any) -> tuple[str, int]:
    """A TCP endpoint as (IPv4 address, port): torch's store client connects from an IPv6
    socket, whose end is an IPv4-mapped address (::ffff:127.0.0.1)."""
    ip, port = address[0], address[1]
    return ip.removeprefix("::ffff:"), int(port)


def _peer_pid(stream: ByteStream) -> int | None:
    sock = stream.extra(anyio.abc.SocketAttribute.raw_socket)
    with contextlib.suppress(OSError):
        creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid: int = struct.unpack("3i", creds)[0]
        return pid
    return None


def _local_endpoint(dialer: Dialer) -> str | None:
    """Our end of the connection ("ip:port"), as the supervisor's monitor will name it when it
    drops: this process's one TCP connection to the supervisor's address."""
    me = psutil.Process()
    conns = me.net_connections("tcp") if hasattr(me, "net_connections") else me.connections()
    for c in conns:
        if c.raddr and (c.raddr.ip, c.raddr.port) == dialer.server and c.laddr:
            return f"{c.laddr.ip}:{c.laddr.port}"
    return None


def _local_address(dialer: Dialer) -> str:
    """The address this machine reaches the supervisor from: the other nodes reach it there."""
    endpoint = _local_endpoint(dialer)
    return endpoint.rsplit(":", 1)[0] if endpoint else machine.primary_address()


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def run_agent(endpoint: str, token: str, workdir: Path, addr: str | None, rejoin: bool) -> int:
    """`elastic-nb join`: join the supervisor at `endpoint` ("HOST:PORT") with `token`."""
    host, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit():
        _say(f"elastic-nb join: {endpoint!r} is not HOST:PORT")
        return 2
    keys = Keys.from_token(token)
    logging.basicConfig(
        stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s"
    )
    agent = JoinAgent(host.strip("[]"), int(port), keys, workdir, addr, rejoin)
    return anyio.run(agent.run)


Blob = bytes | None
Data = dict[str, Any]  # an answer's data
# Each order of the agents' channel this agent serves, and its handler (a JoinAgent method); the
# handshake's welcome and refused, bye and the streams' data are _receive's.
_ORDERS: dict[str, Callable[[JoinAgent, Any, Blob], Awaitable[Data]]] = {
    protocol.agents.BEAT: JoinAgent._on_beat,
    protocol.agents.OPEN: JoinAgent._on_open,
    protocol.agents.CELL: JoinAgent._on_cell,
    protocol.agents.SIGNAL: JoinAgent._on_signal,
    protocol.agents.RANKS_UP: JoinAgent._on_ranks_up,
    protocol.agents.CLOSE: JoinAgent._on_close,
    protocol.agents.STACKS: JoinAgent._on_stacks,
    protocol.agents.PROBE: JoinAgent._on_probe,
    protocol.agents.LEFTOVERS: JoinAgent._on_leftovers,
    protocol.agents.STOP: JoinAgent._on_stop,
}
