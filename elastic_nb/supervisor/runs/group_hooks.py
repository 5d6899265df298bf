"""What a kind of rank group does at each step of the group's life: the hooks that
rank_group.RankGroup's mechanics call and a job (`job.Job`) or a session
(`sessions.session.Session`) overrides. Each does nothing, or the plain thing, until a kind says
otherwise; the two a kind must say raise NotImplementedError."""

from __future__ import annotations

from typing import Any

from anyio.abc import TaskGroup

from elastic_nb import protocol
from elastic_nb.common.rank_state import RankState
from elastic_nb.supervisor.processes.site import Site
from elastic_nb.supervisor.runs import cell_rules, decider
from elastic_nb.supervisor.runs.reporter import Reporter

__all__ = ["GroupHooks"]


class GroupHooks:
    async def _open(self) -> None:
        """Before the launcher starts."""

    def _launch_env(self) -> dict[str, str]:
        """The ranks' environment."""
        raise NotImplementedError

    def _start_tasks(self, tg: TaskGroup) -> None:
        """Tasks of the kind's own, beside the launcher's reader and the poll loop."""

    def _on_ready(self) -> None:
        """The launcher has torch imported and the job in hand: the rendezvous comes next."""

    def _new_attempt(self, attempt: int) -> None:
        """torchelastic restarted the group: `attempt` starts (self.attempt is the last)."""

    def _on_rank_started(self, r: RankState) -> None: ...

    def _rank_ended(self, r: RankState) -> None:
        """A rank has gone (or its exit status came after it was seen gone)."""

    def _on_watchdog_line(self, attempt: int, rank: int, line: str) -> None:
        """NCCL's watchdog says a collective of this rank timed out."""

    def _poll(self) -> None:
        """Each poll (every rank_group.POLL_S)."""

    def _asker(self) -> Reporter | None:
        """Whose kernel a rank's input() asks: the follower of the cell the ranks run (None:
        nobody follows it)."""
        raise NotImplementedError

    async def _relayed_rank(self, stream: Any, peer: int | None, site: Site) -> None:
        """A session's rank on another machine connects (relayed by its agent)."""
        await stream.aclose()

    def _on_restart(self, action: decider.Restart) -> None:
        """An attempt failed within the budget (decider.Restart): before the placement restarts
        its ranks."""

    def _diagnose(self, what: str, r: RankState) -> None:
        """Take the evidence the decision core asks for (decider.Diagnose), then tell it
        (decider.Diagnosed). Only a kind whose ranks' ends the core judges is asked."""
        raise NotImplementedError

    def _cell_act(self, action: cell_rules.CellAction) -> None:
        """What the decision core decides for a session's running cell (cell_rules): only a
        session runs cells."""
        raise NotImplementedError

    async def _launcher_ended(self, outcome: tuple[str, str]) -> tuple[str, str]:
        """The launcher exited, and said (or not) how: the outcome that gives the group."""
        return outcome

    def _on_decided(self, outcome: str) -> None: ...

    async def _before_teardown(self, outcome: str) -> None: ...

    def _close(self) -> None:
        """After the teardown, before the summary."""

    async def _summarize(self, outcome: str, reason: str) -> protocol.records.Summary:
        raise NotImplementedError

    def _summary_record(self, summary: protocol.records.Summary) -> dict[str, Any]:
        """What summary.json keeps."""
        return dict(summary)
