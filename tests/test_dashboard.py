"""The dashboard's widget traffic, with a recording comm in place of a kernel's (ipywidgets'
own tests do the same): what goes to the browser, how many messages and how many bytes."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import comm
import pytest

from elastic_nb import protocol
from elastic_nb.kernel.dashboard import Dashboard, widget
from elastic_nb.kernel.flags import job_spec
from elastic_nb.supervisor.ranks.log_tailer import LogTailer

pytestmark = pytest.mark.unit

# docs/howto/dashboard.md's numbers: "the last 1,000 lines of each rank (2,000 across ranks)".
TAB_LINES = 1000
ALL_TAB_LINES = 2000


class RecordingComm:
    """Stands in for the kernel's comm: keeps every message the widget sends."""

    kernel = "recording"

    def __init__(self, **kwargs: Any) -> None:
        self.comm_id = kwargs.get("comm_id") or "recording"
        self.sent: list[dict[str, Any]] = [kwargs.get("data", {})]  # the comm_open
        self.handlers: list[Any] = []

    def send(self, data: Any = None, buffers: Any = None, **_: Any) -> None:
        assert not buffers
        self.sent.append(data)

    def on_msg(self, callback: Any) -> None:
        self.handlers.append(callback)

    def close(self, *args: Any, **kwargs: Any) -> None:
        pass

    def open(self, *args: Any, **kwargs: Any) -> None:
        pass

    # what the browser would do
    def click(self, kind: str) -> None:
        for h in self.handlers:
            h({"content": {"data": {"method": "custom", "content": {"kind": kind}}}, "buffers": []})

    @property
    def customs(self) -> list[dict[str, Any]]:
        return [m["content"] for m in self.sent if m.get("method") == "custom"]

    @property
    def snapshots(self) -> list[dict[str, Any]]:
        return [
            m["state"]["snapshot"]
            for m in self.sent
            if m.get("method") == "update" and "snapshot" in m.get("state", {})
        ]

    @property
    def bytes(self) -> int:
        return sum(len(json.dumps(m, separators=(",", ":"))) for m in self.sent)


