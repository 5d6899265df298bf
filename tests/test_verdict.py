"""Root cause by our own clock: the earliest failure that is not a consequence."""

from __future__ import annotations

import signal

import pytest

from elastic_nb.common.rank_state import RankState
from elastic_nb.supervisor.forensics import stacks
from elastic_nb.supervisor.forensics.collectives import History, Op
from elastic_nb.supervisor.forensics.desync import desync_verdict
from elastic_nb.supervisor.forensics.verdict import analyze
from tests.nccl import watchdog_line

pytestmark = pytest.mark.unit


def failure(
    t: float, type_: str = "ValueError", message: str = "boom", line: int | None = 5
) -> dict:
    return {"time": t, "type": type_, "message": message, "cell_line": line}


def test_torch_would_blame_the_victim_we_do_not() -> None:
    # Within the same second; rank 0 (the victim) has the lower rank.
    victim = RankState(
        0,
        0,
        failure=failure(100.9, "RuntimeError", "[gloo] Connection closed by peer [127.0.0.1]:1"),
    )
    culprit = RankState(0, 1, failure=failure(100.7))
    v = analyze([victim, culprit], teardown_at=None)
    assert v.root is culprit and v.cause == "exception"
    (other,) = v.others
    assert other["rank"] == 0 and other["kind"] == "peer" and "its peer had died" in other["text"]
    assert round(other["delay"], 2) == 0.2


def test_peer_errors_never_win_over_a_real_failure_even_if_earlier() -> None:
    early_peer = RankState(0, 0, failure=failure(10.0, "RuntimeError", "Connection reset by peer"))
    killed = RankState(0, 1, died_at=10.2, exit_code=-signal.SIGKILL)
    v = analyze([early_peer, killed], teardown_at=None)
    assert v.root is killed and v.cause == "signal"


def test_ranks_killed_in_the_teardown_are_consequences() -> None:
    culprit = RankState(0, 2, died_at=5.0, exit_code=3)
    torn = [RankState(0, r, died_at=5.2, exit_code=-signal.SIGTERM) for r in (0, 1, 3)]
    v = analyze([*torn, culprit], teardown_at=5.1)
    assert v.root is culprit and v.root.failure_summary() == "exited with code 3"
    assert [o["kind"] for o in v.others] == ["terminated"] * 3
    assert v.others[0]["text"] == "stopped by elastic_nb (SIGTERM) after rank 2 failed"


def test_agent_sigterms_after_a_failure_are_consequences() -> None:
    culprit = RankState(0, 1, failure=failure(1.0))
    by_agent = RankState(0, 0, died_at=1.3, exit_code=-signal.SIGTERM)
    v = analyze([by_agent, culprit], teardown_at=None)
    assert v.root is culprit
    assert v.others[0]["kind"] == "agent" and "torchelastic agent (SIGTERM)" in v.others[0]["text"]


def test_the_agent_stopping_a_silent_rank_after_a_timeout_is_a_consequence() -> None:
    timed_out = RankState(
        0, 0, failure=failure(8.0, "RuntimeError", "[Gloo] Timed out waiting 3000ms for recv")
    )
    silent = RankState(0, 1, died_at=8.4, exit_code=-signal.SIGTERM)  # by the agent
    v = analyze([timed_out, silent], teardown_at=None, behind=[1])
    assert v.root is silent and v.cause == "desync"
    assert v.others[0]["kind"] == "collective_timeout"


def test_ranks_ended_to_restart_after_a_desync_are_its_consequences() -> None:
    # The desync watch found rank 1 gone early and SIGTERMed rank 0 so the agent restarts: the
    # restart names rank 1, not the rank we stopped.
    left = RankState(0, 1, done={"time": 4.0})
    stopped = RankState(0, 0, died_at=4.2, exit_code=-signal.SIGTERM)
    v = analyze([stopped, left], teardown_at=None, behind=[1])
    assert v.root is left and v.cause == "desync"
    assert v.others == [
        {
            "rank": 0,
            "node": None,  # one machine: no node to name
            "kind": "terminated",
            "text": "stopped by elastic_nb (SIGTERM) after rank 1 left the cell",
            "delay": None,
        }
    ]


def test_all_ranks_aborting_at_once_blames_the_first() -> None:
    ranks = [RankState(0, r, died_at=7.0 + r / 100, exit_code=-signal.SIGABRT) for r in (2, 0, 1)]
    v = analyze(ranks, teardown_at=None)
    assert v.root.rank == 0 and v.root.failure_summary() == "killed by SIGABRT"
    assert all(
        o["kind"] == "signal" and o["text"].startswith("also failed: killed by SIGABRT")
        for o in v.others
    )


def test_exit_zero_without_done_is_a_failure() -> None:
    r = RankState(0, 1, died_at=3.0, exit_code=0)
    ok = RankState(0, 0, died_at=3.1, exit_code=0, done={"time": 3.0})
    v = analyze([r, ok], teardown_at=None)
    assert v.cause == "exit" and "before finishing the cell" in v.root.failure_summary()
    assert v.others[0]["kind"] == "done"


