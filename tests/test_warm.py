"""Warm start: ranks fork from a server that imported torch before the cell was run.

Each test reads back from the ranks (or from the supervisor) what it asserts, and ends with no
process of its jobs alive.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from pathlib import Path
from typing import Any

import psutil
import pytest

from tests.kernel import Kernel, assert_job_gone, pid_ended, run_events, wait_for

pytestmark = pytest.mark.e2e

READBACK = """%%elastic --nproc 2
import os, sys, json, psutil
import elastic_nb.launcher.warmup as w
from elastic_nb.common import procs
server = psutil.Process(w.PID).create_time() if w.PID != os.getpid() else None
print('readback', json.dumps({
    'forked': w.PID != os.getpid(), 'server_started': server, 'imported': w.IMPORTED,
    'marker': procs._marker_of(os.getpid()), 'slot': os.environ.get('ELASTIC_NB_SLOT'),
}))
"""


def readback(ex: Any) -> list[dict[str, Any]]:
    return [json.loads(x) for x in re.findall(r"\] readback (\{.*\})", ex.stdout)]


def launcher_of(cache_home: Path, job: str) -> dict[str, Any]:
    (event,) = [e for e in run_events(cache_home, job) if e["event"] == "launcher"]
    return event


def warm_status(k: Kernel) -> dict[str, str] | None:
    """The warm launcher as %elastic status reports it: pid and state, or None."""
    out = k.ok("%elastic status").stdout
    m = re.search(r"warm launcher: pid (\d+), (ready|warming up)", out)
    return {"pid": m.group(1), "state": m.group(2)} if m else None


def warm_zygote(k: Kernel) -> int:
    m = re.search(r"the zygote \(pid (\d+)", k.ok("%elastic status").stdout)
    assert m, "no zygote"
    return int(m.group(1))


def wait_warm(k: Kernel, timeout: float = 60) -> str:
    assert wait_for(lambda: (warm_status(k) or {}).get("state") == "ready", timeout, 0.5)
    status = warm_status(k)
    assert status is not None
    return status["pid"]


def test_the_first_cell_after_load_ext_forks_its_ranks_from_a_server_started_before_it(
    fresh_kernel: Kernel, cache_home: Path
) -> None:
    # %load_ext started the supervisor, its zygote imported torch and forked a launcher: a first
    # cell run a few seconds later (a person writing it) is as warm as any later one.
    k = fresh_kernel
    warm_pid = wait_warm(k)
    before = time.time()
    ex = k.ok(READBACK)
    launcher = launcher_of(cache_home, ex.job_id)
    assert launcher["warm"] and str(launcher["pid"]) == warm_pid
    ranks = readback(ex)
    assert len(ranks) == 2
    for r in ranks:
        # Forked from a server that had imported torch before this cell was submitted: the
        # rank imported neither torch nor the bootstrap itself.
        assert r["forked"] and r["server_started"] < before
        assert {"torch", "torch.distributed", "elastic_nb.rank.bootstrap"} <= set(r["imported"])
        # And it is a process of this job, for every sweep that looks for one.
        assert r["marker"] == ex.job_id and r["slot"] is None
    assert_job_gone(ex.job_id)


def test_cells_sent_back_to_back_are_warm_too(fresh_kernel: Kernel, cache_home: Path) -> None:
    # Run All: each cell is sent the moment the previous one returns. The next launcher is
    # forked from the zygote while the previous cell's ranks run, so no cell waits for torch.
    k = fresh_kernel
    wait_warm(k)
    zygote = warm_zygote(k)
    jobs = []
    for _ in range(4):
        before = time.time()
        ex = k.ok(READBACK)
        ranks = readback(ex)
        assert len(ranks) == 2 and all(r["forked"] and r["server_started"] < before for r in ranks)
        jobs.append(ex.job_id)
    assert warm_zygote(k) == zygote  # torch was imported once, by the zygote, for all of them
    for job in jobs:
        assert_job_gone(job)


def test_nothing_of_one_job_reaches_the_next(fresh_kernel: Kernel, tmp_path: Path) -> None:
    k = fresh_kernel
    k.ok(
        "%%elastic --nproc 1\n"
        "import os, sys, wave\n"
        "os.environ['LEFT_BY_JOB_1'] = '1'\n"
        "os.chdir('/')\n"
        "sys.argv.append('--left-by-job-1')\n"
    )
    wait_warm(k)
    k.ok("import os; os.environ['SET_IN_THE_KERNEL'] = 'between the cells'")
    ex = k.ok(
        "%%elastic --nproc 1\n"
        "import os, sys\n"
        "print('env', os.environ.get('LEFT_BY_JOB_1'), os.environ.get('SET_IN_THE_KERNEL'))\n"
        "print('cwd', os.getcwd())\n"
        "print('argv', sys.argv[1:])\n"
        "print('wave', 'wave' in sys.modules)\n"
    )
    assert "[rank 0] env None between the cells" in ex.stdout
    assert f"[rank 0] cwd {tmp_path}" in ex.stdout
    assert "[rank 0] argv []" in ex.stdout
    assert "[rank 0] wave False" in ex.stdout
    assert_job_gone(ex.job_id)


def test_a_warm_launcher_that_dies_while_idle_is_replaced(
    fresh_kernel: Kernel, cache_home: Path
) -> None:
    k = fresh_kernel
    k.ok("%%elastic --nproc 1\nprint('one')\n")
    dead = int(wait_warm(k))
    os.kill(dead, signal.SIGKILL)
    assert wait_for(lambda: (warm_status(k) or {}).get("pid") not in (None, str(dead)), 30, 0.5)
    replacement = wait_warm(k)
    ex = k.ok("%%elastic --nproc 1\nprint('two')\n")
    assert "[rank 0] two" in ex.stdout
    launcher = launcher_of(cache_home, ex.job_id)
    assert launcher["warm"] and str(launcher["pid"]) == replacement
    assert_job_gone(ex.job_id)


def test_a_zygote_that_died_is_replaced_by_the_next_cell(fresh_kernel: Kernel) -> None:
    k = fresh_kernel
    wait_warm(k)
    os.kill(warm_zygote(k), signal.SIGKILL)
    ex = k.ok(READBACK)
    assert [r["forked"] for r in readback(ex)] == [True, True]
    wait_warm(k)
    assert not pid_ended(warm_zygote(k))
    assert_job_gone(ex.job_id)


def test_the_warm_processes_die_with_the_kernel(fresh_kernel: Kernel) -> None:
    k = fresh_kernel
    k.ok("%%elastic --nproc 1\nprint('one')\n")
    warm = psutil.Process(int(wait_warm(k)))
    tree = [warm, *warm.children(recursive=True)]  # the launcher and its fork server
    assert len(tree) >= 2
    tree.append(psutil.Process(warm_zygote(k)))
    k.kill()
    assert wait_for(lambda: all(not p.is_running() or pid_ended(p.pid) for p in tree), timeout=10)


def test_no_warm_keeps_none(fresh_kernel: Kernel, cache_home: Path) -> None:
    k = fresh_kernel
    k.ok("%%elastic --nproc 1\nprint('one')\n")
    wait_warm(k)
    cold = k.ok("%%elastic --nproc 1 --no-warm\nprint('from scratch')\n")  # one cell
    assert not launcher_of(cache_home, cold.job_id)["warm"]
    assert warm_status(k) is None
    k.ok("%%elastic --nproc 1\nprint('warm again after this one')\n")
    warm = psutil.Process(int(wait_warm(k)))
    k.ok("%elastic config --no-warm")  # the session
    assert warm_status(k) is None  # ended at once, its memory freed
    assert pid_ended(warm.pid)
    ex = k.ok("%%elastic --nproc 1\nprint('two')\n")
    assert not launcher_of(cache_home, ex.job_id)["warm"]
    assert warm_status(k) is None
    assert_job_gone(ex.job_id)


def test_preload_joins_the_warm_set(fresh_kernel: Kernel) -> None:
    k = fresh_kernel
    bad = k.run("%%elastic --nproc 1 --preload no_such_module_here\nprint('never')\n")
    assert bad.ename == "UsageError" and "--preload no_such_module_here" in bad.error["evalue"]
    k.ok("%elastic config --preload wave")
    k.ok("%%elastic --nproc 1\nprint('cold')\n")
    wait_warm(k)
    assert "preloaded: wave" in k.ok("%elastic status").stdout
    ex = k.ok(READBACK)
    for r in readback(ex):
        assert r["forked"] and "wave" in r["imported"]
    assert_job_gone(ex.job_id)


def test_a_restart_forks_from_the_same_server(kernel: Kernel) -> None:
    ex = kernel.ok(
        "%%elastic --nproc 2 --max-restarts 1\n"
        "import os\n"
        "import elastic_nb.launcher.warmup as w\n"
        "attempt = int(os.environ['TORCHELASTIC_RESTART_COUNT'])\n"
        "print('server', attempt, w.PID)\n"
        "if attempt == 0 and os.environ['RANK'] == '1':\n"
        "    raise RuntimeError('only the first time')\n"
    )
    servers = {a: set() for a in ("0", "1")}
    for attempt, pid in re.findall(r"\] server (\d) (\d+)", ex.stdout):
        servers[attempt].add(pid)
    assert servers["0"] and len(servers["1"]) == 1 and servers["0"] <= servers["1"], servers
    assert_job_gone(ex.job_id)


def test_atexit_handlers_of_the_cell_run_in_forked_ranks(kernel: Kernel, tmp_path: Path) -> None:
    # A forked rank leaves through os._exit; a spawned one through interpreter exit: the cell's
    # atexit handlers (a logger's flush, wandb.finish) run in both.
    ex = kernel.ok(
        "%%elastic --nproc 2\n"
        "import atexit, os\n"
        f"atexit.register(lambda: open(os.path.join({str(tmp_path)!r}, 'bye-' + os.environ['RANK']), 'w').close())\n"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bye-0", "bye-1"]
    assert_job_gone(ex.job_id)


def test_forked_ranks_start_like_spawned_ones(kernel: Kernel) -> None:
    # Read at interpreter start or torch import, in the fork server, before the job existed:
    # PYTHONUNBUFFERED (a print without flush reaches the log at once) and OMP_NUM_THREADS.
    ex = kernel.ok(
        "%%elastic --bg --nproc 2 --env OMP_NUM_THREADS=3\n"
        "import time, torch\n"
        "print('threads', torch.get_num_threads())\n"
        "time.sleep(600)\n"
    )
    job = ex.result.split()[2]
    kernel.ok("job = _")
    for rank in (0, 1):
        assert wait_for(
            lambda rank=rank: "threads 3" in kernel.ok(f"print(job.logs(rank={rank}))").stdout,
            timeout=60,
        )
    kernel.ok("job.stop()")
    assert kernel.run("job.wait(timeout=30)").ename == "JobStopped"
    assert_job_gone(job)


def test_a_preload_that_initialises_cuda_is_refused_with_the_way_out(
    fresh_kernel: Kernel, tmp_path: Path
) -> None:
    # Forked ranks cannot use CUDA once their fork server has initialised it. This torch has
    # no CUDA: a module that marks torch's CUDA state initialised at import stands in for one
    # that initialises it for real (what the fork server checks after each preload).
    (tmp_path / "cuda_at_import.py").write_text(
        "import torch.cuda\ntorch.cuda._initialized = True\n"
    )
    ex = fresh_kernel.run("%%elastic --nproc 2 --preload cuda_at_import\nprint('never')\n")
    assert ex.ename == "JobFailed", ex.traceback
    assert (
        "CUDA was initialised in the process this rank was forked from (by --preload "
        "cuda_at_import), so this rank cannot use CUDA: drop cuda_at_import from --preload, "
        "or run the cell with --start-method spawn" in ex.error["evalue"]
    )
    assert "never" not in ex.stdout
    assert_job_gone(ex.job_id)


def test_the_kernels_changes_reach_the_next_warm_rank_and_a_jobs_own_do_not(
    fresh_kernel: Kernel, tmp_path: Path, cache_home: Path
) -> None:
    """The leak paths a warm launcher has: it was started with the environment of an earlier
    cell, so what the kernel changed since, and what a job's own flags set, must be re-applied
    or dropped at the job's start."""
    k = fresh_kernel
    local, loader = tmp_path / "local", tmp_path / "loader"
    for d, module in ((local, "local_helpers"), (loader, "at_start_helpers")):
        d.mkdir()
        (d / f"{module}.py").write_text(f"WHERE = {str(d)!r}\n")
    k.ok("import os; os.environ['DELETED_LATER'] = 'still here'")
    k.ok("%%elastic --nproc 1 --env ONLY_FOR_JOB_1=1\nprint('one')\n")
    wait_warm(k)
    # Between the cells, the kernel moves, learns a module path and drops a variable.
    k.ok(
        f"import os, sys\nos.chdir({str(local)!r})\nsys.path.append({str(local)!r})\n"
        "del os.environ['DELETED_LATER']\n"
    )
    ex = k.ok(
        "%%elastic --nproc 1\n"
        "import os, local_helpers\n"
        "print('env', os.environ.get('ONLY_FOR_JOB_1'), os.environ.get('DELETED_LATER'))\n"
        "print('cwd', os.getcwd())\n"
        "print('module', local_helpers.WHERE)\n"
    )
    assert "[rank 0] env None None" in ex.stdout
    assert f"[rank 0] cwd {local}" in ex.stdout
    assert f"[rank 0] module {local}" in ex.stdout
    assert launcher_of(cache_home, ex.job_id)["warm"]  # all of it on the warm launcher
    # PYTHONPATH is read once, at interpreter start: the warm launcher cannot serve that job.
    wait_warm(k)
    k.ok(f"os.environ['PYTHONPATH'] = {str(loader)!r}")
    ex = k.ok("%%elastic --nproc 1\nimport at_start_helpers\nprint(at_start_helpers.WHERE)\n")
    assert f"[rank 0] {loader}" in ex.stdout
    assert not launcher_of(cache_home, ex.job_id)["warm"]
    assert_job_gone(ex.job_id)
