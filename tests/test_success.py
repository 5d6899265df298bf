"""Cells that work: real kernel, real supervisor, real gloo ranks."""

from __future__ import annotations

import re
from pathlib import Path

import psutil
import pytest

from elastic_nb.common.rundir import RunDir
from tests.kernel import Kernel, assert_job_gone, dashboard_of

pytestmark = [pytest.mark.e2e, pytest.mark.core]

ALL_REDUCE = """%%elastic --nproc 4
import torch, torch.distributed as dist
dist.init_process_group()
x = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(x)
print(dist.get_rank(), x.item())
x.item()
"""


def test_four_ranks_all_reduce(kernel: Kernel) -> None:
    ex = kernel.ok(ALL_REDUCE)
    for rank in range(4):
        assert f"[rank {rank}] {rank} 10.0\n" in ex.stdout
    assert ex.result == "10.0"
    summary = [line for line in ex.stdout.splitlines() if "succeeded" in line]
    assert len(summary) == 1 and "4 ranks" in summary[0] and "restarts 0/0" in summary[0]
    assert_job_gone(ex.job_id)
    assert kernel.ok("_ + 1").result == "11.0"  # the result is the cell's value, like any cell's


def test_run_directory_keeps_everything(kernel: Kernel) -> None:
    ex = kernel.ok(
        '%%elastic --nproc 2\nimport os, sys\nprint("hello from", os.environ["RANK"])\nprint("to stderr", file=sys.stderr)\n'
    )
    rd = RunDir(ex.run_dir)
    assert rd.spec.exists() and rd.cell.read_text().startswith("# %%elastic --nproc 2\n")
    assert rd.log(0, 1, "out").read_text() == "hello from 1\n"
    assert rd.log(0, 0, "err").read_text() == "to stderr\n"
    assert rd.done(0, 0).exists() and rd.done(0, 1).exists()
    assert '"outcome": "succeeded"' in rd.summary.read_text()
    assert "[rank 0] to stderr" in ex.stderr
    # No process group, no collective to time out: the dashboard says nothing of one.
    assert not rd.process_group(0, 0).exists()
    dash, events = dashboard_of(kernel, ex.job_id, {"nproc": 2})
    assert not dash.header["collectives"] and not any(e.get("groups") for e in events)


def test_output_is_captured_at_the_fd_level_and_progress_bars_collapse(kernel: Kernel) -> None:
    ex = kernel.ok(
        "%%elastic --nproc 1\n"
        "import os, sys\n"
        "os.write(1, b'written to fd 1 directly\\n')\n"
        "sys.stdout.write('  0%|\\r 50%|#####\\r100%|##########\\n')\n"
    )
    assert "[rank 0] written to fd 1 directly\n" in ex.stdout
    assert "[rank 0] 100%|##########\n" in ex.stdout and "50%" not in ex.stdout


def test_collective_timeout_is_the_default_of_every_process_group(kernel: Kernel) -> None:
    ex = kernel.ok(
        "%%elastic --nproc 2 --collective-timeout 7\n"
        "import torch, torch.distributed as dist\n"
        "from torch.distributed import distributed_c10d as c10d\n"
        "dist.init_process_group('gloo')\n"
        "backend = c10d._get_default_group()._get_backend(torch.device('cpu'))\n"
        "print('timeout', backend.options._timeout.total_seconds())\n"
    )
    assert "[rank 0] timeout 7.0" in ex.stdout and "[rank 1] timeout 7.0" in ex.stdout
    # The ranks made a process group: the dashboard says what a stuck collective will do.
    assert (
        RunDir(ex.run_dir).process_group(0, 0).exists()
        and RunDir(ex.run_dir).process_group(0, 1).exists()
    )
    dash, _ = dashboard_of(kernel, ex.job_id, {"nproc": 2, "collective_timeout": "7"})
    assert dash.header["collectives"] and dash.header["worst_case_s"] is not None


def test_a_collective_timeout_fails_the_waiting_rank(kernel: Kernel) -> None:
    ex = kernel.run(
        "%%elastic --nproc 2 --collective-timeout 3\n"
        "import time, torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "if dist.get_rank() == 1:\n"
        "    time.sleep(60)  # never joins the all_reduce\n"
        "dist.all_reduce(torch.ones(1))\n",
        timeout=60,
    )
    assert ex.ename == "JobFailed"
    # The rank that timed out is the victim: the verdict names the one that never came.
    assert ex.error["evalue"] == (
        "desync: rank 1 never entered all_reduce #1 (cell line 6): it was at cell line 5; "
        "rank 0 waited in it"
    )
    assert "rank 0: timed out waiting: RuntimeError: " in ex.traceback
    assert "Timed out waiting 3000ms" in ex.traceback
    assert_job_gone(ex.job_id)


