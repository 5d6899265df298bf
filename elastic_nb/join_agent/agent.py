"""A join agent (``elastic-nb join HOST:PORT --token T``): another machine's part in the notebook's
jobs, for as long as the notebook's supervisor lives.

It is a supervisor of its own machine's processes, the notebook's supervisor's hands there: a
zygote and a warm launcher of its own (remote cells start warm), and, for each group (a job or a
session) the supervisor opens on it, a `LocalSite` that starts that group's launcher for each
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

import logging
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import Any

import anyio
import psutil
from anyio.abc import TaskGroup

from elastic_nb import protocol
from elastic_nb.common import machine, procs
from elastic_nb.join_agent.relay import Relay
from elastic_nb.join_agent.served_group import STOP_GRACE_S, Hands, ServedGroup
from elastic_nb.supervisor.nodes.channel import MAX_FRAME, Dialer, Keys
from elastic_nb.supervisor.nodes.files import Mirror
from elastic_nb.supervisor.processes.launcher_pool import LauncherPool

__all__ = ["ORPHAN_BOUND_S", "JoinAgent"]

log = logging.getLogger(__name__)

JOIN_WAIT_S = 15.0  # for the handshake and the welcome
WARM_WAIT_S = 60.0  # for the first warm launcher (torch's import), before the hello
MIRROR_S = 0.05  # how often what the ranks wrote is sent (the supervisor tails every 0.05 s)
MEMORY_S = 1.0
# The supervisor's silence, the grace, SIGKILL's wait: the most the ranks outlive the notebook.
ORPHAN_BOUND_S = protocol.agents.LOST_AFTER_S + STOP_GRACE_S + 2.0
REJOIN_EVERY_S = 2.0


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
        self.info: protocol.records.NodeInfo | None = None
        self.node_number: int | None = None
        self._dialer: Dialer | None = None
        self._pool: LauncherPool | None = None
        self._groups: dict[str, ServedGroup] = {}
        self._relay = Relay(self._send)
        # A group's opening, stop and close, one at a time (an order may not overtake the one
        # before it: a stop overtaking an open would leave its ranks running).
        self._lifecycle: dict[str, anyio.Lock] = {}
        self._last_heard = time.monotonic()
        self._mirror = Mirror(self._send_file, self._may_send)
        self._hands: Hands | None = None  # once it runs
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
                self._hands = Hands(
                    self._send,
                    tg,
                    self._pool,
                    self._relay,
                    self._mirror,
                    self.workdir,
                    self._orphans,
                    self._reap,
                )
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
            if g.site is not None and g.site.running():
                count += 1
                await g.site.stop(STOP_GRACE_S, lambda sig, pids: None)
            await g.forget()
        self._groups.clear()
        return f"the processes of {count} job(s)" if count else ""

    # ---- the channel ---------------------------------------------------------------------------

    async def _send(self, msg: protocol.Message, blob: bytes | None = None) -> None:
        if self._dialer is not None:
            await self._dialer.send(msg, blob)

    async def _beat(self) -> None:
        while True:
            groups = {g.id: g.beat() for g in self._groups.values() if g.site}
            await self._send(
                protocol.agents.Beat(kind=protocol.agents.BEAT, t=time.time(), groups=groups)
            )
            await anyio.sleep(protocol.agents.BEAT_S)

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
            if (
                msg["kind"] == protocol.agents.STREAM_DATA
                or msg["kind"] == protocol.agents.STREAM_CLOSE
            ):
                self._relay.deliver(msg, blob)  # here, in the order it came
                continue
            assert self._tg is not None
            self._tg.start_soon(self._handle, msg, blob)

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
            answer = protocol.agents.Answer(
                kind=protocol.agents.ANSWER, req=req, ok=True, data=dict(data or {})
            )
            await self._send(answer)

    async def _serve(
        self, msg: protocol.agents.NodeOrder, blob: bytes | None
    ) -> Mapping[str, object] | None:
        """What an order asks for, by its kind's handler (`_ORDERS`): the answer's data of an
        order that carries a request number (of the type protocol.agents.ANSWERS names)."""
        handler = _ORDERS.get(msg["kind"])
        if handler is None:  # the handshake's (welcome, refused), or one _receive takes
            raise protocol.wire.ProtocolError(f"{msg['kind']!r} is not an order")
        return await handler(self, msg, blob)

    # ---- the orders (each its handler in _ORDERS) ----------------------------------------------

    async def _on_beat(self, _m: protocol.agents.Beat, _b: Blob) -> None:
        return None

    async def _on_open(self, msg: protocol.agents.Open, blob: Blob) -> protocol.agents.Opened:
        group_id = msg["group"]
        if not group_id.isalnum():
            raise ValueError(f"group id {group_id!r} is malformed")
        assert self._hands is not None and self.info is not None
        g = self._groups.get(group_id)
        if g is None:
            node_dir = f"{self.node_number}-{self.info['name']}"
            g = await ServedGroup.create(msg, blob or b"", node_dir, self._hands)
            self._groups[group_id] = g
        return await g.open_round(msg, self.info["addr"])

    async def _on_cell(
        self, msg: protocol.agents.CellFiles, blob: Blob
    ) -> protocol.agents.CellUnpacked:
        return await self._group(msg["group"]).cell(msg["cell"], blob or b"")

    async def _on_signal(self, msg: protocol.agents.Signal, _b: Blob) -> None:
        g = self._group(msg["group"])
        r = g.ranks.get((msg["attempt"], msg["rank"]))
        if g.site is not None and r is not None:
            g.site.signal(r, msg["sig"])

    async def _on_ranks_up(self, msg: protocol.agents.RanksUp, _b: Blob) -> None:
        g = self._group(msg["group"])
        if g.site is not None and g.spec is not None:
            g.site.ranks_up(g.spec)

    async def _on_close(self, msg: protocol.agents.Close, _b: Blob) -> None:
        g = self._group(msg["group"])
        await g.close_round()
        if msg["ended"]:
            await g.forget()
            self._groups.pop(g.id, None)
            self._lifecycle.pop(g.id, None)

    async def _on_stacks(self, msg: protocol.agents.NodeStacks, _b: Blob) -> protocol.agents.Dumps:
        g = self._group(msg["group"])
        site = g.round()
        ranks = [g.ranks[(a, r)] for a, r in msg["ranks"] if (a, r) in g.ranks]
        dumps = await site.stacks(ranks, msg["wait_s"])
        # The answer is one frame of the channel: each rank's dump keeps its last lines (the
        # main thread's, which faulthandler writes last) within an even share of it.
        share = MAX_FRAME // 2 // max(1, len(dumps))
        return protocol.agents.Dumps(
            dumps={
                str(rank): protocol.agents.RankDump(
                    text=_tail(d.text, share),
                    state=list(d.state) if d.state else None,
                    asked=d.asked,
                )
                for rank, d in dumps.items()
            }
        )

    async def _on_probe(self, msg: protocol.agents.Probe, _b: Blob) -> protocol.agents.ProbeAnswer:
        g = self._group(msg["group"])
        site = g.round()
        r = g.ranks.get((msg["attempt"], msg["rank"]))
        record = await site.probe(r, msg["what"], msg["wait_s"]) if r else None
        return protocol.agents.ProbeAnswer(record=record)

    async def _on_leftovers(
        self, msg: protocol.agents.Leftovers, _b: Blob
    ) -> protocol.agents.LeftoverList:
        site = self._group(msg["group"]).round()
        stuck = msg["stuck"]
        left = await site.leftovers_after_success(msg["grace"], lambda: stuck)
        return protocol.agents.LeftoverList(leftovers=left)

    async def _on_stop(self, msg: protocol.agents.NodeStop, _b: Blob) -> protocol.agents.Stopped:
        g = self._group(msg["group"])
        site = g.round()
        signals: list[protocol.agents.SignalSent] = []

        def sent(sig: str, pids: list[int]) -> None:
            signals.append(protocol.agents.SignalSent(sig=sig, pids=pids))

        survivors = await site.stop(msg["grace"], sent)
        await self._mirror.sweep(g.id)  # everything the ranks left, before the answer
        return protocol.agents.Stopped(
            survivors=survivors,
            signals=signals,
        )

    def _group(self, group_id: str) -> ServedGroup:
        g = self._groups.get(group_id)
        if g is None:
            raise KeyError(f"no group {group_id} here")
        return g

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
        return g is not None and g.may_send(rel)

    async def _mirror_loop(self) -> None:
        while True:
            await self._mirror.sweep()
            await anyio.sleep(MIRROR_S)

    async def _memory_loop(self) -> None:
        while True:
            await anyio.sleep(MEMORY_S)
            for g in list(self._groups.values()):
                if (reading := g.memory()) is not None:
                    await self._send(reading)

    async def _reap_loop(self) -> None:
        while True:
            await anyio.sleep(1.0)
            self._reap()

    def _keep(self) -> set[int]:
        assert self._pool is not None
        live = {g.site.launcher_pid for g in self._groups.values() if g.site}
        return {p for p in live if p} | self._pool.pids()

    def _reap(self) -> None:
        procs.reap_orphans(keep=self._keep())

    def _orphans(self) -> list[Any]:
        return procs.orphans(keep=self._keep())


def _tail(text: str, limit: int) -> str:
    """`text`'s last whole lines within `limit` bytes (UTF-8)."""
    data = text.encode()
    if len(data) <= limit:
        return text
    kept = data[-limit:]
    return "...\n" + kept[kept.find(b"\n") + 1 :].decode(errors="replace")


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
# Each order of the agents' channel this agent serves, and its handler (a JoinAgent method); the
# handshake's welcome and refused, bye and the streams' data are _receive's.
_ORDERS: dict[str, Callable[[JoinAgent, Any, Blob], Awaitable[Mapping[str, object] | None]]] = {
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
