"""What a job's dashboard shows, folded from the supervisor's updates: plain data, no widgets.

The supervisor sends at most ten updates a second per job, each carrying every rank's changes
(and at most a few hundred lines per stream). `DashboardState.apply` folds one into the state
and into a pending *delta*; `take_delta` hands that delta out once, numbered, for the widget to
send as one message. `snapshot` is the whole state, for a view that starts late (a reload) and
for the notebook file. Memory is bounded whatever the log volume: a tail of `TAIL_LINES` per
rank and `ALL_LINES` across ranks, and of those no more than `TAIL_CHARS` and `ALL_CHARS`
characters (the tailer cuts each line at a few thousand), the newest `MAX_ALERTS` alerts, and
each rank's last `MEMORY_SAMPLES` memory samples (one a second: its sparkline).

The browser side (``dashboard.js``) applies the same deltas to the same structure with the same
bounds, so a view never needs more than the snapshot and what follows it.
"""

from __future__ import annotations

import collections
import time
from typing import Any

from elastic_nb.common import report
from elastic_nb.common.rundir import RunDir
from elastic_nb.common.spec import JobSpec
from elastic_nb.protocol.records import Summary

__all__ = [
    "ALL_CHARS",
    "ALL_LINES",
    "MAX_ALERTS",
    "MEMORY_SAMPLES",
    "TAIL_CHARS",
    "TAIL_LINES",
    "DashboardState",
]

TAIL_LINES = 1000  # per rank, in its tab
ALL_LINES = 2000  # the "all ranks" tab
TAIL_CHARS = 250_000  # characters of a rank's tab: the newest lines that fit
ALL_CHARS = 500_000  # characters of the "all ranks" tab
MAX_ALERTS = 100
MAX_ALERT_TEXT = 200_000  # characters of an alert's detail (stacks of many ranks fit)
MEMORY_SAMPLES = 300  # per rank: its last five minutes

Delta = dict[str, Any]


