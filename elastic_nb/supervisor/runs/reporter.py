"""What a job says: its state, each rank's chip, alerts and log lines to the kernel, every event
to the run directory's events.jsonl.

Changes gather between flushes and leave as one UPDATE message per flush (at most ten a second
per job, whatever the ranks print); events.jsonl is the job's diary, written as things happen.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any, TextIO

import anyio

from elastic_nb import protocol
from elastic_nb.supervisor.ranks.log_tailer import LogTailer

__all__ = ["Reporter", "Send"]

Send = Callable[[protocol.Message], Awaitable[object]]  # to the kernel that follows the job

# What the JupyterLab panel can read back (EVENTS): the latest messages a job's renderer was sent,
# and its latest alerts (OVERVIEW).
HISTORY = 1000
RECENT_ALERTS = 20


class Reporter:
    def __init__(self, job_id: str, send: Send) -> None:
        self.job_id = job_id
        self.state = "starting"
        self._send = send
        self._events: TextIO | None = None
        self._ranks: dict[int, protocol.records.Chip] = {}
        self._alerts: list[protocol.records.Alert] = []
        self._memory: list[protocol.records.MemorySample] = []
        self._checkpoints: list[dict[str, Any]] = []
        self._rounds: list[protocol.records.Round] | None = None
        self._process_group = False  # a rank made a process group: for the next update
        self._state_dirty = True
        self.seq = 0  # of the latest message in `history`
        self.history: deque[dict[str, Any]] = deque(maxlen=HISTORY)
        self.recent_alerts: deque[protocol.records.Alert] = deque(maxlen=RECENT_ALERTS)

    def open(self, events: Path) -> None:
        self._events = open(events, "a", buffering=1)  # noqa: SIM115 (closed by close())

    def close(self) -> None:
        if self._events is not None:
            self._events.close()
            self._events = None

    def event(self, event: str, **fields: Any) -> None:
        if self._events is not None:
            self._events.write(
                json.dumps({"t": time.time(), "event": event, **fields}, default=str) + "\n"
            )

    def set_state(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self._state_dirty = True
            self.event("state", state=state)

    def chip(self, rank: int, chip: protocol.records.Chip) -> None:
        """What the dashboard shows for a rank of the current attempt (the latest wins)."""
        self._ranks[rank] = chip

    def alert(
        self,
        kind: str,
        severity: str,
        title: str,
        rank: int | None = None,
        text: str | None = None,
        key: str | None = None,
        ends: int | None = None,
    ) -> None:
        """A typed event any renderer can show: what, how bad, which rank, optional detail;
        `key`: a story told as it goes, whose every alert replaces the last of that key; `ends`:
        a restart's, the attempt it ended."""
        alert = protocol.records.Alert(
            kind=kind, severity=severity, title=title, rank=rank, text=text, time=time.time()
        )
        if ends is not None:
            alert["ends"] = ends
        if key is not None:
            alert["key"] = key
            for i, earlier in enumerate(self.recent_alerts):
                if earlier.get("key") == key:
                    del self.recent_alerts[i]  # the panel lists the story once, as it stands
                    break
        self._alerts.append(alert)
        self.recent_alerts.append(alert)
        self.event("alert", **alert)

    def checkpoint(self, saved: dict[str, Any]) -> None:
        """A checkpoint saved (elastic_nb.checkpoint's record), for the next update."""
        self._checkpoints.append(saved)

    def memory(self, sample: protocol.records.MemorySample) -> None:
        """A rank's memory sample, for the next update."""
        self._memory.append(sample)

    def process_group_made(self) -> None:
        """A rank of the job has made a process group: its collectives can time out."""
        self._process_group = True

    def rounds(self, rounds: list[protocol.records.Round]) -> None:
        """A multi-node job's timeline changed: the whole of it, for the next update."""
        self._rounds = [protocol.records.Round(**r) for r in rounds]

    async def flush(self, attempt: int, tailer: LogTailer | None) -> None:
        """One UPDATE with what changed; the tailer's new lines too, if given one."""
        update = protocol.kernel.Update(kind=protocol.kernel.UPDATE, job=self.job_id)
        if self._state_dirty:
            update["state"], update["attempt"] = self.state, attempt
            self._state_dirty = False
        if self._ranks:
            update["ranks"] = {str(k): v for k, v in self._ranks.items()}
            self._ranks = {}
        if self._alerts:
            update["alerts"], self._alerts = self._alerts, []
        if self._memory:
            update["memory"], self._memory = self._memory, []
        if self._checkpoints:
            update["checkpoints"], self._checkpoints = self._checkpoints, []
        if self._rounds is not None:
            update["rounds"], self._rounds = self._rounds, None
        if self._process_group:
            update["groups"], self._process_group = True, False
        logs = [b.record() for b in tailer.take()] if tailer is not None else []
        if logs:
            update["logs"] = logs
        if len(update) > 2:
            # Taken from the pending lists above: a cancellation mid-send would lose it.
            self._remember(update)
            with anyio.CancelScope(shield=True):
                await self._send(update)

    async def prompt(
        self,
        attempt: int,
        rank: int,
        asked: protocol.rank_probes.InputAsked,
        waits: list[protocol.records.Waiting],
    ) -> bool:
        """A rank waits for a line of input: the kernel is asked (after the updates before it),
        told which ranks wait for it in a collective. False if the kernel is gone."""
        self.event("input.asked", attempt=attempt, rank=rank, ask=asked["ask"])
        prompt = protocol.kernel.Prompt(
            kind=protocol.kernel.PROMPT,
            job=self.job_id,
            attempt=attempt,
            rank=rank,
            ask=asked["ask"],
            prompt=asked["prompt"],
            waits=waits,
        )
        with anyio.CancelScope(shield=True):
            sent = await self._send(prompt)
        return sent is not False

    async def end(self, summary: protocol.records.Summary) -> None:
        end = protocol.kernel.End(kind=protocol.kernel.END, job=self.job_id, summary=summary)
        self._remember(end)
        await self._send(end)

    def events_since(self, seq: int) -> list[dict[str, Any]]:
        """The messages sent after `seq` that the history still holds (the panel's refresh)."""
        return [e for e in self.history if e["seq"] > seq]

    def _remember(self, msg: protocol.kernel.Update | protocol.kernel.End) -> None:
        """For the panel's EVENTS: the message as sent, with its sequence number and time (the
        job's id is the entry's own)."""
        self.seq += 1
        fields = {k: v for k, v in msg.items() if k != "job"}
        self.history.append({"seq": self.seq, "t": time.time(), **fields})
