"""Failure forensics with real ranks: desync, silence, OOM, a stuck agent, aborts.

Each test asserts what the user sees (the cell's error, the alerts printed under it) and that no
process of the job survives.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from elastic_nb.client import SupervisorClient
from tests.kernel import Kernel, assert_job_gone, wait_for
from tests.test_supervisor import Recorder, submit

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


def _summary(job: str, cache: Path) -> dict:
    return json.loads((cache / "elastic_nb" / "runs" / job / "summary.json").read_text())


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
    s = _summary(ex.job_id, cache_home)
    assert s["cause"] == "desync" and s["failure"]["rank"] == 1
    stacks = Path(s["run_dir"], "attempt-0", "rank-1.stacks").read_text()
    assert "time.sleep" not in stacks and ", line 9 in <module>" in stacks
    assert_job_gone(ex.job_id)


def test_desync_against_a_rank_that_finished(kernel: Kernel, cache_home: Path) -> None:
    ex = kernel.run(DESYNC.replace("time.sleep(120)\n", ""))
    assert ex.ename == "JobFailed"
    assert ex.error["evalue"] == (
        "desync: rank 1 never entered all_reduce #2 (cell line 7): it had finished the cell "
        "after 1 collective; rank 0 waited in it"
    )
    assert _summary(ex.job_id, cache_home)["cause"] == "desync"
    assert_job_gone(ex.job_id)


def test_a_silent_rank_raises_a_hang_alert_and_the_job_keeps_running(
    fresh_kernel: Kernel,
) -> None:
    k = fresh_kernel
    msg_id, ex = k.start(
        "%%elastic --nproc 2 --hang-after 3 --collective-timeout off\n"
        "import time, torch, torch.distributed as dist\n"
        "dist.init_process_group()\n"
        "print('initialised', flush=True)   # imports on a loaded machine are not the silence\n"
        "if dist.get_rank() == 1:\n"
        "    time.sleep(600)\n"
        "dist.all_reduce(torch.ones(1))\n"
    )
    k.collect(msg_id, ex, timeout=60, until=lambda e: "full dump" in e.stdout)
    assert (
        "no output and no exit from any rank for 3 s (--hang-after): rank 1 never entered "
        "all_reduce (cell line 7): it was at cell line 6; rank 0 waited in it" in ex.stdout
    )
    assert "rank 0 · waiting in all_reduce · cell line 7" in ex.stdout
    assert "rank 1 · cell line 6: time.sleep(600)" in ex.stdout
    job = ex.job_id
    assert ex.error is None  # still running: an alert, not an end
    k.interrupt()
    k.collect(msg_id, ex, timeout=30)
    assert ex.ename == "KeyboardInterrupt"
    assert_job_gone(job)


def test_starting_ranks_are_not_a_hang(kernel: Kernel) -> None:
    # Spawning a rank and importing torch takes longer than this --hang-after: that is start-up,
    # with no stack of the cell to show yet, not silence.
    ex = kernel.ok("%%elastic --nproc 2 --hang-after 0.5\nprint('hello')\n")
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
        text = c.request("stacks", job=job.id)["text"]
        assert "rank 0 · cell line 5: time.sleep(0.1)" in text
        assert "rank 1 · cell line 5: time.sleep(0.1)" in text
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
    assert "[elastic_nb] rank 2 ran out of CUDA memory at cell line 4 (requested 2.50 GiB)" in (
        ex.stderr
    )
    assert _summary(ex.job_id, cache_home)["cause"] == "cuda_oom"
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
            assert "is still unreaped" in ex.stderr
        else:
            assert "every rank finished the cell and exited" in ex.stderr
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
        "    launcher = psutil.Process().parent()   # the fork server, whose parent...\n"
        "    while 'elastic_nb.launcher' not in launcher.cmdline():\n"
        "        launcher = launcher.parent()       # ...is the launcher\n"
        "    launcher.send_signal(signal.SIGSTOP)\n"
        "time.sleep(60)\n"
    )
    assert ex.ename == "JobFailed"
    assert "torchelastic's agent got stuck: its monitor loop has not run for" in ex.error["evalue"]
    assert "is stopped (SIGSTOP)" in ex.stderr
    assert ex.seconds < 30
    assert _summary(ex.job_id, cache_home)["cause"] == "zombie"
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
    assert _summary(ex.job_id, cache_home)["cause"] == "signal"
    assert (
        "Fatal Python error: Aborted"
        in Path(_summary(ex.job_id, cache_home)["run_dir"], "attempt-0", "rank-0.err").read_text()
    )  # faulthandler left the stack of the abort in the rank's log
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
    # The worst case is stated up front: (max_restarts + 1) * (collective + heartbeat).
    assert "a stuck collective fails the cell within 59 s" in ex.stdout
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
