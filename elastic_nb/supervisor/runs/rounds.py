"""A multi-node group's rounds: which machines each attempt runs on, and the timeline of them.

torch's c10d rendezvous and elastic agent run every round (one `elastic_launch` per node, all of
them meeting in the group's rendezvous store on the notebook's machine); the supervisor decides
when a round ends and who is in the next (`rank_group.RankGroup`), because it knows what torch
does not:

* a node that leaves is known within seconds (its agent's connection or heartbeat), where torch
  drops it from the rendezvous only after its keep-alives expire and restarts no one
  (pytorch#111646): the survivors would wait in their collective until it times out;
* a node that joins is taken at once: the next round closes the moment its nodes are all there,
  not `last_call_timeout` (30 s) later;
* the restart budget is the job's: failures and departures spend it, arrivals do not, and every
  node agrees on it (torch counts per agent: pytorch#108158).

So each round runs with exactly its nodes (min = max) and no restarts of torch's own; a failure,
a departure or an arrival ends the round, and the next one begins with the nodes there are, at
the next attempt number. `Rounds` gathers a round's sites and keeps the timeline (each round:
its nodes, world size, why, what the change cost) that the dashboard draws.
"""

from __future__ import annotations

import secrets
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import anyio

from elastic_nb import protocol
from elastic_nb.common.report import duration
from elastic_nb.common.spec import JobSpec
from elastic_nb.supervisor.nodes.agent_link import JoinAgentLink
from elastic_nb.supervisor.nodes.cluster import Cluster
from elastic_nb.supervisor.processes.site import Site

__all__ = ["DEFAULT_JOIN_TIMEOUT_S", "Machines", "Rounds"]

# How long a job waits for its MIN nodes (torch waits 600 s: a notebook should say sooner that
# the nodes are not there). --rdzv-conf join_timeout=S changes it.
DEFAULT_JOIN_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class Machines:
    """Where a multi-node group's sites come from: the cluster's agents, this machine (a
    `LocalSite` a round), and the group's rendezvous store on this machine."""

    cluster: Cluster
    local: Callable[[], Site]
    store: Callable[[], Awaitable[tuple[Any, int]]]  # (its handle, its port)
    end_store: Callable[[Any], None]


