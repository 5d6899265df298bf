"""What a job decides from what its site shows, without a process: the test plays the launcher
and the ranks on a fake site (tests/fake_site.py), waits for what the job takes in (the fake
site says when the ranks' starts are in; the job's `run` returns at its end), and reads the
job's end as the kernel would. Where a story's decision is the decision core's, the same story
is told to the core alone as typed events (decider.Decider, as tests/test_decider.py does)."""

from __future__ import annotations

import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anyio
import pytest

from elastic_nb import protocol
from elastic_nb.common.rank_state import RankState
from elastic_nb.common.rundir import RunDir, write_json
from elastic_nb.common.submission import Submission
from elastic_nb.kernel.flags import job_spec
from elastic_nb.supervisor.forensics.verdict import analyze
from elastic_nb.supervisor.runs import decider as d
from elastic_nb.supervisor.runs.job import Job
from elastic_nb.supervisor.runs.placement import OneMachine
from tests.fake_site import FakeSite

pytestmark = pytest.mark.unit

CELL_LINES = 5
# Rank 0's stack while it waits in the all_reduce of cell line 4 (faulthandler's words).
WAITING = """Current thread 0x00007f0000000001 (most recent call first):
  File "/torch/distributed/distributed_c10d.py", line 2500 in all_reduce
  File "{cell}", line 4 in <module>
"""
# Rank 1's stack while it sleeps at cell line 3.
SLEEPING = """Current thread 0x00007f0000000002 (most recent call first):
  File "{cell}", line 3 in <module>
"""


def _job(tmp_path: Path, **options: Any) -> tuple[Job, FakeSite, list[dict[str, Any]]]:
    spec = job_spec({"nproc": "2", "log_dir": str(tmp_path), **options}, cwd=str(tmp_path))
    sent: list[dict[str, Any]] = []

    async def send(msg: Any) -> None:
        sent.append(dict(msg))

    site = FakeSite(RunDir.of(spec.log_dir, "cafe0001"))
    job = Job(Submission("cafe0001", spec, "x = 1\n" * CELL_LINES, _META, None), {}, site, send)
    job.prepare()
    return job, site, sent


_META = {"display": True, "modules": {}, "objects": [], "pull": []}


def _end(sent: list[dict[str, Any]]) -> dict[str, Any]:
    ends = [m for m in sent if m["kind"] == protocol.kernel.END]
    assert len(ends) == 1, sent
    return ends[0]["summary"]


def _play(job: Job, site: FakeSite, story: Callable[[], None]) -> None:
    """The job on its fake site: ranks 0 and 1 of attempt 0 start, `story()` plays what
    happens to them once the job has taken their starts in, and the job runs to its end (its
    `run` returns: 20 s at most)."""

    async def main() -> None:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(job.run)
                site.start_ranks(0, {0: 100, 1: 101})
                await site.heard()
                assert [r.rank for r in job.book.of(0)] == [0, 1]
                story()
        assert job.summary is not None

    anyio.run(main)


def _raised(rd: RunDir, rank: int, at: float, kind: str, message: str, line: int) -> None:
    """The failure record rank `rank` of attempt 0 leaves as it raises (bootstrap's)."""
    rd.attempt(0).mkdir(parents=True, exist_ok=True)
    record = {"rank": rank, "attempt": 0, "time": at, "type": kind, "message": message}
    write_json(rd.failure(0, rank), {**record, "cell_line": line, "traceback": ""})


def test_rank_1_dies_while_rank_0_waits_in_all_reduce(tmp_path: Path) -> None:
    """Rank 1 raised (its record says ValueError at cell line 3) and died; rank 0 sits in an
    all_reduce. The job fails at once naming rank 1, stops rank 0 (SIGTERM through its site)
    and says rank 0 was stopped because rank 1 failed."""
    job, site, sent = _job(tmp_path)
    rd = job.rd

    def story() -> None:
        site.dumps[0] = WAITING.format(cell=rd.cell)
        _raised(rd, 1, 1e10, "ValueError", "rank 1 ran out of patience", 3)
        site.rank_dies(0, 1, 1)

    _play(job, site, story)
    summary = _end(sent)
    assert summary["outcome"] == "failed" and summary["cause"] == "exception"
    assert summary["failure"]["rank"] == 1
    assert "ValueError: rank 1 ran out of patience (cell line 3)" in summary["failure"]["summary"]
    (other,) = summary["others"]
    assert (
        other["rank"] == 0
        and "stopped by elastic_nb (SIGTERM) after rank 1 failed" in other["text"]
    )
    assert site.stopped and site.closed
    assert (0, signal.SIGTERM) not in site.signals  # the teardown ended it, not a rank signal


