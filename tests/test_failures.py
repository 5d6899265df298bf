"""Every way a job can fail, each with its user-visible outcome and no process left behind."""

from __future__ import annotations

import os
import re
import signal
import time
from pathlib import Path

import pytest

from elastic_nb.common import procs
from elastic_nb.common.rundir import RunDir
from tests.kernel import Kernel, assert_job_gone, kill_and_see_the_job_end, run_summary

pytestmark = [pytest.mark.e2e, pytest.mark.core]

# The culprit raises only once the waiter's all_reduce is provably under way: the waiter issues it
# (`async_op=True`, then `wait()`: what a blocking all_reduce does in distributed_c10d) and only
# then sets a key in the job's store, which the culprit waits for. No sleep decides the order.
RAISE_WHILE_PEER_WAITS = """%%elastic --nproc 2
import torch, torch.distributed as dist
dist.init_process_group()
store = dist.distributed_c10d._get_default_store()
x = torch.ones(1)
if dist.get_rank() == CULPRIT:
    store.wait(["WAITER in all_reduce"])
    raise ValueError("rank CULPRIT is broken")
work = dist.all_reduce(x, async_op=True)
store.set("WAITER in all_reduce", "yes")
work.wait()
"""


@pytest.mark.parametrize("culprit", [1, 0])
def test_rank_raises_while_peer_blocks(kernel: Kernel, cache_home: Path, culprit: int) -> None:
    """Either rank can be the one that fails: the verdict is by our clock, never by rank."""
    waiter = 1 - culprit
    cell = RAISE_WHILE_PEER_WAITS.replace("WAITER", str(waiter)).replace("CULPRIT", str(culprit))
    ex = kernel.run(cell)
    assert ex.ename == "JobFailed"
    assert ex.error["evalue"] == (
        f"rank {culprit} failed first: ValueError: rank {culprit} is broken (cell line 8)"
    )
    assert f'raise ValueError("rank {culprit} is broken")' in ex.traceback
    # The waiting rank is a consequence either way: stopped by us, or (when the culprit's exit
    # closed the connection before the next 50 ms poll) failed on its dead peer.
    assert re.search(
        rf"rank {waiter}: (stopped by elastic_nb \(SIGTERM\) after rank {culprit} failed"
        r"|.*: its peer had died)",
        ex.traceback,
    ), ex.traceback
    assert ex.seconds < 10
    assert_job_gone(ex.job_id)
    s = run_summary(cache_home, ex.job_id)
    assert s["failure"]["rank"] == culprit and s["failure"]["cause"] == "exception"
    # The kernel is fine: the next cell runs at once.
    assert kernel.ok("%%elastic --nproc 1\n'again'\n").result == "'again'"


def test_rank_exits_with_code(kernel: Kernel) -> None:
    ex = kernel.run(
        "%%elastic --nproc 2\nimport os, time\nif os.environ['RANK'] == '1':\n    os._exit(3)\ntime.sleep(60)\n"
    )
    assert ex.ename == "JobFailed"
    assert ex.error["evalue"] == "rank 1 failed first: exited with code 3"
    assert ex.seconds < 20
    assert_job_gone(ex.job_id)


def test_rank_sigkills_itself(kernel: Kernel) -> None:
    ex = kernel.run(
        "%%elastic --nproc 2\n"
        "import os, signal, torch, torch.distributed as dist\n"
        "dist.init_process_group()\n"
        "if dist.get_rank() == 1:\n"
        "    os.kill(os.getpid(), signal.SIGKILL)\n"
        "dist.all_reduce(torch.ones(1))\n"
    )
    assert ex.ename == "JobFailed"
    assert ex.error["evalue"] == "rank 1 failed first: killed by SIGKILL"
    assert "rank 0:" in ex.traceback
    assert_job_gone(ex.job_id)


def test_exit_zero_without_finishing_is_a_failure(kernel: Kernel) -> None:
    # torchelastic alone would wait forever for rank 1's return value.
    ex = kernel.run(
        "%%elastic --nproc 2\nimport os, time\nif os.environ['RANK'] == '1':\n    os._exit(0)\ntime.sleep(60)\n"
    )
    assert ex.ename == "JobFailed"
    assert "rank 1 failed first: exited with code 0 before finishing the cell" in ex.error["evalue"]
    assert ex.seconds < 20
    assert_job_gone(ex.job_id)


def test_sys_exit_zero_ends_the_cell_normally(kernel: Kernel) -> None:
    ex = kernel.ok(
        "%%elastic --nproc 2\nimport sys\nprint('before')\nsys.exit(0)\nprint('after')\n"
    )
    assert ex.stdout.count("before") == 2 and "after" not in ex.stdout
    assert_job_gone(ex.job_id)