def test_a_stopped_job_has_no_root() -> None:
    ranks = [RankState(0, r, died_at=2.0, exit_code=-signal.SIGTERM) for r in range(2)]
    v = analyze(ranks, teardown_at=1.9)
    assert (
        v.root is None and [o["text"] for o in v.others] == ["stopped by elastic_nb (SIGTERM)"] * 2
    )


# ---- forensics: stacks and the desync verdict ---------------------------------------------------

CELL = "/runs/j/cell.py"
DUMP_IN_ALL_REDUCE = f"""Thread 0x00007f0000000001 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 324 in wait
  File "/usr/lib/python3.11/threading.py", line 1002 in _bootstrap

Current thread 0x00007f0000000002 (most recent call first):
  File "/torch/distributed/distributed_c10d.py", line 3252 in all_reduce
  File "/torch/distributed/c10d_logger.py", line 83 in wrapper
  File "{CELL}", line 7 in <module>
  File "/elastic_nb/worker.py", line 170 in _run_cell
  File "/elastic_nb/worker.py", line 60 in bootstrap
"""
DUMP_SLEEPING = f"""Current thread 0x00007f0000000003 (most recent call first):
  File "{CELL}", line 4 in helper
  File "{CELL}", line 9 in <module>
  File "/elastic_nb/worker.py", line 170 in _run_cell
"""


def test_a_dump_is_read_from_the_thread_that_runs_the_cell() -> None:
    w = stacks.where_from_dump(0, DUMP_IN_ALL_REDUCE, CELL, "/d/rank-0.stacks")
    assert w.collective() == "all_reduce" and w.cell_frame(CELL).line == 7
    text = stacks.format_stacks({0: w}, CELL, [f"line {i}" for i in range(1, 11)])
    assert text.splitlines() == [
        "rank 0 · waiting in all_reduce · cell line 7: line 7",
        "    distributed_c10d.py:3252 in all_reduce",
        "    c10d_logger.py:83 in wrapper",
        "    cell line 7 in <module>: line 7",
        "    full dump: /d/rank-0.stacks",
    ]


def test_desync_names_the_rank_outside_the_collective() -> None:
    where = {
        0: stacks.where_from_dump(0, DUMP_IN_ALL_REDUCE, CELL, "p0"),
        1: stacks.where_from_dump(1, DUMP_SLEEPING, CELL, "p1"),
        2: stacks.where_from_dump(2, DUMP_IN_ALL_REDUCE, CELL, "p2"),
    }
    in_flight = Op("0", 2, "all_reduce", done=False)
    histories = {
        r: History(r, last={"0": 2}, ops={("0", 2): in_flight}, known=True) for r in (0, 2)
    }
    d = desync_verdict(where, CELL, [], histories)
    assert d is not None and d.behind == [1] and d.waiting == [0, 2]
    assert d.text == (
        "rank 1 never entered all_reduce #2 (cell line 7): it was at cell line 4 in helper; "
        "ranks 0, 2 waited in it"
    )


def test_every_rank_in_the_same_collective_is_not_a_desync() -> None:
    where = {r: stacks.where_from_dump(r, DUMP_IN_ALL_REDUCE, CELL, "p") for r in (0, 1)}
    d = desync_verdict(where, CELL, [])
    assert d is not None and d.behind == [] and "none was missing" in d.text
    assert desync_verdict({0: stacks.RankWhere(0, "finished")}, CELL, []) is None


def test_a_rank_in_ddps_all_reduce_waits_though_its_stack_shows_no_collective() -> None:
    # DDP's reducer issues its all-reduces from C++: only the flight recorder knows.
    in_backward = DUMP_IN_ALL_REDUCE.replace(
        'File "/torch/distributed/distributed_c10d.py", line 3252 in all_reduce',
        'File "/torch/autograd/graph.py", line 979 in _engine_run_backward',
    ).replace('File "/torch/distributed/c10d_logger.py", line 83 in wrapper', "")
    where = {
        0: stacks.where_from_dump(0, in_backward, CELL, "p0"),
        1: stacks.where_from_dump(1, DUMP_SLEEPING, CELL, "p1"),
    }
    assert where[0].collective() is None
    op = Op("0", 9, "all_reduce", done=False)
    h = {0: History(0, last={"0": 9}, ops={("0", 9): op}, known=True)}
    d = desync_verdict(where, CELL, [], h)
    assert d is not None and not d.certain and d.behind == [1]
    assert d.text.startswith("rank 1 never entered all_reduce #9 (cell line 7)")


def test_a_traceback_gives_the_same_frames_as_a_dump() -> None:
    tb = (
        "Traceback (most recent call last):\n"
        f'  File "{CELL}", line 7, in <module>\n'
        "    dist.all_reduce(x)\n"
        '  File "/torch/distributed/distributed_c10d.py", line 3252, in all_reduce\n'
        "RuntimeError: Timed out waiting 5000ms\n"
    )
    w = stacks.where_from_record(0, {"traceback": tb})
    assert w.collective() == "all_reduce" and w.cell_frame(CELL).line == 7