def _core() -> tuple[d.Decider, RankState, RankState]:
    """A job's decision core on one machine, no restart left, ranks 0 and 1 of attempt 0 up."""
    core = d.Decider(0, OneMachine.final, OneMachine.awaited)
    core.handle(d.AttemptOpened(0.0, 0, 2, counted=False))
    ranks = RankState(0, 0, pid=100, started_at=0.1), RankState(0, 1, pid=101, started_at=0.1)
    for r in ranks:
        core.handle(d.RankStarted(0.1, r))
    return core, *ranks


def test_rank_1s_record_decides_at_once_and_rank_0_dies_of_the_teardown() -> None:
    """The first story, as the decision core hears it: rank 1's failure record (ValueError at
    cell line 3), then its death. The job fails at rank 1's record, naming it, and its teardown
    begins there: rank 0's SIGTERM after it is elastic_nb's stop, no failure of rank 0's, and
    the verdict says so."""
    core, r0, r1 = _core()
    r1.failure = {
        "rank": 1,
        "attempt": 0,
        "time": 1.0,
        "type": "ValueError",
        "message": "rank 1 ran out of patience",
        "cell_line": 3,
    }
    actions = core.handle(d.RankFailed(1.0, r1))
    assert [type(a).__name__ for a in actions] == ["Show", "Record", "Decide"]
    (decided,) = [a for a in actions if isinstance(a, d.Decide)]
    assert decided == d.Decide(
        "failed", "rank 1 ValueError: rank 1 ran out of patience (cell line 3)"
    )
    assert core.teardown_at == 1.0 and core.pinned[0] is r1
    r1.died_at, r1.exit_code = 1.01, 1
    r0.died_at, r0.exit_code = 1.2, -signal.SIGTERM
    for r in (r1, r0):  # decided already: a death changes nothing, and waits for no word
        assert [type(a).__name__ for a in core.handle(d.RankExited(r.died_at, r))] == ["Show"]
    assert r0.kind(core.teardown_at) == "terminated"
    verdict = analyze(core.of(0), core.teardown_at)
    assert verdict.root is r1 and verdict.cause == "exception"
    assert [o["text"] for o in verdict.others] == [
        "stopped by elastic_nb (SIGTERM) after rank 1 failed"
    ]


def test_a_peer_error_read_before_the_rank_it_names_is_seen_gone(tmp_path: Path) -> None:
    """Rank 1 SIGKILLed itself; rank 0's gloo error ("connection reset by peer") is read before
    rank 1's site has seen it go (a loaded machine: CI saw it so), and the teardown begins
    first. A SIGKILL sent before anyone stopping the group would send one is no teardown's:
    rank 1 failed first, killed by SIGKILL, and rank 0 is its peer, not the other way round;
    the job's reason says so too (it named rank 0's error, which decided it)."""
    job, site, sent = _job(tmp_path)
    rd = job.rd

    def story() -> None:
        site.rank_died_unseen(0, 1, -signal.SIGKILL)
        reset = "[pair.cc:534] Read error [127.0.0.1]:4000: Connection reset by peer"
        _raised(rd, 0, time.time(), "RuntimeError", reset, 4)

    _play(job, site, story)
    summary = _end(sent)
    assert (summary["cause"], summary["failure"]["rank"]) == ("signal", 1), summary
    assert summary["failure"]["summary"] == "killed by SIGKILL"
    assert [(o["rank"], o["kind"]) for o in summary["others"]] == [(0, "peer")]
    assert summary["reason"] == "rank 1 killed by SIGKILL", summary  # as the failure says


def test_a_rank_whose_collective_timed_out_is_released_once_the_evidence_is_taken(
    tmp_path: Path,
) -> None:
    """Rank 0's all_reduce timed out (its record says so) while rank 1 sleeps elsewhere; rank 0
    holds its exit for the evidence (rank/recorder.hold_for_evidence): once torch's agent sees
    it go, it ends rank 1, and where rank 1 was with it. The job takes every live rank's stack
    and flight recorder first, then releases rank 0."""
    job, site, sent = _job(tmp_path, collective_timeout="3")
    rd = job.rd

    def story() -> None:
        site.dumps[0] = WAITING.format(cell=rd.cell)
        site.dumps[1] = SLEEPING.format(cell=rd.cell)
        timed_out = "[unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete"
        _raised(rd, 0, time.time(), "RuntimeError", timed_out, 4)

    _play(job, site, story)
    summary = _end(sent)
    assert (summary["cause"], summary["failure"]["rank"]) == ("collective_timeout", 0), summary
    alerts = [a for m in sent if m["kind"] == protocol.kernel.UPDATE for a in m.get("alerts", [])]
    (timeout,) = [a for a in alerts if a["kind"] == "collective_timeout"]
    assert "rank 1 · cell line 3" in timeout["text"], timeout  # where rank 1 was
    released = site.asked.index((0, protocol.rank_probes.PROBE_RELEASE))
    assert site.asked.index((1, "stacks")) < released
    assert [what for rank, what in site.asked if rank == 0].count("release") == 1