def test_restart_after_a_failure_in_attempt_zero(kernel: Kernel, cache_home: Path) -> None:
    ex = kernel.ok(
        "%%elastic --nproc 2 --max-restarts 1\n"
        "import os, torch, torch.distributed as dist\n"
        "dist.init_process_group()\n"
        "attempt = int(os.environ['TORCHELASTIC_RESTART_COUNT'])\n"
        "if attempt == 0 and dist.get_rank() == 1:\n"
        "    raise RuntimeError('flaky')\n"
        "x = torch.ones(1)\n"
        "dist.all_reduce(x)\n"
        "print('attempt', attempt, 'sum', x.item())\n"
        "attempt\n",
        timeout=180,
    )
    assert (
        "attempt 0 failed: rank 1 RuntimeError: flaky (cell line 6); restarting as attempt 1 (restart 1/1)"
        in ex.stdout
    )
    assert "[rank 0] attempt 1 sum 2.0" in ex.stdout and "[rank 1] attempt 1 sum 2.0" in ex.stdout
    assert "restarts 1/1" in ex.stdout and "succeeded" in ex.stdout
    assert ex.result == "1"
    rd = RunDir(run_summary(cache_home, ex.job_id)["run_dir"])
    assert rd.attempts() == [0, 1]  # the failed attempt's logs are kept
    assert "RuntimeError: flaky" in rd.log(0, 1, "err").read_text()
    assert_job_gone(ex.job_id)


def test_restarts_exhausted(kernel: Kernel) -> None:
    ex = kernel.run(
        "%%elastic --nproc 2 --max-restarts 1\nimport os\nif os.environ['RANK'] == '0':\n    raise KeyError('always')\n",
        timeout=180,
    )
    assert ex.ename == "JobFailed"
    assert ex.error["evalue"].startswith("rank 0 failed first: KeyError: 'always'")
    assert "attempt 0 failed" in ex.stdout and "restarts 1/1" in ex.stdout
    assert_job_gone(ex.job_id)


def test_timeout_stops_a_sleeping_job(kernel: Kernel) -> None:
    # The deadline counts from the submit; 8 s leaves a cold start on a loaded machine its time.
    ex = kernel.run(
        "%%elastic --nproc 2 --timeout 8\nimport time\nprint('asleep', flush=True)\ntime.sleep(120)\n"
    )
    assert ex.ename == "JobTimeout"
    assert "--timeout of 8 s passed" in ex.error["evalue"]
    assert ex.seconds < 20
    assert ex.stdout.count("asleep") == 2
    assert "rank 0: stopped by elastic_nb (SIGTERM)" in ex.traceback
    assert_job_gone(ex.job_id)


def test_a_deadline_before_the_ranks_start_says_so(kernel: Kernel) -> None:
    # A launcher started for this cell (--no-warm) imports torch for a second or more: the
    # deadline comes first whatever ran before in this kernel.
    ex = kernel.run("%%elastic --nproc 2 --no-warm --timeout 0.2\nprint('never')\n")
    assert ex.ename == "JobTimeout"
    assert "rank 0: had not started" in ex.traceback and "never" not in ex.stdout
    assert_job_gone(ex.job_id)


@pytest.mark.alone
def test_interrupt_stops_every_rank(fresh_kernel: Kernel, cache_home: Path) -> None:
    k = fresh_kernel
    msg_id, ex = k.start(
        "%%elastic --nproc 2\nimport time\nprint('sleeping', flush=True)\ntime.sleep(300)\n"
    )
    k.collect(msg_id, ex, timeout=60, until=lambda e: e.stdout.count("sleeping") == 2)
    t0 = time.monotonic()
    k.interrupt()
    k.collect(msg_id, ex, timeout=30)
    # The supervisor stopped it, well before the kernel's own fallback (STOP_TIMEOUT_S, 4 s)
    # would have: the outcome is its record, not the kernel's.
    assert time.monotonic() - t0 < 3
    assert ex.ename == "KeyboardInterrupt"
    assert "interrupted" in ex.stdout
    s = run_summary(cache_home, ex.job_id)
    assert (s["outcome"], s["reason"], s["cause"]) == (
        "interrupted",
        "interrupted from the kernel",
        "interrupted",
    )
    assert_job_gone(ex.job_id)
    assert k.ok("%%elastic --nproc 1\n'next'\n").result == "'next'"