class Clock:
    """The dashboard's time.monotonic, moved by the test as the supervisor's ticks would."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    c = Clock()
    monkeypatch.setattr(widget, "time", c)
    return c


@pytest.fixture
def comms(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[RecordingComm]]:
    made: list[RecordingComm] = []

    def create_comm(**kwargs: Any) -> RecordingComm:
        made.append(RecordingComm(**kwargs))
        return made[-1]

    monkeypatch.setattr(comm, "create_comm", create_comm)
    yield made


def _summary(outcome: str, run_dir: str, **extra: Any) -> dict[str, Any]:
    return {
        "job": "cafe0001",
        "outcome": outcome,
        "reason": "every rank finished the cell",
        "cause": None,
        "world_size": 4,
        "attempt": 0,
        "restarts": 0,
        "max_restarts": 0,
        "wall_s": 9.5,
        "run_dir": run_dir,
        "failure": None,
        "others": [],
        **extra,
    }


def batch(attempt: int, rank: int, stream: str, lines: list[str], progress: str | None) -> Any:
    return protocol.records.LogBatch(
        attempt=attempt, rank=rank, stream=stream, lines=lines, skipped=0, progress=progress
    )


def test_a_flood_costs_one_bounded_message_per_tick(
    comms: list[RecordingComm], clock: Clock, tmp_path: Path
) -> None:
    """4 ranks x 100,000 lines, fed through the supervisor's own tailer in 20 of its ticks
    (0.1 s apart): the dashboard sends one message per 0.2 s (docs/howto/dashboard.md: "at most one message
    per 0.2 s, however much the ranks print"), whatever the volume."""
    ranks, lines_per_rank, ticks = 4, 100_000, 20
    dash = Dashboard("cafe0001", str(tmp_path), job_spec({"nproc": ranks}))
    c = _dashboard_comm(comms)
    tailer = LogTailer()
    files = {}
    for r in range(ranks):
        path = tmp_path / "attempt-0" / f"rank-{r}.out"
        path.parent.mkdir(exist_ok=True)
        files[r] = path.open("w")
        tailer.follow(0, r, {"out": path})
    dash.update({"state": "running", "attempt": 0})
    per_tick = lines_per_rank // ticks
    for tick in range(ticks):
        for r, f in files.items():
            f.write("".join(f"{r} {i}\n" for i in range(tick * per_tick, (tick + 1) * per_tick)))
            f.flush()
        tailer.poll()
        dash.update({"logs": [b.record() for b in tailer.take()]})
        clock.now += 0.1
        dash.flush()
    dash.end(_summary("succeeded", str(tmp_path)))

    # One message per 0.2 s of the 2 s the flood lasted, one for the end; the open and a
    # snapshot every 2 s (and at the end) besides.
    sends = round(ticks * 0.1 / 0.2)  # docs/howto/dashboard.md's 0.2 s
    assert len(c.customs) == sends + 1
    assert [m["seq"] for m in c.customs] == list(range(1, sends + 2))
    assert len(c.sent) == 1 + len(c.customs) + len(c.snapshots) and len(c.snapshots) <= 2
    # Bytes: the tailer's bound per stream and tick, the tails, whatever the volume.
    assert c.bytes < 600_000, c.bytes
    assert max(len(json.dumps(m)) for m in c.customs) < 32_000
    # Every line is accounted for: shown, or counted in a "not shown" note with the log's path.
    for r in range(ranks):
        shown = skipped = 0
        for m in c.customs:
            for rank, stream, texts in m.get("lines", ()):
                if rank != str(r):
                    continue
                if stream == "out":
                    shown += len(texts)
                for t in texts if stream == "note" else ():
                    n = re.match(r"\.\.\. ([\d,]+) lines not shown \(full log: (.*)\)", t)
                    assert n and n.group(2) == str(tmp_path / "attempt-0" / f"rank-{r}.out")
                    skipped += int(n.group(1).replace(",", ""))
        assert shown + skipped == lines_per_rank
    # The kernel keeps bounded tails; the final snapshot ends on each rank's last line.
    final = c.snapshots[-1]
    assert final["header"]["state"] == "succeeded" and final["seq"] == sends + 1
    for r in range(ranks):
        tail = final["tails"][str(r)]
        assert len(tail) == TAB_LINES and tail[-1] == ["out", f"{r} {lines_per_rank - 1}"]
    assert len(final["all"]) == ALL_TAB_LINES
    # The summary line is printed under the dashboard, not drawn in it too.
    assert final["summary"] == {
        "outcome": "succeeded",
        "cause": None,
        "headline": None,
        "in_error": [],
        "raised": False,
    }


def test_states_chips_alerts_and_the_attempts_timeline(
    comms: list[RecordingComm], clock: Clock, tmp_path: Path
) -> None:
    dash = Dashboard("cafe0001", str(tmp_path), job_spec({"nproc": 2, "max_restarts": 1}))
    c = _dashboard_comm(comms)
    first = c.sent[0]["state"]["snapshot"]
    assert first["header"]["worst_case_s"] == 360.0 and first["header"]["background"] is False
    assert {r: chip["state"] for r, chip in first["ranks"].items()} == {
        "0": "starting",
        "1": "starting",
    }

    running = {"state": "running", "label": "running", "attempt": 0, "pid": 11}
    dash.update({"state": "running", "attempt": 0, "ranks": {"0": running, "1": running}})
    dash.update({"logs": [batch(0, 1, "err", ["Traceback ...", "ValueError: boom"], None)]})
    failed = {"state": "failed", "label": "ValueError", "attempt": 0, "detail": "ValueError: boom"}
    restart = {
        "kind": "restart",
        "severity": "warning",
        "title": "attempt 0 failed: rank 1 ValueError: boom; restarting as attempt 1",
        "rank": 1,
        "text": None,
        "ends": 0,  # the attempt it ended (it may arrive with the next attempt's first word)
    }
    dash.update({"ranks": {"1": failed}, "alerts": [restart]})
    clock.now += 0.2
    dash.flush()  # everything above in one message
    assert len(c.customs) == 1
    delta = c.customs[0]
    assert delta["header"] == {"state": "running"}
    assert delta["ranks"]["1"]["label"] == "ValueError"
    assert delta["ranks"]["1"]["log"] == str(tmp_path / "attempt-0" / "rank-1.out")
    assert delta["alerts"] == [{**restart, "n": 0}]
    assert delta["lines"] == [["1", "err", ["Traceback ...", "ValueError: boom"]]]

    dash.update({"state": "restarting", "attempt": 1})  # the new attempt's first word
    dash.update({"ranks": {"0": {**running, "attempt": 1}}})
    clock.now += 0.2
    dash.flush()
    delta = c.customs[1]
    # One machine: every new attempt is a restart (the header said "restarts 0/1" beside the
    # summary's "restarts 1/1").
    assert delta["header"] == {"attempt": 1, "restarts": 1, "state": "restarting"}
    attempts = delta["attempts"]
    assert [a["attempt"] for a in attempts] == [0, 1]
    assert attempts[0]["ranks"]["1"] == {"state": "failed", "label": "ValueError"}
    assert attempts[0]["why"] == restart["title"]  # why attempt 0 ended: the restart's words
    # Each attempt of the timeline spans its start to its end: attempt 0 ended as 1 began.
    assert attempts[0]["ended_s"] == attempts[1]["started"] and attempts[1]["ended_s"] is None
    assert delta["ranks"]["1"]["state"] == "starting"  # attempt 1's rank 1 is not up yet
    assert ["1", "mark", ["── attempt 1 ──"]] in delta["lines"]
    # Each rank's tab has its separator; the all-ranks tab one, not one a rank (three for two).
    assert [line for line in dash.state.all if "── attempt 1 ──" in line[-1]] == [
        [None, "note", "── attempt 1 ──"]
    ]

    # A late line from the replaced attempt does not land in the new attempt's tab.
    dash.update({"logs": [batch(0, 0, "out", ["late"], None)]})
    clock.now += 0.2
    dash.flush()
    assert len(c.customs) == 2

    dash.end(_summary("succeeded", str(tmp_path), attempt=1, restarts=1, max_restarts=1))
    final = c.snapshots[-1]
    assert final["attempts"][1]["outcome"] == "succeeded"
    assert final["attempts"][1]["ended_s"] == 9.5  # the job's wall time
    assert final["header"]["state"] == "succeeded" and final["header"]["wall_s"] == 9.5
    assert final["header"]["restarts"] == 1


def test_progress_bars_show_their_latest_state(
    comms: list[RecordingComm], clock: Clock, tmp_path: Path
) -> None:
    dash = Dashboard("cafe0001", str(tmp_path), job_spec({"nproc": 1}))
    c = _dashboard_comm(comms)
    dash.update({"logs": [batch(0, 0, "err", [], "epoch 1:  40%|####")]})
    clock.now += 0.2
    dash.flush()
    assert c.customs[-1]["progress"] == {"0": ["err", "epoch 1:  40%|####"]}
    dash.update({"logs": [batch(0, 0, "out", ["a print from the loop"], None)]})
    clock.now += 0.2
    dash.flush()
    assert "progress" not in c.customs[-1]  # a line on another stream leaves the bar alone
    dash.update({"logs": [batch(0, 0, "err", ["epoch 1: 100%|##########"], None)]})
    clock.now += 0.2
    dash.flush()
    assert c.customs[-1]["progress"] == {"0": None}  # the bar's line is finished


def test_buttons_act_only_for_a_running_background_job(
    comms: list[RecordingComm], tmp_path: Path
) -> None:
    clicked: list[str] = []
    dash = Dashboard(
        "cafe0001",
        str(tmp_path),
        job_spec({"nproc": 1, "background": True}),
        on_stop=lambda: clicked.append("stop"),
        on_stacks=lambda: clicked.append("stacks"),
    )
    c = _dashboard_comm(comms)
    assert c.sent[0]["state"]["snapshot"]["header"]["background"] is True
    c.click("stacks")
    c.click("stop")
    c.click("format-disk")
    _wait(lambda: sorted(clicked) == ["stacks", "stop"])
    dash.end(_summary("stopped", str(tmp_path)))
    c.click("stop")  # too late: the job has ended
    assert sorted(clicked) == ["stacks", "stop"]


def _failed(run_dir: str) -> dict[str, Any]:
    """A job whose rank 1 raised, as the supervisor sums it up."""
    record = {"traceback": 'Traceback (most recent call last):\n  raise ValueError("boom")\n'}
    failure = {
        "rank": 1,
        "attempt": 0,
        "cause": "exception",
        "summary": "ValueError: boom (cell line 2)",
        "record": record,
    }
    return _summary(
        "failed",
        run_dir,
        reason="rank 1 ValueError: boom (cell line 2)",
        cause="exception",
        failure=failure,
        others=[{"rank": 0, "text": "stopped by elastic_nb (SIGTERM)", "delay": 0.02}],
    )


def _closing_alerts(summary: dict[str, Any]) -> list[dict[str, Any]]:
    """What the supervisor sends last for it: a warning of its own, then the failure in the
    words of the error the cell raises (supervisor/summary.py: closing_alerts)."""
    from elastic_nb.supervisor.runs.summary import closing_alerts

    stacks = {"kind": "hang", "severity": "warning", "title": "silent", "text": "rank 0 · ..."}
    return [stacks, *closing_alerts(summary, [], [])]


def test_the_end_leaves_to_the_error_what_the_error_says(
    comms: list[RecordingComm], tmp_path: Path
) -> None:
    """A blocking cell raises the failure report right under its dashboard: the alert whose
    detail is that report is marked (closed in the browser), the logs close, and no headline is
    drawn twice; the summary line is printed under the dashboard, not drawn in it."""
    dash = Dashboard("cafe0001", str(tmp_path), job_spec({"nproc": 2}))
    c = _dashboard_comm(comms)
    summary = _failed(str(tmp_path))
    dash.update({"alerts": _closing_alerts(summary)})
    dash.end(summary)
    final = c.snapshots[-1]
    silent, failure = final["alerts"]
    assert failure["kind"] == "failure" and failure["title"] == "rank 1 failed first: " + (
        "ValueError: boom (cell line 2)"
    )
    assert 'raise ValueError("boom")' in failure["text"]
    assert final["summary"] == {
        "outcome": "failed",
        "cause": "exception",
        "headline": None,  # the failure alert's title says it
        "in_error": [failure["n"]],  # not the warning: its text is not in the error
        "raised": True,
    }
    assert silent["n"] != failure["n"]
    assert c.customs[-1]["summary"] == final["summary"]  # the live view hears it too


def test_a_background_job_keeps_its_failure_open(
    comms: list[RecordingComm], tmp_path: Path
) -> None:
    """A --bg job's error is raised by job.wait(), elsewhere: its dashboard keeps it all."""
    spec = job_spec({"nproc": 2, "background": True})
    dash = Dashboard("cafe0001", str(tmp_path), spec)
    c = _dashboard_comm(comms)
    summary = _failed(str(tmp_path))
    dash.update({"alerts": _closing_alerts(summary)[1:]})
    dash.end(summary)
    assert c.snapshots[-1]["summary"]["in_error"] == []
    assert c.snapshots[-1]["summary"]["raised"] is False


def test_the_dashboards_text_is_its_start_line(comms: list[RecordingComm], tmp_path: Path) -> None:
    """What a reader that draws no widgets shows in the dashboard's place (a saved notebook on
    GitHub or nbviewer, nbconvert): the start line, which the cell prints nowhere else."""
    spec = job_spec({"nproc": 2})
    dash = Dashboard("cafe0001", str(tmp_path), spec)
    data, _ = dash.widget._repr_mimebundle_()
    assert data["text/plain"] == (
        f"[elastic_nb] job cafe0001: starting 2 ranks (a stuck collective fails the cell "
        f"within {spec.worst_case_s:g} s)"
    )
    assert data["application/vnd.jupyter.widget-view+json"]["model_id"] == dash.widget.model_id
    session = Dashboard("cafe0002", str(tmp_path), spec, session="5e55102")
    text = session.widget._repr_mimebundle_()[0]["text/plain"]
    assert text.startswith("[elastic_nb] job cafe0002: on session 5e55102's 2 ranks")


def _dashboard_comm(comms: list[RecordingComm]) -> RecordingComm:
    """The dashboard's comm (its layout is a widget of its own, with a comm of its own)."""
    (c,) = [x for x in comms if "snapshot" in x.sent[0].get("state", {})]
    return c


def _wait(predicate: Any) -> None:
    from tests.kernel import wait_for

    assert wait_for(predicate, timeout=5)


def test_the_header_keeps_the_latest_checkpoint(tmp_path: Path) -> None:
    from elastic_nb.kernel.dashboard.model import DashboardState

    dash = DashboardState("cafe0001", str(tmp_path), job_spec({"nproc": 2}))
    assert dash.snapshot()["header"]["checkpoint"] is None
    saved = [
        {"event": "saved", "step": step, "time": 1.0, "bytes": 10, "seconds": 0.5}
        for step in (100, 150, 200)
    ]
    dash.apply({"checkpoints": saved[:2]})
    dash.apply({"checkpoints": saved[2:]})
    delta = dash.take_delta()
    assert delta is not None and delta["header"]["checkpoint"]["step"] == 200
    assert dash.snapshot()["header"]["checkpoint"]["step"] == 200


def test_a_multinode_jobs_rounds_and_nodes_reach_the_dashboard(tmp_path: Path) -> None:
    """Across machines: each chip names its rank's node; the timeline holds each round (its
    nodes, world size, why, whether it spent a restart); the header counts restarts spent, not
    attempts (an arrival is a round, not a restart); a round with fewer nodes takes the chips of
    the ranks it no longer has off the dashboard."""
    from elastic_nb.kernel.dashboard.model import DashboardState

    spec = job_spec({"nproc": "2", "nnodes": "2:3", "log_dir": str(tmp_path)})
    state = DashboardState("feed0001", str(tmp_path), spec)
    assert sorted(state.ranks) == ["0", "1", "2", "3"]  # MIN nodes' ranks, to begin with

    def round_(attempt: int, nodes: int, why: str, counted: bool, restarts: int) -> dict[str, Any]:
        return dict(
            attempt=attempt, nodes=[f"node {i} (m{i})" for i in range(nodes)],
            world_size=2 * nodes, why=why, counted=counted, restarts=restarts, started=1.0,
            stop_s=None, rendezvous_s=0.1, running_s=0.5,
        )  # fmt: skip

    first = round_(0, 3, "first round", False, 0)
    state.apply({"rounds": [first], "attempt": 0, "state": "running"})
    chips = {
        str(r): {
            "state": "running",
            "label": "running",
            "attempt": 0,
            "node": f"node {r // 2} (m{r // 2})",
        }
        for r in range(6)
    }
    state.apply({"ranks": chips})
    assert state.header["world_size"] == 6 and state.header["restarts"] == 0
    assert state.ranks["5"]["node"] == "node 2 (m2)"
    left = round_(1, 2, "node 2 (m2) rank 4 was lost: node 2 (m2) left", True, 1)
    state.apply({"rounds": [first, left], "attempt": 1})
    delta = state.take_delta()
    assert delta is not None
    assert delta["ranks"]["4"] is None and delta["ranks"]["5"] is None  # the node's ranks go
    assert sorted(state.ranks) == ["0", "1", "2", "3"]
    assert state.header["world_size"] == 4 and state.header["restarts"] == 1
    assert [a["round"]["why"] for a in state.attempts] == [first["why"], left["why"]]
    # Why a round began is why the one before it ended: attempt 0 did not lose node 2, it ended
    # because node 2 left. (The restart alert, which arrives after the round, does not move it.)
    restart = {"kind": "restart", "severity": "warning", "title": "attempt 1: " + left["why"]}
    state.apply({"alerts": [restart]})
    assert [a["why"] for a in state.attempts] == [left["why"], None]
    joined = round_(2, 3, "node 3 (m3) joined", False, 1)
    state.apply({"rounds": [first, left, joined], "attempt": 2})
    assert sorted(state.ranks) == [str(r) for r in range(6)]
    assert state.header["restarts"] == 1  # an arrival spends nothing
    state.take_delta()
    assert state.snapshot()["attempts"][2]["round"]["counted"] is False


def test_the_checkpoint_header_carries_how_it_was_written(tmp_path: Path) -> None:
    """What the header's checkpoint shows (step, age from its time, size) and its tooltip (how
    long the save took, by how many ranks, and for an async save how long it blocked training
    and how long it ran beside it), from the records elastic_nb.checkpoint writes."""
    from elastic_nb.kernel.dashboard.model import DashboardState

    dash = DashboardState("cafe0001", str(tmp_path), job_spec({"nproc": 2}))
    sync = {
        "event": "saved",
        "step": 3,
        "time": 1000.0,
        "path": "/ckpt/step-000000000003-0a1b2c3d",
        "bytes": 5 * 2**20,
        "seconds": 1.44,
        "async": False,
        "blocked_s": 1.44,
        "overlapped_s": None,
        "world_size": 2,
        "shared": True,
    }
    dash.apply({"checkpoints": [sync]})
    assert dash.take_delta() is not None
    shown = dash.snapshot()["header"]["checkpoint"]
    assert {k: shown[k] for k in ("step", "time", "bytes", "path")} == {
        "step": 3,
        "time": 1000.0,
        "bytes": 5 * 2**20,
        "path": "/ckpt/step-000000000003-0a1b2c3d",
    }
    assert shown["how"] == "written in 1.4 s by 2 ranks"
    async_ = {**sync, "step": 4, "async": True, "seconds": 31.5, "blocked_s": 0.2}
    async_["overlapped_s"] = 31.3
    dash.apply({"checkpoints": [async_]})
    delta = dash.take_delta()
    assert delta is not None
    assert delta["header"]["checkpoint"]["how"] == (
        "written in 32 s by 2 ranks (async: 0.20 s blocking training, 31 s beside it)"
    )
    one = {**sync, "world_size": 1}
    dash.apply({"checkpoints": [one]})
    assert dash.take_delta() is not None
    assert dash.snapshot()["header"]["checkpoint"]["how"] == "written in 1.4 s by 1 rank"


def test_a_desyncs_failure_is_said_once(tmp_path: Path) -> None:
    """A desync's alert (its stacks) and the failure it ends in say the same words: the failure
    adds no second alert (they showed as [desync] and [failure] with identical text)."""
    dash = Dashboard("cafe0001", str(tmp_path), job_spec({"nproc": 2}))
    title = "desync: rank 1 left the cell while rank 0 waited in all_reduce #3 (cell line 7)"
    desync = {"kind": "desync", "severity": "error", "title": title, "rank": 1, "text": "stacks"}
    failure = {**desync, "kind": "failure", "text": "the failure report\nstacks"}
    dash.update({"alerts": [desync]})
    dash.update({"alerts": [failure]})
    assert [a["kind"] for a in dash.state.alerts] == ["desync"]
    other = {**failure, "title": "rank 1 failed first: ValueError: boom"}
    dash.update({"alerts": [other]})
    assert [a["kind"] for a in dash.state.alerts] == ["desync", "failure"]
    # The same finding under another lead: a collective timeout's alert said it first.
    finding = "rank 1 never entered all_reduce #2 (cell line 7): it was at cell line 8"
    timeout = {
        **desync,
        "kind": "collective_timeout",
        "title": f"rank 0 timed out after 5 s: {finding}",
    }
    dash.update({"alerts": [timeout, {**failure, "title": f"desync: {finding}"}]})
    assert [a["kind"] for a in dash.state.alerts] == ["desync", "failure", "collective_timeout"]


def test_a_replay_is_one_alert_that_grows(tmp_path: Path) -> None:
    """Alerts of one key (a replay's steps) take each other's place: one line, as it stands,
    and each new word says which one it replaces (the browser redraws that one)."""
    dash = Dashboard("cafe0001", str(tmp_path), job_spec({"nproc": 2}))
    steps = ["replaying 2 cells", "1 done", "the session's state is back: 2 cells replayed"]
    for title in steps:
        dash.update({"alerts": [{"kind": "replay", "severity": "info", "title": title,
                                 "rank": None, "text": None, "key": "replay-1"}]})  # fmt: skip
    dash.update({"alerts": [{"kind": "restart", "severity": "warning", "title": "other",
                             "rank": None, "text": None}]})  # fmt: skip
    alerts = list(dash.state.alerts)
    assert [a["title"] for a in alerts] == [steps[-1], "other"]
    assert alerts[0]["replaces"] == 1 and alerts[0]["n"] == 2
