"""Failure forensics with real ranks: desync, silence, OOM, a stuck agent, aborts.

Each test asserts what the user sees (the cell's error, the alerts printed under it) and that no
process of the job survives.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from elastic_nb.kernel.client import SupervisorClient
from tests.kernel import (
    Execution,
    Kernel,
    assert_job_gone,
    dashboard_of,
    run_dir,
    run_events,
    run_summary,
    wait_for,
)
from tests.nccl import IN_ALL_REDUCE_2, stuck_with_a_watchdog
from tests.test_supervisor import Recorder, submit

pytestmark = [pytest.mark.e2e, pytest.mark.core]

# docs/howto/hangs.md: a desync is named "within about half a second" of a rank leaving the cell
# (the watch looks every 0.25 s once one has), and two ranks in different ops within the second
# it looks every second.
# The margin is for a loaded machine (CI's; this suite beside a CPU hog). After a rank left:
# 1.0 s; measured beside three `yes > /dev/null` and other suites, a load average of 4-12 on 2
# cores, 3 runs of its four cases: 0.33-0.86 s. Two ranks in different ops: 1.5 s; measured
# there, 9 runs: 1.76-2.46 s (a mismatch is certain at the second look of ranks that have not
# moved, and the first look is due a second after the watch starts), too close to a 1.0 s
# margin's 2.5 s.
DESYNC_AFTER_LEAVING_S = 0.5 + 1.0
DESYNC_MISMATCH_S = 1.0 + 0.5 + 1.5

# docs/explanation/forensics.md's zombie watchdog: a dead rank left unreaped, or a monitor loop silent, "for more
# than `1 s + 3 x monitor-interval + 0.25 s`": 1.55 s at the default --monitor-interval (0.1).
# Caught at that bound: not before it (less 0.05 s, about one of the supervisor's polls), and
# within a margin of 0.5 s for a loaded machine.
ZOMBIE_AFTER_S = 1.0 + 3 * 0.1 + 0.25


def _since_it_left(ex: Execution, cache_home: Path, rank: int) -> float:
    """From the moment `rank` finished the cell (its done record's clock) to the error's arrival
    in the notebook."""
    done = json.loads(
        (run_dir(cache_home, ex.job_id) / "attempt-0" / f"rank-{rank}.done.json").read_text()
    )
    assert ex.error_at is not None
    return ex.error_at - done["time"]


DESYNC = """%%elastic --nproc 2 --collective-timeout 5
import time, torch, torch.distributed as dist
dist.init_process_group()
x = torch.ones(1)
dist.all_reduce(x)
if dist.get_rank() != 1:
    dist.all_reduce(x)   # rank 1 skips this one
print("past the collectives", flush=True)
time.sleep(120)
"""


def test_desync_names_the_rank_that_skipped_with_every_stack(
    kernel: Kernel, cache_home: Path
) -> None:
    ex = kernel.run(DESYNC)
    assert ex.ename == "JobFailed"
    assert ex.error["evalue"] == (
        "desync: rank 1 never entered all_reduce #2 (cell line 7): it was at cell line 9; "
        "rank 0 waited in it"
    )
    assert ex.seconds < 15
    # The stacks were taken before the teardown: rank 0 inside all_reduce, rank 1 past it.
    tb = ex.traceback
    assert "rank 0 · raised in all_reduce · cell line 7: dist.all_reduce(x)" in tb
    assert "rank 1 · cell line 9: time.sleep(120)" in tb
    assert "cause: desync" in tb
    # ...and the alert came first, live, with the same stacks.
    assert (
        "[elastic_nb] rank 0 timed out in all_reduce after 5 s: rank 1 never entered" in ex.stderr
    )
    s = run_summary(cache_home, ex.job_id)
    assert s["cause"] == "desync" and s["failure"]["rank"] == 1
    stacks = Path(s["run_dir"], "attempt-0", "rank-1.stacks").read_text()
    assert "time.sleep" not in stacks and ", line 9 in <module>" in stacks
    assert_job_gone(ex.job_id)


@pytest.mark.alone
@pytest.mark.parametrize("skipper", [1, 0])
def test_desync_against_a_rank_that_finished(
    kernel: Kernel, cache_home: Path, skipper: int
) -> None:
    # A rank skips the all_reduce and leaves the cell: certain at once, not after the timeout.
    # Either rank may be the culprit (rank 0 too: no rank is the waiter by position).
    waiter = 1 - skipper
    cell = (
        DESYNC.replace("--collective-timeout 5", "")
        .replace("time.sleep(120)\n", "")
        .replace("dist.get_rank() != 1", f"dist.get_rank() != {skipper}")
    )
    ex = kernel.run(cell)
    assert ex.ename == "JobFailed"
    assert ex.error["evalue"] == (
        f"desync: rank {skipper} left the cell after 1 collective (its last: all_reduce #1); "
        f"rank {waiter} waits in all_reduce #2 (cell line 7: dist.all_reduce(x)   # rank 1 "
        "skips this one)"
    )
    took = _since_it_left(ex, cache_home, skipper)
    assert took < DESYNC_AFTER_LEAVING_S, took
    s = run_summary(cache_home, ex.job_id)
    assert s["cause"] == "desync" and s["failure"]["rank"] == skipper
    assert_job_gone(ex.job_id)


DDP = """%%elastic --nproc 2
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group()
model = DDP(torch.nn.Linear(8, 8))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
batches = 6 - dist.get_rank() if UNEVEN else 6
for step in range(batches):
    loss = model(torch.randn(4, 8)).sum()
    if SKIP and dist.get_rank() == 1 and step == 3:
        continue            # a caught OOM: this rank skips its backward()
    loss.backward()
    opt.step()
    opt.zero_grad()
"""
_LEFT = re.compile(
    r"^desync: rank 1 left the cell after (\d+) collectives \(its last: all_reduce #(\d+)"
    r"(, cell line 12: loss\.backward\(\))?\); rank 0 waits in all_reduce #(\d+) "
    r"\(cell line 12: loss\.backward\(\): DDP's gradient all-reduce\)$"
)


@pytest.mark.alone
@pytest.mark.parametrize("case", ["skipped backward", "uneven batches"])
def test_ddp_rank_that_ran_out_of_batches_is_named_within_seconds(
    kernel: Kernel, cache_home: Path, case: str
) -> None:
    skip = case == "skipped backward"
    ex = kernel.run(DDP.replace("UNEVEN", str(not skip)).replace("SKIP", str(skip)))
    assert ex.ename == "JobFailed", ex.traceback
    m = _LEFT.match(ex.error["evalue"])
    assert m, ex.error["evalue"]
    assert m[1] == m[2] and int(m[4]) == int(m[1]) + 1  # its last, and the one rank 0 waits in
    assert "cause: desync (a rank ran fewer backward() passes than the others" in ex.traceback
    assert "rank 0: stopped by elastic_nb (SIGTERM) after rank 1 left the cell" in ex.traceback
    took = _since_it_left(ex, cache_home, 1)
    assert took < DESYNC_AFTER_LEAVING_S, took
    s = run_summary(cache_home, ex.job_id)
    assert s["cause"] == "desync" and s["failure"]["rank"] == 1
    # Found while rank 0 still waited: its stack is in the report.
    assert "rank 0 · cell line 12: loss.backward()" in ex.traceback
    assert_job_gone(ex.job_id)


@pytest.mark.alone
def test_a_rank_that_skipped_into_a_barrier_is_named_within_seconds(
    kernel: Kernel, cache_home: Path
) -> None:
    ex = kernel.run(
        DESYNC.replace(" --collective-timeout 5", "").replace(
            'print("past the collectives", flush=True)\ntime.sleep(120)\n',
            'print("barrier at", time.time(), flush=True); dist.barrier()\n',
        )
    )
    assert ex.ename == "JobFailed"
    assert ex.error["evalue"] == (
        "desync: rank 1 never entered all_reduce #2: it waits in barrier #2 (cell line 8: "
        'print("barrier at", time.time(), flush=True); dist.barrier()); rank 0 waits in '
        "all_reduce #2 (cell line 7: dist.all_reduce(x)   # rank 1 skips this one)"
    )
    entered = float(re.search(r"\[rank 1\] barrier at ([\d.]+)", ex.stdout)[1])
    assert ex.error_at is not None and ex.error_at - entered < DESYNC_MISMATCH_S, (
        ex.error_at - entered
    )
    s = run_summary(cache_home, ex.job_id)
    assert s["cause"] == "desync" and s["failure"]["rank"] == 1
    assert_job_gone(ex.job_id)


def test_a_slow_rank_is_not_a_desync(kernel: Kernel) -> None:
    # Rank 0 waits 6 s in the second all_reduce while rank 1 computes: slow, not desynced.
    ex = kernel.ok(
        "%%elastic --nproc 2\n"
        "import time, torch, torch.distributed as dist\n"
        "dist.init_process_group()\n"
        "x = torch.ones(1)\n"
        "dist.all_reduce(x)\n"
        "if dist.get_rank() == 1:\n"
        "    time.sleep(6)   # computing\n"
        "dist.all_reduce(x)\n"
        "x.item()\n",
    )
    assert ex.result == "4.0"
    assert "desync" not in ex.stdout + ex.stderr
    assert_job_gone(ex.job_id)


def test_four_ranks_one_leaves_early_every_waiter_and_its_chip(tmp_path: Path) -> None:
    c = SupervisorClient()
    try:
        job = submit(
            c,
            tmp_path,
            4,
            "import torch, torch.distributed as dist\n"
            "dist.init_process_group()\n"
            "x = torch.ones(1)\n"
            "for i in range(3 if dist.get_rank() == 2 else 4):\n"
            "    dist.all_reduce(x)\n",
        )
        rec = Recorder()
        s = job.follow(rec)
        assert s["outcome"] == "failed" and s["cause"] == "desync"
        assert s["failure"]["rank"] == 2
        assert s["failure"]["summary"] == (
            "rank 2 left the cell after 3 collectives (its last: all_reduce #3); "
            "ranks 0, 1, 3 wait in all_reduce #4 (cell line 6: dist.all_reduce(x))"
        )
        # The dashboard's chip says what rank 2 did, not a green "exited 0".
        chips = [m["ranks"]["2"] for _, m in rec.updates if "2" in m.get("ranks", {})]
        assert chips[-1]["state"] == "failed"
        assert chips[-1]["label"] == "left the cell early"
        assert_job_gone(job.id)
    finally:
        c.close()


def test_a_desync_with_restarts_left_restarts_at_once(kernel: Kernel, cache_home: Path) -> None:
    ex = kernel.run(
        DESYNC.replace("--collective-timeout 5", "--max-restarts 1").replace(
            "time.sleep(120)\n", ""
        )
    )
    assert ex.ename == "JobFailed"
    assert ex.error["evalue"].startswith("desync: rank 1 left the cell after 1 collective")
    assert (
        "[elastic_nb] attempt 0 failed: desync: rank 1 left the cell after 1 collective"
        in ex.stdout
    )
    assert "restarting as attempt 1 (restart 1/1)" in ex.stdout
    s = run_summary(cache_home, ex.job_id)
    assert s["restarts"] == 1 and s["cause"] == "desync"
    assert ex.seconds < 40
    assert_job_gone(ex.job_id)


HANG_AFTER_S = 3.0


@pytest.mark.alone
def test_a_silent_rank_raises_a_hang_alert_and_the_job_keeps_running(
    fresh_kernel: Kernel,
) -> None:
    k = fresh_kernel
    msg_id, ex = k.start(
        f"%%elastic --nproc 2 --hang-after {HANG_AFTER_S:g} --collective-timeout off\n"
        "import time, torch, torch.distributed as dist\n"
        "dist.init_process_group()\n"
        "print('initialised', flush=True)   # imports on a loaded machine are not the silence\n"
        "if dist.get_rank() == 1:\n"
        "    time.sleep(600)\n"
        "dist.all_reduce(torch.ones(1))\n"
    )
    k.collect(msg_id, ex, timeout=60, until=lambda e: "full dump" in e.stdout)
    alert = "no output and no exit from any rank for 3 s (--hang-after)"
    assert (
        f"{alert}: rank 1 never entered all_reduce #1 (cell line 7): it was at cell line 6; "
        "rank 0 waited in it" in ex.stdout
    )
    # After 3 s of silence, not before; then the stacks (a second at most) and a margin of
    # 1.5 s for a loaded machine. The silence began with the ranks' last line.
    silent = ex.when(alert) - max(ex.when(f"[rank {r}] initialised") for r in (0, 1))
    assert HANG_AFTER_S - 0.5 <= silent <= HANG_AFTER_S + 1.0 + 1.5, silent
    assert "rank 0 · waiting in all_reduce · cell line 7" in ex.stdout
    assert "rank 1 · cell line 6: time.sleep(600)" in ex.stdout
    job = ex.job_id
    assert ex.error is None  # still running: an alert, not an end
    k.interrupt()
    k.collect(msg_id, ex, timeout=30)
    assert ex.ename == "KeyboardInterrupt"
    # The finding outlives the interrupt: the summary keeps it, with every rank's stack.
    summary = json.loads((ex.run_dir / "summary.json").read_text())
    assert "rank 1 never entered all_reduce #1 (cell line 7)" in summary["reason"], summary
    assert "time.sleep(600)" in summary["diagnosis"]["stacks"]
    assert_job_gone(job)


def test_starting_ranks_are_not_a_hang(kernel: Kernel) -> None:
    # Spawning a rank and importing torch takes a second or more, far longer than this
    # --hang-after: that is start-up, with no stack of the cell to show yet, not silence.
    hang_after = 0.2
    ex = kernel.ok(
        f"%%elastic --nproc 2 --start-method spawn --hang-after {hang_after}\nprint('hello')\n"
    )
    # The start-up was long enough to look silent: five times --hang-after (on a fast machine
    # 1.4 s in all, which broke this check's 1.5 s when it used --hang-after 0.5).
    assert ex.seconds > 5 * hang_after, ex.seconds
    assert "[rank 1] hello" in ex.stdout
    assert "--hang-after" not in ex.stdout + ex.stderr
    assert_job_gone(ex.job_id)


def test_stacks_on_request(tmp_path: Path) -> None:
    c = SupervisorClient()
    try:
        job = submit(
            c,
            tmp_path,
            2,
            "import os, time\nprint('up', flush=True)\nwhile True:\n    time.sleep(0.1)\n",
        )
        assert wait_for(
            lambda: all(
                (tmp_path / job.id / "attempt-0" / f"rank-{r}.stacks").exists() for r in (0, 1)
            ),
            timeout=60,
        )
        text = c.stacks(job.id)
        assert "rank 0 · cell line 5: time.sleep(0.1)" in text
        assert "rank 1 · cell line 5: time.sleep(0.1)" in text
        c.stop(job.id)
        assert job.follow(Recorder())["outcome"] == "stopped"
        assert_job_gone(job.id)
    finally:
        c.close()


def test_stacks_come_from_the_probe_thread_while_other_threads_run(tmp_path: Path) -> None:
    """faulthandler's signal handler walks every thread's frames without the GIL: beside a
    thread that runs Python (the probe thread reading the flight recorder for the desync
    watch), that crashed a rank with SIGSEGV (CI, test_session's desync test). A stack request
    goes to the probe thread, which dumps holding the GIL. The cell replaces the signal's
    handler with one that leaves a mark: no rank is signalled, yet every request is answered,
    while a helper thread of the cell runs Python all along."""
    marks = tmp_path / "signalled"
    c = SupervisorClient()
    try:
        job = submit(
            c,
            tmp_path,
            2,
            "import os, signal, threading, time\n"
            f"signal.signal(signal.SIGUSR1, lambda *_: open({str(marks)!r}, 'a').write('x'))\n"
            "def churn():\n"
            "    while True:\n"
            "        sorted(str(i) for i in range(2000))\n"
            "threading.Thread(target=churn, daemon=True).start()\n"
            "print('up', flush=True)\n"
            "while True:\n"
            "    time.sleep(0.01)\n",
        )
        logs = [tmp_path / job.id / "attempt-0" / f"rank-{r}.out" for r in (0, 1)]
        assert wait_for(lambda: all(p.exists() and "up" in p.read_text() for p in logs), 60)
        for _ in range(10):
            text = c.stacks(job.id)
            assert "rank 0 · cell line 10: time.sleep(0.01)" in text, text
            assert "rank 1 · cell line 10: time.sleep(0.01)" in text, text
        assert not marks.exists()
        c.stop(job.id)
        assert job.follow(Recorder())["outcome"] == "stopped"
        assert_job_gone(job.id)
    finally:
        c.close()


def test_stacks_of_a_rank_that_holds_the_gil_in_native_code(tmp_path: Path) -> None:
    """A main thread inside one long native call (here builtins.sum over a range) keeps the
    GIL, so the probe thread cannot answer: the rank is signalled instead, and faulthandler
    answers without the GIL (no other thread can run Python meanwhile)."""
    c = SupervisorClient()
    try:
        job = submit(
            c,
            tmp_path,
            2,
            "while True:\n    print('up', flush=True)\n    total = sum(range(10**9))\n",
        )
        logs = [tmp_path / job.id / "attempt-0" / f"rank-{r}.out" for r in (0, 1)]
        assert wait_for(lambda: all(p.exists() and "up" in p.read_text() for p in logs), 60)
        text = c.stacks(job.id)
        assert "rank 0 · cell line 4: total = sum(range(10**9))" in text, text
        assert "rank 1 · cell line 4: total = sum(range(10**9))" in text, text
        c.stop(job.id)
        assert job.follow(Recorder())["outcome"] == "stopped"
        assert_job_gone(job.id)
    finally:
        c.close()


def test_cuda_oom_is_its_own_cause(kernel: Kernel, cache_home: Path) -> None:
    ex = kernel.run(
        "%%elastic --nproc 3\n"
        "import os, torch\n"
        "if os.environ['RANK'] == '2':\n"
        "    raise torch.cuda.OutOfMemoryError(\n"
        "        'CUDA out of memory. Tried to allocate 2.50 GiB. GPU 0 has a total capacity of 79 GiB')\n"
    )
    assert ex.ename == "JobFailed"
    assert ex.error["evalue"].startswith("rank 2 failed first: torch.OutOfMemoryError: CUDA out")
    assert "cause: cuda_oom" in ex.traceback
    assert (
        "[elastic_nb] rank 2 ran out of CUDA memory on GPU 0 at cell line 4 (requested 2.50 GiB)"
        in (ex.stderr)
    )
    assert run_summary(cache_home, ex.job_id)["cause"] == "cuda_oom"
    assert_job_gone(ex.job_id)


@pytest.mark.parametrize("start_method", ["forkserver", "spawn"])
def test_agent_deadlock_after_results_is_caught_by_the_watchdog(
    tmp_path: Path, cache_home: Path, start_method: str
) -> None:
    # Each rank returns, then aborts while it waits for the agent's Event.set(): the hook holds
    # the agent between reading every result and set() and marks that moment with a file; the
    # ranks abort as soon as it appears, so set() then blocks forever on the dead waiters
    # (torch 2.13, multiprocessing/api.py _poll). The hold only has to outlast the abort.
    k = Kernel(
        str(tmp_path),
        env={"ELASTIC_NB_TEST_HOLD_BEFORE_SET": "1.0", "XDG_CACHE_HOME": str(cache_home)},
    )
    try:
        k.ok("%load_ext elastic_nb")
        ex = k.run(
            f"%%elastic --nproc 2 --start-method {start_method}\n"
            "import os, threading, time\n"
            "read = os.path.join(os.environ['ELASTIC_NB_RUN_DIR'], 'test-agent-read-results')\n"
            "def abort_in_the_window():\n"
            "    while not os.path.exists(read):\n"
            "        time.sleep(0.005)\n"
            "    os.abort()\n"
            "threading.Thread(target=abort_in_the_window).start()\n"
            "'returned'\n"
        )
        assert ex.error is None, ex.traceback
        assert ex.result == "'returned'"  # what the ranks returned before the deadlock
        assert "torchelastic's agent is stuck (zombie): " in ex.stderr
        assert "had finished the cell" in ex.stderr
        # Spawned ranks are the agent's children: they stay zombies. Forked ones are reaped
        # by their fork server: the agent simply never returns.
        if start_method == "spawn":
            seen = re.search(r"died ([\d.]+) s ago and is still unreaped", ex.stderr)
        else:
            seen = re.search(r"every rank finished the cell and exited ([\d.]+) s ago", ex.stderr)
        assert seen, ex.stderr
        # Caught at the docs' bound (ZOMBIE_AFTER_S), give or take a poll on a loaded
        # machine.
        assert ZOMBIE_AFTER_S - 0.05 <= float(seen[1]) < ZOMBIE_AFTER_S + 0.5
        assert_job_gone(ex.job_id)
    finally:
        k.shutdown()


def test_a_frozen_agent_is_caught_by_the_watchdog(kernel: Kernel, cache_home: Path) -> None:
    ex = kernel.run(
        "%%elastic --nproc 2\n"
        "import os, signal, time\n"
        "time.sleep(1)\n"
        "if os.environ['RANK'] == '0':\n"
        "    import psutil\n"
        "    launcher = psutil.Process(os.getpgid(0))  # the leader of the job's process group\n"
        "    print('stopped at', time.time(), flush=True)\n"
        "    launcher.send_signal(signal.SIGSTOP)\n"
        "time.sleep(60)\n"
    )
    assert ex.ename == "JobFailed"
    assert "torchelastic's agent got stuck: its monitor loop has not run for" in ex.error["evalue"]
    assert "is stopped (SIGSTOP)" in ex.stderr
    # The alert came within the documented bound of the freeze (its last tick may be up to one
    # tick older than the freeze; a poll of slack on a loaded machine).
    stopped_at = float(re.search(r"stopped at ([\d.]+)", ex.stdout)[1])  # type: ignore[index]
    (alerted_at,) = [
        e["t"]
        for e in run_events(cache_home, ex.job_id)
        if e["event"] == "alert" and e["kind"] == "zombie"
    ]
    assert alerted_at - stopped_at < ZOMBIE_AFTER_S + 0.5
    assert run_summary(cache_home, ex.job_id)["cause"] == "zombie"
    assert_job_gone(ex.job_id)


def test_sigabrt_on_every_rank_at_once(kernel: Kernel, cache_home: Path) -> None:
    ex = kernel.run(
        "%%elastic --nproc 3\n"
        "import os, torch.distributed as dist\n"
        "dist.init_process_group()\n"
        "dist.barrier()\n"
        "os.abort()   # what NCCL's watchdog does to every rank\n"
    )
    assert ex.ename == "JobFailed"
    assert "killed by SIGABRT" in ex.error["evalue"]
    summary = run_summary(cache_home, ex.job_id)
    assert summary["cause"] == "signal"
    # faulthandler left the stack of the abort in the log of the rank blamed for it (the others
    # may have been stopped by the teardown before their own abort, on a loaded machine)
    root = summary["failure"]["rank"]
    err = Path(summary["run_dir"], "attempt-0", f"rank-{root}.err").read_text()
    assert "Fatal Python error: Aborted" in err
    assert_job_gone(ex.job_id)


def test_timeouts_and_nccl_settings_reach_the_ranks(kernel: Kernel) -> None:
    ex = kernel.ok(
        "%%elastic --nproc 2 --collective-timeout 42 --heartbeat-timeout 17 "
        "--async-error-handling 3\n"
        "import os, torch, torch.distributed as dist\n"
        "dist.init_process_group()\n"
        "backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device('cpu'))\n"
        "print('timeout', backend.options._timeout.total_seconds())\n"
        "for k in ('TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC', 'TORCH_NCCL_ASYNC_ERROR_HANDLING',\n"
        "          'TORCH_NCCL_DUMP_ON_TIMEOUT', 'TORCH_NCCL_ENABLE_MONITORING'):\n"
        "    print(k, os.environ[k])\n"
        "print('fr', os.environ['TORCH_FR_DUMP_TEMP_FILE'].endswith('/attempt-0/fr-rank-'))\n"
    )
    for rank in (0, 1):
        for line in (
            "timeout 42.0",
            "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC 17",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING 3",
            "TORCH_NCCL_DUMP_ON_TIMEOUT 1",
            "TORCH_NCCL_ENABLE_MONITORING 1",
            "fr True",
        ):
            assert f"[rank {rank}] {line}" in ex.stdout, ex.stdout
    # The worst case is stated up front: (max_restarts + 1) * (collective + NCCL's 60 s dump).
    assert "a stuck collective fails the cell within 102 s" in ex.stdout
    assert_job_gone(ex.job_id)


def test_an_explicit_timeout_in_the_cell_is_warned_about(kernel: Kernel) -> None:
    ex = kernel.ok(
        "%%elastic --nproc 1 --collective-timeout 30\n"
        "import datetime, torch.distributed as dist\n"
        "dist.init_process_group(timeout=datetime.timedelta(seconds=5))\n"
    )
    assert (
        "warning: cell line 3 passes timeout= to a process group; it overrides "
        "--collective-timeout 30" in ex.stderr
    )
    assert_job_gone(ex.job_id)


@pytest.mark.parametrize("flag", ["--async-error-handling 7", "--heartbeat-timeout -1"])
def test_bad_forensics_flags_launch_nothing(kernel: Kernel, flag: str) -> None:
    ex = kernel.run(f"%%elastic --nproc 1 {flag}\nprint('never')\n")
    assert ex.ename == "UsageError" and "never" not in ex.stdout


FAKE_NCCL = "%%elastic --nproc 2 --collective-timeout off MODE\n" + stuck_with_a_watchdog()


def test_nccls_watchdog_line_is_a_timeout_diagnosed_before_its_abort(
    kernel: Kernel, cache_home: Path
) -> None:
    ex = kernel.run(FAKE_NCCL.replace(" MODE", ""))
    assert ex.ename == "JobFailed"
    # The waiting rank is not blamed: rank 1, which never came, is.
    assert ex.error["evalue"] == (
        "desync: rank 1 never entered all_reduce #2 (cell line 12): it was at cell line 14; "
        "rank 0 waited in it"
    )
    assert "[elastic_nb] rank 0 timed out in ALLREDUCE #2: rank 1 never entered all_reduce #2" in (
        ex.stderr
    )
    # Diagnosed at the watchdog's line, while both ranks lived: no minute's wait for the abort.
    assert "rank 0 · waiting in all_reduce · cell line 12" in ex.traceback
    assert "rank 1 · cell line 14: time.sleep(600)" in ex.traceback
    assert ex.seconds < 30
    s = run_summary(cache_home, ex.job_id)
    assert s["cause"] == "desync" and s["failure"]["rank"] == 1
    assert_job_gone(ex.job_id)


def test_a_mode_that_keeps_the_rank_gets_an_alert_not_an_end(kernel: Kernel) -> None:
    # Rank 0 lives on until the alert is in the job's event log (not for a guessed while).
    until_alerted = (
        "    events = os.path.join(os.environ['ELASTIC_NB_RUN_DIR'], 'events.jsonl')\n"
        "    deadline = time.time() + 60\n"
        "    while '\"collective_timeout\"' not in open(events).read() and time.time() < deadline:\n"
        "        time.sleep(0.05)\n"
    )
    cell = (
        FAKE_NCCL.replace(" MODE", " --async-error-handling 2")
        .replace("    dist.all_reduce(torch.ones(1))   # rank 1 never comes\n", until_alerted)
        .replace(IN_ALL_REDUCE_2, "    pass  # no all_reduce #2 to wait for: rank 0 polls\n")
    )
    cell = cell.replace("    time.sleep(600)\n", "    pass\n")
    cell += "print('monitoring', os.environ['TORCH_NCCL_ENABLE_MONITORING'])\n"
    ex = kernel.ok(cell)
    assert (
        "[elastic_nb] rank 0: NCCL's watchdog: ALLREDUCE #2 timed out after 1003 ms "
        "(Timeout(ms)=1000); it lives on (--async-error-handling 2)" in ex.stdout
    )
    # Mode 2 keeps the rank: NCCL's heartbeat monitor, which would end it anyway, is off.
    assert "[rank 0] monitoring 0" in ex.stdout and "[rank 1] monitoring 0" in ex.stdout
    assert_job_gone(ex.job_id)


def test_ranks_write_no_core_dumps(kernel: Kernel) -> None:
    # A rank that aborts with gigabytes of GPU-mapped memory would write a core that size.
    ex = kernel.ok(
        "%%elastic --nproc 2\nimport resource\nprint('core', resource.getrlimit(resource.RLIMIT_CORE)[0])\n"
    )
    assert "[rank 0] core 0" in ex.stdout and "[rank 1] core 0" in ex.stdout
    assert_job_gone(ex.job_id)


def test_a_hang_ended_by_the_timeout_keeps_its_finding(kernel: Kernel) -> None:
    """--timeout ends a job while a hang alert stands: the error and the summary still say
    which rank never entered which collective and show every rank's stack, rather than only
    "stopped by elastic_nb (SIGTERM)" for every rank; the alert names the rank that holds far
    more memory than the others; each rank's chip says where it was."""
    msg_id, ex = kernel.start(
        "%%elastic --nproc 2 --hang-after 2 --timeout 20 --collective-timeout off\n"
        "import time, torch, torch.distributed as dist\n"
        "dist.init_process_group()\n"
        "held = b'\\x01' * (600 << 20) if dist.get_rank() == 1 else b''  # written: resident\n"
        "print('initialised', flush=True)\n"
        "if dist.get_rank() == 1:\n"
        "    time.sleep(600)\n"
        "dist.all_reduce(torch.ones(1))\n"
    )
    ex = kernel.collect(msg_id, ex, timeout=90)
    finding = "rank 1 never entered all_reduce #1 (cell line 8): it was at cell line 7"
    # The silent rank holds far more memory than the other: the hang alert says so.
    assert re.search(r"rank 1 holds [\d.]+× the others' host memory \(\d+ MiB\)", ex.stdout)
    assert ex.ename == "JobTimeout", (ex.ename, ex.traceback)
    assert "the --timeout of 20 s passed; before that: no output and no exit" in ex.traceback
    assert finding in ex.traceback, ex.traceback
    assert "where every rank was" in ex.traceback and "time.sleep(600)" in ex.traceback
    summary = json.loads((ex.run_dir / "summary.json").read_text())
    assert finding in summary["reason"] and "time.sleep(600)" in summary["diagnosis"]["stacks"]
    # Each rank's chip said where it was while the alert stood, and still says so at the end.
    dash, events = dashboard_of(kernel, ex.job_id, {"nproc": 2})
    said = [c["label"] for e in events for c in e.get("ranks", {}).values()]
    silent = re.compile(r"silent (\d+) s · line 7")
    assert "waiting in all_reduce #1 · line 8" in said, said
    assert any(silent.fullmatch(label) for label in said), said
    labels = {r: c["label"] for r, c in dash.ranks.items()}
    assert labels["0"] == "stopped · waiting in all_reduce #1 · line 8", labels
    quiet = re.fullmatch(r"stopped · silent (\d+) s · line 7", labels["1"])
    assert quiet and 2 <= int(quiet[1]) <= 5, labels  # --hang-after 2: silent 2 s, and the look
    assert_job_gone(ex.job_id)
