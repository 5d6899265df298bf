"""Text mode's lines for a job across machines (kernel/render_text.py), on hand-made updates;
the same lines from real agents are tests/test_multinode.py's and the notebooks'."""

from __future__ import annotations

import io
from typing import Any

import pytest

from elastic_nb.kernel.render_text import TextRenderer

pytestmark = pytest.mark.unit


def _round(
    attempt: int, nodes: list[str], why: str, counted: bool, started: float = 0.0
) -> dict[str, Any]:
    return {
        "attempt": attempt,
        "nodes": nodes,
        "world_size": len(nodes),
        "why": why,
        "counted": counted,
        "restarts": int(counted),
        "started": started,
        "stop_s": None,
        "rendezvous_s": 0.1,
        "running_s": 0.4,
    }


def test_each_round_says_where_its_own_ranks_run() -> None:
    """One rank per node: 3 nodes, node 1 lost, node 3 joins. Each round's line names its
    ranks by node, never a rank of an earlier round's larger world; why it began is said once
    (the first round here, the others in their alert's line as they began)."""
    out = io.StringIO()
    r = TextRenderer("cafe0001", "/runs/cafe0001", out, io.StringIO())
    a, b, c, d = "node 0 (vm)", "node 1 (gpu-b)", "node 2 (gpu-c)", "node 3 (gpu-d)"
    rounds = [_round(0, [a, b, c], "first round", False)]
    r.update({"ranks": {"0": {"node": a}, "1": {"node": b}, "2": {"node": c}}, "rounds": rounds})
    rounds.append(_round(1, [a, c], f"{b} rank 1 was lost: its node left", True))
    r.update({"ranks": {"0": {"node": a}, "1": {"node": c}}, "rounds": rounds})
    rounds.append(_round(2, [a, c, d], f"{d} joined", False))
    r.update({"ranks": {"1": {"node": c}, "2": {"node": d}}, "rounds": rounds})
    assert out.getvalue().splitlines() == [
        "[elastic_nb] attempt 0: first round · world size 3 · node 0 (vm): ranks 0; "
        "node 1 (gpu-b): ranks 1; node 2 (gpu-c): ranks 2, running 0.4 s after it began",
        "[elastic_nb] attempt 1 · world size 2 · node 0 (vm): ranks 0; node 2 (gpu-c): ranks 1, "
        "running 0.4 s after it began",
        "[elastic_nb] attempt 2 · world size 3 · node 0 (vm): ranks 0; node 2 (gpu-c): ranks 1; "
        "node 3 (gpu-d): ranks 2, running 0.4 s after it began",
    ]


def test_the_end_says_the_timeline_in_words() -> None:
    """A job across machines that lost a node and got one back: at its end one line an attempt,
    each from its start to its end (seconds into the job), its nodes and world, and why it
    ended: the round after it's beginning (attempt 0 did not lose node 1: it ended because node 1
    left)."""
    from elastic_nb import protocol

    out = io.StringIO()
    r = TextRenderer("cafe0001", "/runs/cafe0001", out, io.StringIO())
    a, b, c = "node 0 (vm)", "node 1 (gpu-b)", "node 2 (gpu-c)"
    t0 = 1000.0
    rounds = [_round(0, [a, b], "first round", False, t0)]
    r.update({"rounds": rounds, "attempt": 0})
    rounds.append(_round(1, [a], f"{b} left: connection lost", True, t0 + 12.5))
    r.update({"rounds": rounds, "attempt": 1})
    rounds.append(_round(2, [a, c], f"{c} joined", False, t0 + 20.0))
    r.update({"rounds": rounds, "attempt": 2})
    out.seek(0)
    out.truncate()
    end = protocol.records.summary("cafe0001", "succeeded", "every rank finished the cell")
    end.update(started=t0, wall_s=31.0, attempt=2, world_size=2, run_dir="/runs/cafe0001")
    r.end(end)
    assert out.getvalue().splitlines()[:4] == [
        "[elastic_nb] timeline:",
        f"[elastic_nb]   attempt 0 · 0.0 s to 12.5 s (12 s) · {a}, {b} · world size 2 · "
        f"ended: {b} left: connection lost",
        f"[elastic_nb]   attempt 1 · 12.5 s to 20.0 s (7.5 s) · {a} · world size 1 · "
        f"ended: {c} joined",
        f"[elastic_nb]   attempt 2 · 20.0 s to 31.0 s (11 s) · {a}, {c} · world size 2",
    ]


def test_one_attempt_on_one_machine_has_no_timeline() -> None:
    from elastic_nb import protocol

    out = io.StringIO()
    r = TextRenderer("cafe0001", "/runs/cafe0001", out, io.StringIO())
    r.update({"state": "running", "attempt": 0})
    end = protocol.records.summary("cafe0001", "succeeded", "every rank finished the cell")
    end.update(started=1000.0, wall_s=3.0, world_size=2, run_dir="/runs/cafe0001")
    r.end(end)
    assert "timeline" not in out.getvalue()


def test_a_rank_waiting_for_a_paused_one_is_said_once_with_its_timeout() -> None:
    """Rank 1 at a prompt, rank 0 in an all_reduce waiting for it: one line for the pause, one
    for the wait (its chip comes again each look: said once), none when rank 0 runs again."""
    import re
    import time

    out = io.StringIO()
    r = TextRenderer("cafe0001", "/runs/cafe0001", out, io.StringIO())
    paused = {"state": "paused", "label": "paused at line 5", "attempt": 0}
    waiting = {
        "state": "waiting",
        "label": "waiting for rank 1 (paused) in all_reduce #2",
        "attempt": 0,
        "expires": time.time() + 298.4,
    }
    r.update({"ranks": {"1": paused}})
    for _ in range(3):
        r.update({"ranks": {"0": waiting}})
    r.update({"ranks": {"1": {"state": "running", "label": "running", "attempt": 0}}})
    r.update({"ranks": {"0": {"state": "running", "label": "running", "attempt": 0}}})
    lines = out.getvalue().splitlines()
    assert lines[0] == "[elastic_nb] rank 1 paused at line 5"
    assert re.fullmatch(
        r"\[elastic_nb\] rank 0 waiting for rank 1 \(paused\) in all_reduce #2: its timeout "
        r"runs out in 4 min 5[78] s",
        lines[1],
    ), lines
    assert lines[2:] == ["[elastic_nb] rank 1 resumed"]