def test_timeouts_and_ooms_are_their_own_kinds() -> None:
    timed_out = RankState(
        0, 0, failure={"type": "RuntimeError", "message": "Timed out waiting 5000ms", "time": 1.0}
    )
    oom = RankState(
        0,
        1,
        failure={"type": "torch.OutOfMemoryError", "message": "CUDA out of memory", "time": 2.0},
    )
    assert timed_out.kind(None) == "collective_timeout" and oom.kind(None) == "oom"
    v = analyze([timed_out, oom], None)
    assert v.root is oom and v.cause == "cuda_oom"  # the OOM is the root, the timeout its echo
    killed = RankState(0, 0, died_at=1.0, exit_code=-9, oom_killed=True)
    assert analyze([killed], None).cause == "host_oom"
    assert "OOM killer" in killed.failure_summary()


def test_ranks_that_never_started_are_listed() -> None:
    # A --timeout can pass while ranks are still starting: the report says so for each.
    up = RankState(0, 1, died_at=3.0, exit_code=-signal.SIGTERM)
    v = analyze([up], teardown_at=2.0, nproc=3)
    assert [(o["rank"], o["text"]) for o in v.others] == [
        (0, "had not started"),
        (1, "stopped by elastic_nb (SIGTERM)"),
        (2, "had not started"),
    ]


# ---- NCCL: the watchdog's timeout, then SIGABRT on every rank -----------------------------------

WATCHDOG_LINE = watchdog_line(rank=1, seq=7, timeout_ms=5000, ran_ms=5002)


def test_the_watchdogs_line_makes_a_timeout_and_the_aborts_after_it_consequences() -> None:
    # NCCL's watchdog in rank 1 reported the timeout at t=5; a minute later every rank aborts,
    # rank 0 (a waiting rank) first. torchelastic would blame rank 0's SIGABRT.
    timed_out = RankState(
        0, 1, watchdog={"time": 5.0, "line": WATCHDOG_LINE}, died_at=65.2, exit_code=-6
    )
    first_abort = RankState(0, 0, died_at=65.0, exit_code=-signal.SIGABRT)
    assert timed_out.kind(None) == "collective_timeout" and timed_out.failed_at == 5.0
    assert timed_out.failure_summary() == (
        "NCCL's watchdog: ALLREDUCE #7 timed out after 5002 ms (Timeout(ms)=5000)"
    )
    v = analyze([first_abort, timed_out], teardown_at=None)
    assert v.root is timed_out and v.cause == "collective_timeout"
    (other,) = v.others
    assert other["kind"] == "nccl_abort"
    assert other["text"] == "aborted by NCCL (SIGABRT) after the collective timeout"


def test_an_abort_before_any_timeout_is_still_the_root() -> None:
    crashed = RankState(0, 0, died_at=3.0, exit_code=-signal.SIGABRT)
    late = RankState(0, 1, watchdog={"time": 9.0, "line": WATCHDOG_LINE})
    v = analyze([crashed, late], teardown_at=None)
    assert v.root is crashed and v.cause == "signal"


def test_sys_exit_in_the_cell_is_an_exit_not_an_exception() -> None:
    r = RankState(0, 1, failure=failure(1.0, "SystemExit", "3"), died_at=1.1, exit_code=1)
    assert r.kind(None) == "exit"
    assert analyze([r], None).cause == "exit"


def test_a_rank_whose_position_is_unknown_is_not_behind() -> None:
    """A stack taken while the rank was raising (no cell frame yet, no record yet): it may have
    been on its way into the collective; blaming it made a timeout a false desync."""
    where = {
        0: stacks.RankWhere(0, "live", note="its stack has no cell frame"),
        1: stacks.where_from_dump(1, DUMP_IN_ALL_REDUCE, CELL, "p1"),
    }
    d = desync_verdict(where, CELL, [])
    assert d is not None and d.behind == [] and d.waiting == [1]
    assert d.text == "rank 1 waited in all_reduce (cell line 7); where rank 0 was is unknown"
    where[2] = stacks.where_from_dump(2, DUMP_SLEEPING, CELL, "p2")  # seen elsewhere: behind
    assert desync_verdict(where, CELL, []).behind == [2]  # type: ignore[union-attr]


def test_a_socket_error_of_the_cells_own_is_not_a_dead_peer() -> None:
    own = RankState(
        0,
        0,
        failure=failure(
            10.0, "urllib.error.URLError", "<urlopen error [Errno 111] Connection refused>"
        ),
    )
    later = RankState(0, 1, failure=failure(12.0))
    v = analyze([own, later], teardown_at=None)
    assert v.root is own and v.cause == "exception"
    store = failure(10.0, "torch.distributed.DistStoreError", "TCPStore: Connection refused")
    gloo = failure(10.0, "RuntimeError", "[gloo/transport/tcp/pair.cc:8] Broken pipe")
    for f in (store, gloo):
        assert RankState(0, 0, failure=f).kind(None) == "peer"