@pytest.mark.alone
def test_interrupt_when_the_supervisor_does_not_answer(fresh_kernel: Kernel) -> None:
    """The kernel's fallback: a frozen supervisor cannot hold the notebook. After STOP_TIMEOUT_S
    the kernel kills the job's processes itself."""
    k = fresh_kernel
    msg_id, ex = k.start(
        "%%elastic --nproc 2\nimport time\nprint('sleeping', flush=True)\ntime.sleep(300)\n"
    )
    k.collect(msg_id, ex, timeout=60, until=lambda e: e.stdout.count("sleeping") == 2)
    supervisor = k.supervisor()
    supervisor.suspend()
    try:
        t0 = time.monotonic()
        k.interrupt()
        k.collect(msg_id, ex, timeout=30)
        assert 4 <= time.monotonic() - t0 < 8
        assert ex.ename == "KeyboardInterrupt"
        assert f"job {ex.job_id} interrupted" in ex.stdout
        assert (
            f"[elastic_nb] job {ex.job_id}: the supervisor did not stop the job within 4 s; "
            "the kernel killed its processes" in ex.stderr
        )
        assert_job_gone(ex.job_id)
    finally:
        supervisor.resume()


@pytest.mark.alone
def test_interrupt_while_ranks_block_in_a_collective(fresh_kernel: Kernel) -> None:
    k = fresh_kernel
    msg_id, ex = k.start(
        "%%elastic --nproc 2\n"
        "import time, torch, torch.distributed as dist\n"
        "dist.init_process_group()\n"
        "print('in', flush=True)\n"
        "if dist.get_rank() == 0:\n"
        "    dist.all_reduce(torch.ones(1))  # rank 1 never joins\n"
        "time.sleep(300)\n"
    )
    k.collect(msg_id, ex, timeout=60, until=lambda e: e.stdout.count("] in") == 2)
    t0 = time.monotonic()
    k.interrupt()
    k.collect(msg_id, ex, timeout=30)
    assert time.monotonic() - t0 < 5  # docs/explanation/how-a-cell-runs.md: "returns within 5 s"
    assert ex.ename == "KeyboardInterrupt"
    assert_job_gone(ex.job_id)
    # The next cell just works: a new job, its collectives included.
    again = k.ok(
        "%%elastic --nproc 2\n"
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group()\n"
        "x = torch.ones(1)\n"
        "dist.all_reduce(x)\n"
        "x.item()\n"
    )
    assert again.result == "2.0"


def test_kernel_killed_mid_job(fresh_kernel: Kernel) -> None:
    k = fresh_kernel
    msg_id, ex = k.start(
        "%%elastic --nproc 2\nimport time\nprint('up', flush=True)\ntime.sleep(300)\n"
    )
    k.collect(msg_id, ex, timeout=60, until=lambda e: e.stdout.count("up") == 2)
    kill_and_see_the_job_end(k, ex.job_id)


def test_supervisor_killed_mid_job(fresh_kernel: Kernel) -> None:
    k = fresh_kernel
    msg_id, ex = k.start(
        "%%elastic --nproc 2\nimport time\nprint('up', flush=True)\ntime.sleep(300)\n"
    )
    k.collect(msg_id, ex, timeout=60, until=lambda e: e.stdout.count("up") == 2)
    k.supervisor().send_signal(signal.SIGKILL)
    k.collect(msg_id, ex, timeout=30)
    assert ex.ename == "SupervisorDied"
    assert "the job's processes were killed" in ex.error["evalue"]
    assert_job_gone(ex.job_id)
    # A new supervisor serves the next cell.
    assert k.ok("%%elastic --nproc 1\n'fine'\n").result == "'fine'"


def test_all_ranks_abort_at_once(kernel: Kernel) -> None:
    ex = kernel.run(
        "%%elastic --nproc 2\n"
        "import os, signal, torch, torch.distributed as dist\n"
        "dist.init_process_group()\n"
        "dist.barrier()\n"
        "os.kill(os.getpid(), signal.SIGABRT)  # what NCCL's watchdog does on a timeout\n"
    )
    assert ex.ename == "JobFailed"
    assert "killed by SIGABRT" in ex.error["evalue"]
    assert_job_gone(ex.job_id)


def test_launcher_killed_mid_job(kernel: Kernel) -> None:
    msg_id, ex = kernel.start(
        "%%elastic --nproc 2\nimport time\nprint('up', flush=True)\ntime.sleep(300)\n"
    )
    kernel.collect(msg_id, ex, timeout=60, until=lambda e: e.stdout.count("up") == 2)
    # The launcher leads the job's process group (its own session): that is what it is.
    launcher = [p for p in procs.job_processes([ex.job_id]) if os.getpgid(p.pid) == p.pid]
    assert len(launcher) == 1
    launcher[0].send_signal(signal.SIGKILL)
    kernel.collect(msg_id, ex, timeout=30)
    assert ex.ename == "JobFailed"
    assert "the launcher killed by SIGKILL" in ex.error["evalue"]
    assert_job_gone(ex.job_id)
