"""Root cause by our own clock: the earliest failure that is not a consequence."""

from __future__ import annotations

import signal

from elastic_nb.supervisor.verdict import RankState, analyze


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
    assert v.cause == "exit0" and "before finishing the cell" in v.root.failure_summary()
    assert v.others[0]["kind"] == "done"


def test_a_stopped_job_has_no_root() -> None:
    ranks = [RankState(0, r, died_at=2.0, exit_code=-signal.SIGTERM) for r in range(2)]
    v = analyze(ranks, teardown_at=1.9)
    assert (
        v.root is None and [o["text"] for o in v.others] == ["stopped by elastic_nb (SIGTERM)"] * 2
    )
