"""One cell run on a session's ranks: a job of its own for the kernel (its updates, its end, a
run directory with its source, its records and its summary), whose ranks are the session's.

The cell is sent to every rank over the session's private channel; each rank answers ``ran``
once its records are in the cell's run directory. What decides the cell, first come first
served:

* every rank finished it                                        -> succeeded
* every rank answered and one raised                            -> failed, the session stays
* a rank raised while others still run it                       -> the others are interrupted
                                                                   (KeyboardInterrupt); failed
* a rank of the session died                                    -> failed; the session restarts
* `stop` from the kernel (interrupt, %elastic stop), --timeout  -> the ranks are interrupted;
                                                                   interrupted / timeout

A rank that does not come back from an interrupt within the grace (stuck inside a collective,
where no Python runs) is killed: torchelastic then restarts the group and the session replays.
"""

from __future__ import annotations

import contextlib
import time
from typing import Any

import anyio

from elastic_nb.rundir import RunDir, read_json, write_atomic, write_json
from elastic_nb.spec import JobSpec
from elastic_nb.supervisor import summary
from elastic_nb.supervisor.diagnosis import oom_alert
from elastic_nb.supervisor.reporter import Reporter, Send
from elastic_nb.supervisor.verdict import RankState, Verdict, analyze

__all__ = ["SessionCell"]

# After the first failure, how long the other ranks' own answers may take before they are
# interrupted: a cell that raises on every rank (a typo) fails on each of them within
# milliseconds, and each should be reported with its own error, not as interrupted.
SETTLE_S = 0.1


class SessionCell:
    def __init__(
        self,
        cell_id: str,
        spec: JobSpec,
        source: str,
        meta: dict[str, Any],
        payload: bytes | None,
        send: Send,
        session_id: str,
    ) -> None:
        self.id = cell_id
        self.spec = spec
        self.rd = RunDir.of(spec.log_dir, cell_id)
        self.session_id = session_id
        self.created = time.time()
        self.source, self._meta, self._payload = source, meta, payload
        self.report = Reporter(cell_id, send)
        self.summary: dict[str, Any] | None = None
        self.no: int | None = None  # its number in the session, once it runs
        self.stop_reason: str | None = None  # a stop request's key (summary.STOPS), or timeout
        self.changed = anyio.Event()  # an answer, a death or a stop: look again
        self.answers: dict[int, bool] = {}  # rank -> finished (True) or raised (False)
        self.attempt = 0

    @property
    def running(self) -> bool:
        return self.summary is None

    @property
    def first_line(self) -> str:
        lines = [x for x in self.source.splitlines() if x.strip() and not x.startswith("#")]
        return lines[0].strip()[:60] if lines else ""

    def prepare(self) -> None:
        """Its run directory, as a one-off job's (the kernel reads the result from it)."""
        self.rd.path.mkdir(parents=True, exist_ok=False, mode=0o700)
        self.report.open(self.rd.events)
        self.rd.spec.write_text(self.spec.to_json())
        self.rd.cell.write_text(self.source)
        write_json(self.rd.cell_meta, self._meta)
        if self._payload:
            write_atomic(self.rd.payload, self._payload)
            self._payload = None
        self.report.event("created", session=self.session_id)

    def poke(self) -> None:
        self.changed.set()
        self.changed = anyio.Event()

    def request_stop(self, reason: str) -> None:
        if self.stop_reason is None:
            self.stop_reason = reason
            self.report.event("stop", reason=reason)
            self.poke()

    def answer(self, rank: int, ok: bool) -> None:
        self.answers[rank] = ok
        self.poke()

    # ---- the verdict -------------------------------------------------------------------------

    def ranks(self, session_ranks: list[RankState]) -> list[RankState]:
        """The cell's view of each rank: its records in the cell's run directory, its death
        (if it died) from the session's book."""
        out = []
        for s in session_ranks:
            r = RankState(self.attempt, s.rank, pid=s.pid, started_at=s.started_at)
            r.done = read_json(self.rd.done(self.attempt, s.rank))
            if r.done is None:
                r.failure = read_json(self.rd.failure(self.attempt, s.rank))
            if s.died_at is not None and r.done is None and r.failure is None:
                r.died_at, r.exit_code, r.oom_killed = s.died_at, s.exit_code, s.oom_killed
            out.append(r)
        return out

    def chips(self, ranks: list[RankState], teardown_at: float | None) -> None:
        for r in ranks:
            if r.done is not None:
                label, state = "finished", "done"
            elif r.failure is None and r.died_at is None:
                label, state = "running", "running"
            else:
                kind = r.kind(teardown_at)
                state = "stopped" if kind in ("terminated", "peer") else "failed"
                label = r.label(teardown_at)
            chip: dict[str, Any] = {"state": state, "label": label, "attempt": r.attempt}
            chip["pid"] = r.pid
            if state in ("failed", "stopped"):
                chip["detail"] = r.failure_summary()
            self.report.chip(r.rank, chip)  # type: ignore[arg-type]

    def oom_alerts(self, ranks: list[RankState]) -> None:
        for r in ranks:
            if r.failure is not None and r.kind(None) == "oom":
                title, text = oom_alert(r)
                self.report.alert("oom", "error", title, rank=r.rank, text=text)

    def conclude(
        self,
        outcome: str,
        reason: str,
        ranks: list[RankState],
        teardown_at: float | None,
        lines: int,
    ) -> dict[str, Any]:
        """The cell's summary, written and returned (the closing alerts are queued)."""
        verdict = analyze(ranks, teardown_at, None, self.spec.nproc) if ranks else None
        result = summary.summarize(
            job_id=self.id,
            spec=self.spec,
            rd=self.rd,
            outcome=outcome,
            reason=reason,
            verdict=verdict or Verdict(None, None, []),
            attempt=self.attempt,
            created=self.created,
            zombie=False,
            diagnosis=None,
            leftovers=[],
            lines=lines,
        )
        result["session"] = self.session_id
        self.chips(ranks, teardown_at)
        for alert in summary.closing_alerts(result, ranks, []):
            self.report.alert(**alert)
        self.report.set_state(outcome)
        with contextlib.suppress(OSError):
            write_json(self.rd.summary, result)
        self.report.event("end", outcome=outcome)
        return dict(result)
