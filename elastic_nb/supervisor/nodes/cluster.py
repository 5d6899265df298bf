"""The machines a supervisor's multi-node jobs run on: this one, and the join agents connected
now (`%elastic nodes`).

`Cluster` serves the agents' channel (channel.Listener) once the first join command is asked
for: it admits an agent whose versions match the notebook's (refusing one that differs, naming
both), numbers it, hears its heartbeat, and knows within `protocol.agents.LOST_AFTER_S` that it left (at
once when its connection drops). `JoinAgentLink` is one agent: the orders sent to it, the answers
awaited, and its news routed to the group each concerns (`remote_site.RemoteSite`, one per group
and round on that agent). Rank groups learn of a change of members through `changed`.
"""

from __future__ import annotations

import itertools
import logging
import socket
import time
from collections.abc import Callable
from typing import Any

import anyio
from anyio.abc import TaskGroup

from elastic_nb import protocol
from elastic_nb.common import machine
from elastic_nb.supervisor.nodes.agent_link import JoinAgentLink
from elastic_nb.supervisor.nodes.channel import Keys, Listener

__all__ = ["Cluster"]

log = logging.getLogger(__name__)


class Cluster:
    """This supervisor's join agents, and how they reach it."""

    def __init__(self, tg: TaskGroup) -> None:
        self._tg = tg
        # This machine, as the agents reach it: the address `serve` was given, else its primary.
        self.addr = machine.primary_address()
        self.info = machine.describe(self.addr, "")
        self.listener: Listener | None = None
        self.agents: dict[bytes, JoinAgentLink] = {}
        self._numbers = itertools.count(1)
        self.refused: list[dict[str, Any]] = []  # version mismatches, newest last
        self.changed = anyio.Event()  # set (and replaced) at every change of members

    # ---- serving agents --------------------------------------------------------------------

    async def serve(self, host: str | None, port: int) -> None:
        """Listen for agents on host:port (0: a free port) until the supervisor ends. No host:
        this machine's primary address (its default route's), the one the join command names,
        not every interface: a container bridge, a VPN or a second network the machine is on
        does not open the port to its hosts unasked (`--host 0.0.0.0` does)."""
        host = host or self.addr
        if host != "0.0.0.0":
            # A name is taken as the address it resolves to: the ranks' interface is the one
            # that holds it, and an address of no interface here is refused before anyone joins.
            found = await anyio.getaddrinfo(host, port, family=socket.AF_INET)
            addr = str(found[0][4][0])
            machine.interface_holding(addr)
            self.listener = Listener(Keys.new(), addr, port)
            self.addr = addr
            self.info = machine.describe(self.addr, "")
        else:
            self.listener = Listener(Keys.new(), host, port)
        self._tg.start_soon(self._run)

    async def _run(self) -> None:
        assert self.listener is not None
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(self.listener.serve_admission)
                tg.start_soon(self._receive)
                tg.start_soon(self._beat)
                tg.start_soon(self._watch_dropped)
        finally:
            self.listener.close()

    def spawn(self, fn: Callable[..., Any], *args: Any) -> None:
        """A task for an agent (a relayed connection, an order sent), in the supervisor's task
        group: a bug of ours there ends that task, logged, never the supervisor (whose jobs'
        teardowns need the cluster's tasks to hear their agents)."""

        async def guarded() -> None:
            try:
                await fn(*args)
            except Exception:
                log.exception("a task for an agent failed: %s", getattr(fn, "__qualname__", fn))

        self._tg.start_soon(guarded)

    async def listener_send(
        self, peer: bytes, msg: protocol.Message, blob: bytes | None = None
    ) -> bool:
        return self.listener is not None and await self.listener.send(peer, msg, blob)

    def join_command(self) -> str:
        assert self.listener is not None
        host = self.addr if self.listener.host == "0.0.0.0" else self.listener.host
        return f"elastic-nb join {host}:{self.listener.port} --token {self.listener.keys.token()}"

    async def new_token(self) -> int:
        """A new token: every agent holding the old one is dropped; how many were."""
        assert self.listener is not None
        self.listener.rotate()
        dropped = [a for a in self.agents.values() if a.ready]
        for a in dropped:
            await a.send(
                protocol.agents.NodeBye(
                    kind=protocol.agents.BYE, reason="the join token was replaced"
                )
            )
            a.gone("left", "dropped: the join token was replaced")
        self._notify()
        return len(dropped)

    def ready(self) -> list[JoinAgentLink]:
        """The agents that can take ranks now, in join order."""
        return sorted((a for a in self.agents.values() if a.ready), key=lambda a: a.number)

    def describe(self) -> protocol.kernel.MachineList:
        """What %elastic nodes lists."""
        listening = None
        if self.listener is not None:
            listening = protocol.kernel.Listening(
                host=self.listener.host,
                port=self.listener.port,
                token=self.listener.keys.fingerprint(),
            )
        return protocol.kernel.MachineList(
            listening=listening,
            here=protocol.kernel.Machine(**self.info, node=0, state="here"),
            agents=[a.describe() for a in sorted(self.agents.values(), key=lambda a: a.number)],
            refused=self.refused[-20:] + [{"why": r} for r in self._refusals()],
        )

    def _refusals(self) -> list[str]:
        return list(self.listener.refusals[-20:]) if self.listener else []

    def _notify(self) -> None:
        self.changed.set()
        self.changed = anyio.Event()

    async def _receive(self) -> None:
        assert self.listener is not None
        while True:
            try:
                peer, frame, blob, address = await self.listener.receive()
            except protocol.wire.ProtocolError as e:
                log.warning("dropped a message from an agent: %s", e)
                continue
            agent = self.agents.get(peer)
            try:
                msg = protocol.agents.node_news(frame)
                if agent is None or not agent.ready:
                    if msg["kind"] == protocol.agents.NODE_HELLO and agent is None:
                        await self._hello(peer, msg, blob, address)
                    else:
                        log.warning("dropped a %s from %s: it has not joined", msg["kind"], address)
                    continue
                agent.heard(msg["t"] if msg["kind"] == protocol.agents.BEAT else None)
                if msg["kind"] == protocol.agents.BYE:
                    agent.gone("left", f"its agent left: {msg['reason']}")
                    self._notify()
                    continue
                agent.dispatch(msg, blob)
            except (protocol.wire.ProtocolError, ValueError) as e:
                log.warning("dropped a message from %s: %s", address or "an agent", e)
            except Exception:  # a bug of ours loses this message, never every agent's
                log.exception("a message from %s failed", address or "an agent")

    async def _hello(
        self, peer: bytes, msg: protocol.agents.NodeHello, blob: bytes | None, address: str
    ) -> None:
        info = msg["info"]
        why = None
        if msg["version"] != protocol.wire.VERSION:
            why = (
                f"its elastic_nb speaks protocol {msg['version']}, the notebook's "
                f"{protocol.wire.VERSION}: install the notebook's elastic_nb "
                f"({self.info['elastic_nb']}) there"
            )
        else:
            why = machine.mismatch(self.info, info)
        if why is not None:
            log.warning("refused %s (%s): %s", info.get("name"), address, why)
            self.refused.append({"name": info.get("name"), "addr": address, "why": why})
            await self.listener_send(
                peer, protocol.agents.JoinRefused(kind=protocol.agents.REFUSED, error=why)
            )
            return
        endpoint = (blob or b"").decode(errors="replace")
        agent = JoinAgentLink(
            self.listener_send, self.spawn, peer, next(self._numbers), info, endpoint
        )
        self.agents[peer] = agent
        welcome = protocol.agents.Welcome(
            kind=protocol.agents.WELCOME,
            version=protocol.wire.VERSION,
            node=agent.number,
            info=self.info,
        )
        await agent.send(welcome)
        log.info("node %d joined: %s at %s", agent.number, info["name"], address)
        self._notify()

    async def _beat(self) -> None:
        """Our heartbeat to every agent, and theirs checked: one silent for LOST_AFTER_S is
        gone (its machine, or the network to it)."""
        while True:
            for agent in list(self.agents.values()):
                if not agent.ready:
                    continue
                silent = time.monotonic() - agent.last_heard
                if silent > protocol.agents.LOST_AFTER_S:
                    agent.gone("lost", f"connection lost (silent for {silent:.1f} s)")
                    self._notify()
                    continue
                await agent.send(
                    protocol.agents.Beat(kind=protocol.agents.BEAT, t=time.time(), groups={})
                )
            await anyio.sleep(protocol.agents.BEAT_S)

    async def _watch_dropped(self) -> None:
        """A dropped connection is a lost agent at once (its process died, its machine reset)."""
        assert self.listener is not None
        async for endpoint in self.listener.dropped:
            for agent in self.agents.values():
                if agent.ready and agent.endpoint == endpoint:
                    agent.gone("lost", "its connection dropped (the agent or its machine died)")
                    self._notify()

    async def close(self) -> None:
        """The supervisor is ending: every agent is told (it ends its ranks at once)."""
        for agent in self.ready():
            with anyio.move_on_after(1):
                await agent.send(
                    protocol.agents.NodeBye(kind=protocol.agents.BYE, reason="the notebook ended")
                )
            agent.gone("left", "the notebook's supervisor ended")
