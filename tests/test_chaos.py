"""A chaos run with real processes: a real kernel, supervisor and gloo ranks, and a seeded
schedule of faults thrown at them, a cell each: a rank of the running attempt
SIGKILLed (once, or in every attempt until the budget is spent), the cell interrupted, or
nothing. After each cell, the same invariants the simulation checks (tests/simulation.py), read
from the records: the verdict names the rank that was killed, never one the group stopped; the
restarts spent are within the budget and each attempt failed at most once; no rank is left
"running"; the outcome is the one the faults make; no process of the job is left. The seed is
printed with every failure (ELASTIC_NB_CHAOS_SEED replays a schedule)."""

from __future__ import annotations

import os
import random
import re
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.kernel import Execution, Kernel, assert_job_gone, run_events, run_summary

pytestmark = [pytest.mark.e2e, pytest.mark.alone]

SEED = int(os.environ.get("ELASTIC_NB_CHAOS_SEED", "20261128"))
# Every fault with each budget it plays out differently under, in a seeded order; the rank each
# kill hits is the seed's too.
SCHEDULE = [
    ("kill", 0),
    ("kill", 1),
    ("kill", 2),
    ("kill every attempt", 1),
    ("kill every attempt", 2),
    ("interrupt", 0),
    ("interrupt", 2),
    ("none", 0),
]
NPROC = 3
# Each rank says its pid as it enters its loop (read from outside the product, as a user would
# find it), then steps in lockstep with the others: in an attempt a fault is thrown at, until the
# fault ends it; in the others, 40 steps.
CELL = """%%elastic --nproc {nproc} --max-restarts {restarts}
import os, time, torch, torch.distributed as dist
dist.init_process_group()
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
print(f"pid {{os.getpid()}} attempt {{attempt}}", flush=True)
x = torch.ones(1)
for step in range(100_000 if attempt < {faulted} else 40):
    dist.all_reduce(x)
    time.sleep(0.02)
attempt
"""
_PID = re.compile(r"\[rank (\d+)\] pid (\d+) attempt (\d+)")


def ranks_of(ex: Execution, attempt: int) -> dict[int, int]:
    """rank -> pid of the attempt's ranks that have said so."""
    return {int(r): int(p) for r, p, a in _PID.findall(ex.stdout) if int(a) == attempt}


def test_faults_thrown_at_real_jobs_keep_every_invariant(
    fresh_kernel: Kernel, cache_home: Path
) -> None:
    k, rng = fresh_kernel, random.Random(SEED)
    schedule = list(SCHEDULE)
    rng.shuffle(schedule)
    for cell, (fault, restarts) in enumerate(schedule):
        where = f"seed {SEED}, cell {cell}: {fault}, --max-restarts {restarts}"
        faulted = {"none": 0, "kill every attempt": restarts + 1}.get(fault, 1)
        msg_id, ex = k.start(CELL.format(nproc=NPROC, restarts=restarts, faulted=faulted))
        killed: dict[int, int] = {}  # attempt -> the rank killed in it
        attempt = 0
        while fault != "none":
            k.collect(
                msg_id, ex, timeout=90, until=lambda e, a=attempt: len(ranks_of(e, a)) == NPROC
            )
            if fault == "interrupt":
                k.interrupt()
                break
            rank = rng.randrange(NPROC)
            os.kill(ranks_of(ex, attempt)[rank], signal.SIGKILL)
            killed[attempt] = rank
            if fault == "kill" or attempt == restarts:
                break
            attempt += 1
        k.collect(msg_id, ex, timeout=120)
        summary = run_summary(cache_home, ex.job_id)
        check(summary, run_events(cache_home, ex.job_id), fault, killed, restarts, where)
        assert_job_gone(ex.job_id)
    assert k.ok("%%elastic --nproc 1\n'still here'\n").result == "'still here'"


def check(
    summary: dict[str, Any],
    events: list[dict[str, Any]],
    fault: str,
    killed: dict[int, int],
    restarts: int,
    where: str,
) -> None:
    outcome, failure = summary["outcome"], summary.get("failure")
    said = f"{where}: {outcome} ({summary['reason']})"
    assert summary["restarts"] <= restarts, said
    failed = [e["attempt"] for e in events if e["event"] == "attempt.failed"]
    assert len(failed) == len(set(failed)), f"{said}: an attempt failed twice: {failed}"
    assert not [o for o in summary.get("others", []) if o["kind"] == "running"], said
    if fault == "none":
        assert outcome == "succeeded" and summary["restarts"] == 0, said
    elif fault == "interrupt":
        assert outcome == "interrupted" and failure is None, said
    elif fault == "kill" and restarts > 0:
        # Killed once, then restarted: the next attempt runs to its end.
        assert outcome == "succeeded" and summary["restarts"] == 1, said
        assert failed == [0], said
    else:  # the last attempt the budget allows had a rank killed
        last = max(killed)
        assert outcome == "failed" and summary["restarts"] == last, said
        assert failure is not None and failure["rank"] == killed[last], said
        assert failure["cause"] == "signal" and "SIGKILL" in failure["summary"], said