class Rounds:
    def __init__(self, spec: JobSpec, machines: Machines) -> None:
        self.spec = spec
        self.machines = machines
        self.cluster = machines.cluster
        self.timeline: list[protocol.records.Round] = []
        self.next_attempt = 0
        self.store_port = 0
        self._store: Any = None
        # The group's launchers sign the rendezvous state with it (launcher/rendezvous.py): a
        # local user who reaches the store cannot make them unpickle theirs.
        self.key = secrets.token_hex(32)
        conf = spec.rdzv_conf
        self.join_timeout = float(conf.get("join_timeout", DEFAULT_JOIN_TIMEOUT_S))
        self.last_call = float(conf.get("last_call_timeout", 0))

    async def open_store(self) -> None:
        self._store, self.store_port = await self.machines.store()

    def close(self) -> None:
        if self._store is not None:
            self.machines.end_store(self._store)
            self._store = None

    def world_size(self, attempt: int) -> int:
        entry = self.entry(attempt)
        return entry["world_size"] if entry else self.spec.nproc

    def entry(self, attempt: int) -> protocol.records.Round | None:
        return next((r for r in self.timeline if r["attempt"] == attempt), None)

    def plan(self, attempt: int, nnodes: int, group_id: str) -> protocol.launcher.LaunchRound:
        """The round as this machine's launcher runs it (another machine's agent fills in its
        own endpoint, address and interface)."""
        from elastic_nb.common import machine

        addr = self.cluster.addr
        return protocol.launcher.LaunchRound(
            attempt=attempt,
            nnodes=nnodes,
            run_id=f"{self.spec.rdzv_id or group_id}-{attempt}",
            endpoint=f"127.0.0.1:{self.store_port}",
            addr=addr,
            ifname=machine.interface_holding(addr),
            key=self.key,
        )

    async def gather(
        self,
        since: float,
        waiting: Callable[[str], None],
        remote: Callable[[JoinAgentLink], Site],
    ) -> list[Site] | str:
        """The round's sites: this machine's (unless --remote-only) and those of the agents
        ready now, up to MAX; waiting for MIN of them (`waiting` says so, at most the join
        timeout), and for `last_call` more on the first round. Why not, if they did not come."""
        spec, cluster = self.spec, self.cluster
        deadline = since + self.join_timeout
        here = 0 if spec.remote_only else 1
        while True:
            count = here + len(cluster.ready())
            if count >= spec.nnodes_min:
                break
            left = deadline - time.time()
            if left <= 0:
                return (
                    f"only {count} of the {spec.nnodes_min} nodes it needs were there within "
                    f"{duration(self.join_timeout)} (--rdzv-conf join_timeout=S waits longer; "
                    "%elastic join-command prints the line that adds a node)"
                )
            waiting(
                f"waiting for nodes: {count} of {spec.nnodes_min} joined, until "
                f"{time.strftime('%H:%M:%S', time.localtime(deadline))}"
            )
            with anyio.move_on_after(left):
                await cluster.changed.wait()
        if not self.timeline and count < spec.nnodes_max and self.last_call > 0:
            with anyio.move_on_after(self.last_call):
                while here + len(cluster.ready()) < spec.nnodes_max:
                    await cluster.changed.wait()
        agents = await self._alive_since(since) if self.timeline else cluster.ready()
        sites: list[Site] = [self.machines.local()] if here else []
        sites.extend(remote(a) for a in agents[: spec.nnodes_max - here])
        if len(sites) < spec.nnodes_min:
            return f"only {len(sites)} of the {spec.nnodes_min} nodes it needs are left"
        return sites

    async def _alive_since(self, since: float) -> list[JoinAgentLink]:
        """The ready agents heard from since the change began (a heartbeat every BEAT_S): one
        whose machine died with the round it ends is not heard again, so the next round does
        not count on it only to fail (and spend a restart) once its loss is known."""
        deadline = time.monotonic() + protocol.agents.LOST_AFTER_S
        while time.monotonic() < deadline:
            agents = self.cluster.ready()
            if all(a.last_heard_wall > since for a in agents):
                break
            await anyio.sleep(protocol.agents.BEAT_S / 4)
        return [a for a in self.cluster.ready() if a.last_heard_wall > since]

    def record(
        self,
        sites: list[Site],
        why: str,
        counted: bool,
        restarts: int,
        started: float,
        stop_s: float | None,
    ) -> protocol.records.Round:
        """A new round in the timeline, at the next attempt number."""
        entry = protocol.records.Round(
            attempt=self.next_attempt,
            nodes=[s.label for s in sites],
            world_size=self.spec.nproc * len(sites),
            why=why,
            counted=counted,
            restarts=restarts,
            started=started,
            stop_s=stop_s,
            rendezvous_s=None,
            running_s=None,
        )
        self.next_attempt += 1
        self.timeline.append(entry)
        return entry

    def running(self, attempt: int, started: int) -> bool:
        """`started` ranks of `attempt` run: True the moment that is all of them (the round's
        cost is then known)."""
        entry = self.entry(attempt)
        if entry is None or entry["running_s"] is not None or started < entry["world_size"]:
            return False
        entry["running_s"] = time.time() - entry["started"]
        return True

    def rendezvous(self, attempt: int, seconds: float) -> None:
        entry = self.entry(attempt)
        if entry is not None:
            entry["rendezvous_s"] = max(entry["rendezvous_s"] or 0.0, seconds)

    def newcomers(self, serving: list[Site]) -> list[JoinAgentLink]:
        """Agents ready now that the round does not run on."""
        numbers = {s.number for s in serving}
        return [a for a in self.cluster.ready() if a.number not in numbers]