@pytest.mark.parametrize(
    "how",
    [", start_new_session=True", ", start_new_session=True, env={}", ", env={}"],
    ids=["own session", "own session, no environment", "no environment, in the group"],
)
@pytest.mark.parametrize("outcome", ["succeeded", "failed"])
def test_processes_the_cell_leaves_behind_are_stopped(
    kernel: Kernel, how: str, outcome: str
) -> None:
    # In a session of its own; and with an empty environment too, where neither the process
    # group nor the job's marker finds it (the supervisor, a subreaper, inherits it when its rank
    # dies); and with an empty environment inside the launcher's group, among its helpers.
    ex = kernel.run(
        "%%elastic --nproc 1\n"
        "import subprocess\n"
        f"p = subprocess.Popen(['sleep', '300']{how})\n"
        "print('daemon', p.pid, flush=True)\n"
        + ("raise RuntimeError('after starting a daemon')\n" if outcome == "failed" else "")
    )
    assert (ex.ename == "JobFailed") == (outcome == "failed")
    daemon = int(re.search(r"daemon (\d+)", ex.stdout)[1])  # type: ignore[index]
    if outcome == "succeeded" and "start_new_session" in how:
        assert f"stopped 1 process(es) the cell left running: {daemon} (sleep 300)" in ex.stdout
    assert not psutil.pid_exists(daemon) or psutil.Process(daemon).status() == "zombie"
    assert_job_gone(ex.job_id)


def test_push_and_pull_round_trip(kernel: Kernel) -> None:
    kernel.ok("weights = {'scale': 3.0, 'name': 'pushed'}")
    ex = kernel.ok(
        "%%elastic --nproc 2 --push weights --pull out,rank_seen --pull-rank 1\n"
        "import os\n"
        "rank_seen = int(os.environ['RANK'])\n"
        "out = {'value': weights['scale'] * 2, 'name': weights['name']}\n"
    )
    check = kernel.ok("(out, rank_seen)")
    assert check.result == "({'value': 6.0, 'name': 'pushed'}, 1)"
    assert_job_gone(ex.job_id)


def test_notebook_function_and_class_ship_by_value(kernel: Kernel) -> None:
    kernel.ok(
        "import math as m\n"
        "def double(v):\n"
        "    return 2 * v\n"
        "class Box:\n"
        "    def __init__(self, v):\n"
        "        self.v = v\n"
    )
    ex = kernel.ok(
        "%%elastic --nproc 2\nimport os\nb = Box(double(int(os.environ['RANK']) + 1))\nprint('box', b.v, m.sqrt(16))\nb.v\n"
    )
    assert "[rank 0] box 2 4.0" in ex.stdout
    assert "[rank 1] box 4 4.0" in ex.stdout
    assert ex.result == "2"


def test_notebook_data_needs_push_and_says_so(kernel: Kernel) -> None:
    kernel.ok("lr = 0.1")
    ex = kernel.run("%%elastic --nproc 2\nprint(lr)\n")
    assert ex.ename == "JobFailed"
    assert "NameError" in ex.error["evalue"]
    assert "--push lr" in ex.traceback


def test_trailing_semicolon_hides_the_result(kernel: Kernel) -> None:
    ex = kernel.ok("%%elastic --nproc 1\n40 + 2;\n")
    assert ex.result is None
    assert kernel.ok("%%elastic --nproc 1\n40 + 2\n").result == "42"


def test_log_flood_every_line_on_disk(kernel: Kernel, tmp_path: Path) -> None:
    ex = kernel.ok(
        f"%%elastic --nproc 4 --log-dir {tmp_path}\n"
        "import os\n"
        "r = os.environ['RANK']\n"
        "for i in range(50_000):\n"
        "    print(f'rank {r} line {i}')\n",
        timeout=180,
    )
    rd = RunDir(tmp_path / ex.job_id)
    for rank in range(4):
        lines = rd.log(0, rank, "out").read_text().splitlines()
        assert lines == [f"rank {rank} line {i}" for i in range(50_000)]
    # The notebook got a bounded view with the way to the rest, not 200,000 lines: at most 200
    # lines per rank per update, at most 10 updates a second (docs/explanation/how-a-cell-runs.md, "The run directory").
    updates = 10 * ex.seconds + 2
    for rank in range(4):
        shown = ex.stdout.count(f"[rank {rank}] rank {rank} line ")
        assert shown <= 200 * updates, (rank, shown, ex.seconds)
    assert "lines not shown (full log: " in ex.stdout
    assert "[rank 3] rank 3 line 49999" in ex.stdout
    assert_job_gone(ex.job_id)


def test_a_large_push_is_not_cut_short_by_the_request_timeout(fresh_kernel: Kernel) -> None:
    # SUBMIT's reply comes once the payload is on disk: with a 10 ms budget for the reply itself,
    # 200 MB can only arrive if the write's own time is allowed for.
    fresh_kernel.ok(
        "import elastic_nb.kernel.client as c\nc.REQUEST_TIMEOUT_S = 0.01\nbig = bytes(200_000_000)\n"
    )
    ex = fresh_kernel.ok("%%elastic --nproc 1 --push big\nprint(len(big))\n")
    assert "[rank 0] 200000000" in ex.stdout
    assert_job_gone(ex.job_id)