def _history(seq: int, *, pending: bool) -> dict[str, Any]:
    """A flight recorder's record: group 0's members and count, and its entries (the last one
    still in flight when `pending`)."""
    entries = [
        {
            "process_group": ["0", "default_pg"],
            "collective_seq_id": n,
            "profiling_name": "gloo:all_reduce",
            "state": "scheduled" if pending and n == seq else "completed",
            "retired": not (pending and n == seq),
            "is_p2p": False,
            "frames": [],
        }
        for n in range(1, seq + 1)
    ]
    return {"time": 1.0, "groups": {"0": [0, 1]}, "seqs": {"0": seq}, "dump": {"entries": entries}}


def test_rank_1_left_the_cell_after_3_collectives_while_rank_0_waits_in_the_4th(
    tmp_path: Path,
) -> None:
    """The desync watch on a fake site: rank 1 finished the cell (its done record, its flight
    recorder's last word: 3 all_reduces); rank 0 answers probes from inside all_reduce #4. The
    job names rank 1 as the culprit within a few looks, long before any collective timeout."""
    job, site, sent = _job(tmp_path, collective_timeout="600")
    rd = job.rd

    def story() -> None:
        site.dumps[0] = WAITING.format(cell=rd.cell)
        site.recorders[0] = _history(4, pending=True)
        rd.attempt(0).mkdir(parents=True, exist_ok=True)
        write_json(rd.collectives(0, 1), {**_history(3, pending=False), "final": True})
        write_json(rd.done(0, 1), {"rank": 1, "attempt": 0, "time": 1.0})

    _play(job, site, story)
    summary = _end(sent)
    assert summary["outcome"] == "failed" and summary["cause"] == "desync"
    assert summary["failure"]["rank"] == 1
    text = summary["failure"]["summary"]
    assert "rank 1 left the cell after 3 collectives" in text
    assert "rank 0 waits in all_reduce #4" in text
    alerts = [a for m in sent if m["kind"] == protocol.kernel.UPDATE for a in m.get("alerts", [])]
    assert any(a["kind"] == "desync" and a["rank"] == 1 for a in alerts)


def test_the_desync_watchs_look_holds_the_decision_and_its_words_end_the_attempt() -> None:
    """The desync story, as the decision core hears it: rank 1 finished the cell while rank 0
    waits in all_reduce #4, and the desync watch begins a full look. The look holds what comes
    meanwhile (a launcher's end); once it confirms the desync, the attempt fails as rank 1's
    with the look's words, and the launcher's end, held, decides nothing more."""
    core, _, r1 = _core()
    r1.done = {"rank": 1, "attempt": 0, "time": 1.0}
    assert core.handle(d.LookBegan(1.5, 0)) == []
    assert core.handle(d.LauncherExited(1.6, ("failed", "torchelastic gave up"))) == []
    words = "rank 1 left the cell after 3 collectives; rank 0 waits in all_reduce #4"
    actions = core.handle(d.Diagnosed(1.8, 0, "look", None, r1, words))
    assert [a for a in actions if isinstance(a, d.Record)] == [
        d.Record("attempt.failed", {"attempt": 0, "rank": 1, "kind": "desync"})
    ]
    assert [a for a in actions if isinstance(a, d.Decide)] == [d.Decide("failed", words)]
    assert core.outcome == ("failed", words) and core.pinned[0] is r1


@pytest.mark.parametrize("stop", ["interrupt", "panel"])
def test_a_stop_ends_every_rank_and_says_who_asked(tmp_path: Path, stop: str) -> None:
    job, site, sent = _job(tmp_path)

    def story() -> None:
        job.request_stop(stop)

    _play(job, site, story)
    summary = _end(sent)
    expected = {"interrupt": "interrupted", "panel": "stopped"}[stop]
    assert summary["outcome"] == expected and summary["cause"] == "interrupted"
    assert site.stopped