class DashboardState:
    def __init__(
        self, job_id: str, run_dir: str, spec: JobSpec, session: str | None = None
    ) -> None:
        """`run_dir`: where the ranks' logs are (a session's cell: the session's)."""
        nproc = spec.nproc * spec.nnodes_min  # a multi-node job's first round may be larger
        self._rd = RunDir(run_dir)
        self.seq = 0
        self.header: dict[str, Any] = {
            "job": job_id,
            "session": session,
            "run_dir": run_dir,
            "world_size": nproc,
            "nodes": [spec.nnodes_min, spec.nnodes_max],
            "restarts": 0,
            "max_restarts": spec.max_restarts,
            "worst_case_s": spec.worst_case_s,
            "collectives": False,  # a rank made a process group: worst_case_s applies
            "background": spec.background,
            "state": "starting",
            "attempt": 0,
            "started": time.time(),
            "wall_s": None,
            # the latest saved (elastic_nb.checkpoint's record), and its `how` (the tooltip)
            "checkpoint": None,
        }
        self.ranks: dict[str, dict[str, Any]] = {
            str(r): self._waiting_chip(r, 0) for r in range(nproc)
        }
        self.alerts: collections.deque[dict[str, Any]] = collections.deque(maxlen=MAX_ALERTS)
        self._alerts_seen = 0  # numbers the alerts (`n`): the oldest fall off past MAX_ALERTS
        self.attempts: list[dict[str, Any]] = [_attempt(0, 0.0)]
        self.tails: dict[str, collections.deque[list[str]]] = {
            str(r): collections.deque() for r in range(nproc)
        }
        self.all: collections.deque[list[Any]] = collections.deque()
        self._chars: dict[str | None, int] = {}  # characters held: per rank's tail, None: all
        self.progress: dict[str, list[str]] = {}
        # rank -> its samples as [t, host bytes, GPU bytes or None] (the sparkline) and its last
        # sample whole (the chip's figures)
        self.memory: dict[str, dict[str, Any]] = {}
        self.summary: dict[str, Any] | None = None
        self._multi_node = False  # rounds seen: they keep the header's world size and restarts
        self._delta: Delta = {}

    # ---- folding ----------------------------------------------------------------------------

    def apply(self, msg: dict[str, Any]) -> None:
        """Fold one supervisor update (protocol.kernel.UPDATE) in."""
        if msg.get("rounds"):
            self._rounds(msg["rounds"])
        attempt = msg.get("attempt")
        if attempt is not None and attempt > self.header["attempt"]:
            self._new_attempt(int(attempt))
        if "state" in msg:
            self._header(state=msg["state"])
        if msg.get("groups") and not self.header["collectives"]:
            self._header(collectives=True)
        if msg.get("checkpoints"):
            saved = msg["checkpoints"][-1]
            self._header(checkpoint={**saved, "how": report.checkpoint_how(saved)})
        for rank, chip in msg.get("ranks", {}).items():
            self._chip(rank, chip)
        for alert in msg.get("alerts", ()):
            self._alert(alert)
        for batch in msg.get("logs", ()):
            attempt_, rank, stream = batch["attempt"], batch["rank"], batch["stream"]
            lines, skipped, progress = batch["lines"], batch["skipped"], batch["progress"]
            if attempt_ != self.header["attempt"]:
                continue  # the last lines of an attempt that has been replaced
            self._lines(str(rank), stream, lines, skipped, self._rd.log(attempt_, rank, stream))
            if progress is not None:
                self._progress(str(rank), [stream, progress])
            elif lines and self.progress.get(str(rank), [stream])[0] == stream:
                self._progress(str(rank), None)  # the bar's line finished
        for sample in msg.get("memory", ()):
            if sample["attempt"] == self.header["attempt"]:
                self._memory(str(sample["rank"]), sample)

    def end(self, summary: Summary) -> None:
        """The job's end: the final state, its outcome in the last attempt, and what the
        dashboard leaves to the text under it.

        Each thing is said once under the cell: the summary line is printed under the
        dashboard (the header has its facts), the headline is the failure alert's title, and
        the error a blocking cell raises carries the failure report: the alerts whose detail
        it holds (`in_error`) close it, and the logs close (`raised`), so that the verdict is
        on the cell's first screen, not below a second copy of the rank's traceback.
        """
        outcome = summary["outcome"]
        self._header(state=outcome, wall_s=summary.get("wall_s"), restarts=summary["restarts"])
        attempt = summary["attempt"]
        if attempt < self.header["attempt"] and attempt < len(self.attempts):
            # A session cell whose failure restarted its session (the restart and the replay
            # showed under it): it ends showing its own attempt, how each of its ranks ended.
            self._header(attempt=attempt)
            for rank, ended in self.attempts[attempt]["ranks"].items():
                self._chip(rank, {**ended, "attempt": attempt})
        last = self.attempts[min(attempt, len(self.attempts) - 1)]
        last["outcome"] = outcome
        last["why"] = summary.get("reason")
        if summary.get("wall_s") is not None:
            last["ended_s"] = summary["wall_s"]
        self._delta["attempts"] = self.attempts
        for rank in list(self.progress):
            self._progress(rank, None)
        headline = report.failure_headline(summary) if outcome in ("failed", "timeout") else None
        if headline is not None and self._said(headline):
            headline = None
        in_error: list[int] = []
        if not self.header["background"] and outcome in ("failed", "timeout", "stopped"):
            # What JobFailed, JobTimeout and JobStopped show under their first line.
            error = "\n".join(report.failure_report(summary))
            in_error = [a["n"] for a in self.alerts if a.get("text") and a["text"] in error]
        self.summary = {
            "outcome": outcome,
            "cause": summary.get("cause"),
            "headline": headline,
            "in_error": in_error,
            "raised": bool(in_error),
        }
        self._delta["summary"] = self.summary

    def _rounds(self, rounds: list[dict[str, Any]]) -> None:
        """A multi-node job's timeline: each attempt's round (its nodes, world size, why, what
        the change took), the current world size and the restarts spent."""
        for entry in rounds:
            attempt = entry["attempt"]
            while len(self.attempts) <= attempt:
                self._begin_attempt(entry["started"] - self.header["started"])
            self.attempts[attempt]["round"] = entry
            if attempt:  # why a round began is why the one before it ended
                self.attempts[attempt - 1]["why"] = entry["why"]
        last = rounds[-1]
        self._multi_node = True
        self._header(world_size=last["world_size"], restarts=last["restarts"])
        self._delta["attempts"] = self.attempts

    def _header(self, **fields: Any) -> None:
        self.header.update(fields)
        self._delta.setdefault("header", {}).update(fields)

    def _chip(self, rank: str, chip: dict[str, Any]) -> None:
        attempt = int(chip.get("attempt", self.header["attempt"]))
        if attempt < len(self.attempts):
            self.attempts[attempt]["ranks"][rank] = {
                "state": chip["state"],
                "label": chip.get("label", chip["state"]),
            }
            self._delta["attempts"] = self.attempts
        if attempt != self.header["attempt"]:
            return  # a late word about a replaced attempt: the timeline has it
        chip = {**chip, "log": str(self._rd.log(attempt, int(rank), "out"))}
        self.ranks[rank] = chip
        self._delta.setdefault("ranks", {})[rank] = chip

    def _said(self, title: str) -> bool:
        """Whether an alert already said what `title` says: the same words, or the same finding
        under another lead ("desync: F" after "rank 0 timed out in all_reduce after 5 s: F")."""
        finding = title.split(": ", 1)[-1]
        return any(a["title"] == title or a["title"].endswith(f": {finding}") for a in self.alerts)

    def _alert(self, alert: dict[str, Any]) -> None:
        if alert.get("kind") == "failure" and self._said(alert["title"]):
            return  # the failure as an alert has already said (a desync's: its stacks, too)
        alert = {**alert, "n": self._alerts_seen}
        self._alerts_seen += 1
        text = alert.get("text")
        if text and len(text) > MAX_ALERT_TEXT:
            alert["text"] = text[:MAX_ALERT_TEXT] + "\n... (cut; the run directory has all)"
        key = alert.get("key")
        earlier = next((a for a in self.alerts if key and a.get("key") == key), None)
        if earlier is not None:
            # The same story, further on (a replay): in the earlier one's place.
            alert["replaces"] = earlier["n"]
            self.alerts[self.alerts.index(earlier)] = alert
        else:
            self.alerts.append(alert)
        self._delta.setdefault("alerts", []).append(alert)
        ends = alert.get("ends")
        if ends is not None and ends < len(self.attempts) and not self._multi_node:
            # Why the attempt ended: the restart's words (a multi-node job's rounds say why each
            # began, which is why the one before ended).
            self.attempts[ends]["why"] = alert["title"]
            self._delta["attempts"] = self.attempts

    def _new_attempt(self, attempt: int) -> None:
        self.memory = {}  # new processes: their memory starts afresh (dashboard.js alike)
        self._delta.pop("memory", None)
        while len(self.attempts) <= attempt:
            self._begin_attempt(time.time() - self.header["started"])
        self._delta["attempts"] = self.attempts
        self._header(attempt=attempt)
        if not self._multi_node:
            # On one machine every new attempt is a restart; a multi-node job's rounds say
            # which of theirs spent one (an arrival does not).
            self._header(restarts=attempt)
        world = self.header["world_size"]
        for rank in [r for r in self.ranks if int(r) >= world]:
            # A smaller world (a node left): its ranks' chips go (their tabs keep their lines).
            del self.ranks[rank]
            self._delta.setdefault("ranks", {})[rank] = None
        for rank in [str(r) for r in range(world)]:
            self._chip(rank, self._waiting_chip(int(rank), attempt))
            self._progress(rank, None)
            self._append(rank, "mark", [f"── attempt {attempt} ──"])
        self._append(None, "note", [f"── attempt {attempt} ──"])

    def _begin_attempt(self, started: float) -> None:
        """The next attempt, begun `started` seconds into the job: the one before it ended then
        (the timeline draws each attempt from its start to its end)."""
        if self.attempts:
            self.attempts[-1]["ended_s"] = started
        self.attempts.append(_attempt(len(self.attempts), started))

    def _waiting_chip(self, rank: int, attempt: int) -> dict[str, Any]:
        return {
            "state": "starting",
            "label": "starting",
            "attempt": attempt,
            "log": str(self._rd.log(attempt, rank, "out")),
        }

    def _lines(self, rank: str, stream: str, lines: list[str], skipped: int, path: Any) -> None:
        if skipped:
            self._append(rank, "note", [f"... {skipped:,} lines not shown (full log: {path})"])
        if lines:
            self._append(rank, stream, lines)

    def _append(self, rank: str | None, stream: str, texts: list[str]) -> None:
        """Lines for one rank's tab and the all-ranks tab (rank None: the all-ranks tab only; a
        "mark", the attempt's separator in a rank's tab: that tab only, the all-ranks tab has
        its own, once)."""
        texts = _newest(texts, ALL_LINES, ALL_CHARS)
        if rank is not None:
            tail = self.tails.setdefault(rank, collections.deque())
            tail.extend([stream, t] for t in texts)
            self._trim(rank, tail, TAIL_LINES, TAIL_CHARS, texts)
        if stream != "mark":
            self.all.extend([rank, stream, t] for t in texts)
            self._trim(None, self.all, ALL_LINES, ALL_CHARS, texts)
        self._delta.setdefault("lines", []).append([rank, stream, texts])

    def _trim(
        self, key: str | None, q: collections.deque[Any], lines: int, chars: int, added: list[str]
    ) -> None:
        """Drop the oldest lines over either bound (dashboard.js trims the same way)."""
        size = self._chars.get(key, 0) + sum(len(t) for t in added)
        while q and (len(q) > lines or size > chars):
            size -= len(q.popleft()[-1])
        self._chars[key] = size

    def _memory(self, rank: str, sample: dict[str, Any]) -> None:
        gpu, cuda = sample.get("gpu"), sample.get("cuda")
        device = gpu["process"] if gpu else cuda["reserved"] if cuda else None
        point = [sample["t"], sample["rss"], device]
        m = self.memory.setdefault(rank, {"series": collections.deque(maxlen=MEMORY_SAMPLES)})
        m["series"].append(point)
        m["last"] = sample
        d = self._delta.setdefault("memory", {}).setdefault(rank, {"samples": []})
        d["samples"].append(point)
        d["last"] = sample

    def _progress(self, rank: str, bar: list[str] | None) -> None:
        """A rank's unfinished ``\r`` line ([stream, text]), shown live under its lines."""
        if bar is None and rank not in self.progress:
            return
        if bar is None:
            del self.progress[rank]
        else:
            self.progress[rank] = bar
        self._delta.setdefault("progress", {})[rank] = bar

    # ---- what goes out ------------------------------------------------------------------------

    def take_delta(self) -> Delta | None:
        """Everything that changed since the last delta, once, numbered; None if nothing did."""
        if not self._delta:
            return None
        self.seq += 1
        delta, self._delta = {"seq": self.seq, "now": time.time(), **self._delta}, {}
        return delta

    def snapshot(self) -> dict[str, Any]:
        """The whole state, as of the last delta taken: take it only with nothing pending, or a
        view would apply the next delta on top of changes the snapshot already holds."""
        assert not self._delta, "take_delta() first"
        return {
            "seq": self.seq,
            "now": time.time(),
            "limits": {
                "tail": TAIL_LINES,
                "all": ALL_LINES,
                "tail_chars": TAIL_CHARS,
                "all_chars": ALL_CHARS,
                "alerts": MAX_ALERTS,
                "memory": MEMORY_SAMPLES,
            },
            "header": dict(self.header),
            "ranks": dict(self.ranks),
            "alerts": list(self.alerts),
            "attempts": self.attempts,
            "tails": {r: list(t) for r, t in self.tails.items()},
            "all": list(self.all),
            "progress": dict(self.progress),
            "memory": {
                r: {"series": list(m["series"]), "last": m["last"]} for r, m in self.memory.items()
            },
            "summary": self.summary,
        }


def _newest(texts: list[str], lines: int, chars: int) -> list[str]:
    """The newest of texts within both bounds."""
    texts = texts[-lines:]
    size, start = 0, len(texts)
    while start and size + len(texts[start - 1]) <= chars:
        start -= 1
        size += len(texts[start])
    return texts[start:]


def _attempt(attempt: int, started: float) -> dict[str, Any]:
    """One attempt of the timeline: when it began and ended (seconds into the job; ended None
    while it runs), how each rank ended, its outcome and why it ended (the restart's words, the
    next round's, or the job's end), and across machines its round."""
    return {
        "attempt": attempt,
        "started": started,
        "ended_s": None,
        "ranks": {},
        "outcome": None,
        "why": None,
    }
