"""What the docs promise, each end to end in a real kernel: flags no other test runs, cause
classes, the exception's fields, several jobs at once, the handle's logs and stacks."""

from __future__ import annotations

import os
import re
import stat
from pathlib import Path

import pytest

from elastic_nb.common.registry import runtime_dir
from tests.kernel import Kernel, assert_job_gone, free_port, pid_ended, run_summary, wait_for

pytestmark = pytest.mark.e2e


@pytest.mark.alone
def test_ranks_that_ignore_sigterm_are_killed_after_the_grace(
    kernel: Kernel, cache_home: Path
) -> None:
    ex = kernel.run(
        "%%elastic --nproc 2 --timeout 1\n"
        "import signal, time\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "print('deaf', flush=True)\n"
        "time.sleep(300)\n"
    )
    assert ex.ename == "JobTimeout"
    s = run_summary(cache_home, ex.job_id)
    # The deadline (1 s from the job's creation), the 2 s grace nobody used, SIGKILL and the
    # teardown: a bounded end, not a hang (counted from the job's creation, so that a kernel slow
    # to start its supervisor on a loaded machine is not counted).
    assert s["wall_s"] < 1 + 2 + 4, s["wall_s"]
    assert (s["outcome"], s["cause"]) == ("timeout", "deadline")
    assert_job_gone(ex.job_id)


def test_the_exception_carries_rank_cause_and_run_dir(kernel: Kernel) -> None:
    ex = kernel.run(
        "%%elastic --nproc 2\nimport os, sys\nif os.environ['RANK'] == '1':\n    sys.exit(3)\n"
    )
    assert ex.ename == "JobFailed"
    fields = kernel.ok(
        "import sys\ne = sys.last_value\nprint(e.rank, e.cause, e.job_id, e.run_dir)"
    ).stdout
    rank, cause, job, run_dir = fields.split()
    assert (rank, cause, job) == ("1", "exit", ex.job_id)
    assert Path(run_dir, "summary.json").exists()
    assert_job_gone(ex.job_id)


def _fields(kernel: Kernel) -> tuple[str, str]:
    rank, cause = kernel.ok("import sys\ne = sys.last_value\nprint(e.rank, e.cause)").stdout.split()
    return rank, cause


# Every rank inside: rank 1 waits for rank 0 and rank 0 for rank 1 (a deadlock, no rank out of
# step). Rank 1 receives on the default group (--collective-timeout 2), rank 0 on a group of its
# own with a long timeout, so rank 1 times out first, always. Its exit would close its sockets under
# rank 0 while the supervisor takes the stacks (rank 0 then fails on its dead peer, and if caught
# between its exception and its record it counts as "never entered": a false desync, reported as a
# bug); an atexit wait keeps rank 1, its record written, until the teardown. Rank 0 is live in
# recv when its stack is taken.
RECV_DEADLOCK = (
    "%%elastic --nproc 2 --collective-timeout 2\n"
    "import atexit, threading, torch, torch.distributed as dist\n"
    "from datetime import timedelta\n"
    "dist.init_process_group('gloo')\n"
    "patient = dist.new_group(timeout=timedelta(seconds=300))\n"
    "rank, t = dist.get_rank(), torch.zeros(1)\n"
    "if rank == 1:\n"
    "    atexit.register(threading.Event().wait)  # ends with the teardown\n"
    "dist.recv(t, src=1 - rank, group=patient if rank == 0 else None)\n"
)


def test_a_collective_timeout_with_every_rank_inside_is_no_desync(
    kernel: Kernel, cache_home: Path
) -> None:
    ex = kernel.run(RECV_DEADLOCK, timeout=180)
    assert ex.ename == "JobFailed"
    assert re.fullmatch(
        r"rank 1 failed first: RuntimeError: \[\S*unbound_buffer\.cc:\d+\] Timed out waiting "
        r"2000ms for recv operation to complete \(cell line 9\)",
        ex.error["evalue"],
    ), ex.error["evalue"]
    assert _fields(kernel) == ("1", "collective_timeout")
    tb = ex.traceback
    assert "cause: collective_timeout (a collective waited longer than --collective-timeout" in tb
    # The stacks were taken before the teardown: rank 0 still waiting, in the same call.
    assert "rank 0 · waiting in recv · cell line 9: dist.recv(" in tb, tb
    assert "rank 1 · raised in recv · cell line 9: dist.recv(" in tb, tb
    assert "rank 0: stopped by elastic_nb (SIGTERM) after rank 1 failed" in tb, tb
    assert "desync" not in tb and "never entered" not in tb
    s = run_summary(cache_home, ex.job_id)
    assert (s["outcome"], s["cause"]) == ("failed", "collective_timeout")
    assert (s["failure"]["rank"], s["failure"]["cause"]) == (1, "collective_timeout")
    assert s["diagnosis"]["text"].startswith("every rank was in recv"), s["diagnosis"]
    assert "(cell line 9): none was missing" in s["diagnosis"]["text"]
    assert [o["rank"] for o in s["others"]] == [0]
    assert s["others"][0]["kind"] == "terminated"
    # Ended by rank 1's 2 s timeout, not by rank 0's own 300 s one (a liveness bound).
    assert ex.seconds < 150
    assert_job_gone(ex.job_id)


# Rank 0's collective partner is no rank of the job: a helper process the cell starts itself
# (its own TCPStore and gloo group), which exits once the group is up. Rank 0 fails with gloo's
# "Connection closed by peer"; the one that died is no rank the supervisor could blame, and
# rank 1, busy elsewhere, fails on nothing of its own.
PEER_OUTSIDE_THE_JOB = (
    "%%elastic --nproc 2\n"
    "import os, subprocess, sys, threading, torch\n"
    "from datetime import timedelta\n"
    "from torch.distributed import ProcessGroupGloo, TCPStore\n"
    "if os.environ['RANK'] == '1':\n"
    "    threading.Event().wait()  # elsewhere until the job ends\n"
    "store = TCPStore('127.0.0.1', 0, 2, is_master=True, wait_for_workers=False)\n"
    "helper = (\n"
    "    'import os, sys; from datetime import timedelta\\n'\n"
    "    'from torch.distributed import ProcessGroupGloo, TCPStore\\n'\n"
    "    'store = TCPStore(\"127.0.0.1\", int(sys.argv[1]), 2, is_master=False)\\n'\n"
    "    'pg = ProcessGroupGloo(store, 1, 2, timedelta(seconds=300))\\n'\n"
    "    'store.wait([\"go\"])\\n'\n"
    "    'os._exit(0)\\n'\n"
    ")\n"
    "child = subprocess.Popen([sys.executable, '-c', helper, str(store.port)])\n"
    "print('helper', child.pid, flush=True)\n"
    "pg = ProcessGroupGloo(store, 0, 2, timedelta(seconds=300))\n"
    "store.set('go', '1')  # the helper leaves; the all-reduce needs it\n"
    "pg.allreduce([torch.ones(1)]).wait()\n"
)


def test_a_peer_outside_the_job_dies_under_a_rank(kernel: Kernel, cache_home: Path) -> None:
    ex = kernel.run(PEER_OUTSIDE_THE_JOB, timeout=180)
    assert ex.ename == "JobFailed"
    assert re.fullmatch(
        # gloo's words for the helper's exit: an orderly close, or a reset when the all-reduce's
        # data reached it unread.
        r"rank 0 failed first: RuntimeError: \[\S*pair\.cc:\d+\] (Connection closed by peer "
        r"\[127\.0\.0\.1\]:\d+|Read error \[127\.0\.0\.1\]:\d+: Connection reset by peer)\..* "
        r"\(cell line 20\)",
        ex.error["evalue"],
    ), ex.error["evalue"]
    assert _fields(kernel) == ("0", "peer")
    tb = ex.traceback
    assert "cause: peer (this rank saw its peer disappear; no rank reported a failure" in tb
    assert "pg.allreduce([torch.ones(1)]).wait()" in tb
    assert re.search(
        r"rank 1: stopped by (elastic_nb|the torchelastic agent) \(SIGTERM\) after rank 0 failed",
        tb,
    ), tb
    s = run_summary(cache_home, ex.job_id)
    assert (s["outcome"], s["cause"]) == ("failed", "peer")
    assert (s["failure"]["rank"], s["failure"]["cause"]) == (0, "peer")
    assert [(o["rank"], o["kind"] in ("terminated", "agent")) for o in s["others"]] == [(1, True)]
    assert_job_gone(ex.job_id)
    # The helper is no rank: checked by its own pid, not by the job's marker sweep.
    helper = int(re.search(r"\[rank 0\] helper (\d+)", ex.stdout)[1])
    assert wait_for(lambda: pid_ended(helper), 10), f"the helper {helper} outlived the job"


def test_static_rendezvous_with_its_id_and_conf(kernel: Kernel) -> None:
    port = free_port()
    ex = kernel.ok(
        f"%%elastic --nproc 2 --rdzv-backend static --rdzv-endpoint localhost:{port} "
        "--rdzv-id notebook-run-7 --rdzv-conf join_timeout=60\n"
        "import os, torch.distributed as dist\n"
        "dist.init_process_group()\n"
        "print(os.environ['TORCHELASTIC_RUN_ID'], dist.get_world_size())\n"
    )
    for rank in (0, 1):
        assert f"[rank {rank}] notebook-run-7 2" in ex.stdout
    assert_job_gone(ex.job_id)


@pytest.mark.parametrize("nproc", ["cpu", "auto"])
def test_nproc_cpu_and_auto(kernel: Kernel, nproc: str) -> None:
    # No GPU here: 'auto' is 'cpu', one rank per core.
    ex = kernel.ok(f"%%elastic --nproc {nproc}\nimport os\nprint(os.environ['WORLD_SIZE'])\n")
    cores = os.cpu_count()
    assert ex.stdout.count(f"] {cores}\n") == cores
    assert_job_gone(ex.job_id)


def test_hang_after_off_overrides_a_session_default(kernel: Kernel) -> None:
    kernel.ok("%elastic config --hang-after 0.5")
    try:
        silent = "import time\nprint('up', flush=True)\ntime.sleep(2.5)\n"
        on = kernel.ok(f"%%elastic --nproc 1\n{silent}")
        assert "(--hang-after)" in on.stdout + on.stderr  # the session default works...
        off = kernel.ok(f"%%elastic --nproc 1 --hang-after off\n{silent}")
        assert "(--hang-after)" not in off.stdout + off.stderr  # ...and the flag turns it off
    finally:
        kernel.ok("%elastic config reset")


def test_collective_timeout_off_keeps_torchs_default(kernel: Kernel) -> None:
    ex = kernel.ok(
        "%%elastic --nproc 2 --collective-timeout off\n"
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group('gloo')\n"
        "backend = dist.distributed_c10d._get_default_group()._get_backend(torch.device('cpu'))\n"
        "print('timeout', backend.options._timeout.total_seconds())\n"
    )
    assert "[rank 0] timeout 1800.0" in ex.stdout  # torch's 30 min for gloo
    assert_job_gone(ex.job_id)


def test_two_jobs_at_once_and_one_stop_for_both(kernel: Kernel) -> None:
    cell = "%%elastic --bg --nproc 1\nimport time\nprint('up', flush=True)\ntime.sleep(300)\n"
    jobs = []
    for name in ("a", "b"):
        jobs.append(kernel.ok(cell).result.split()[2])
        kernel.ok(f"{name} = _")
    assert wait_for(lambda: kernel.ok("a.state, b.state").result == "('running', 'running')", 60)
    stopping = kernel.ok("%elastic stop").stdout
    assert all(j in stopping for j in jobs)
    for name, job in zip("ab", jobs, strict=True):
        assert kernel.run(f"{name}.wait(timeout=30)").ename == "JobStopped"
        assert_job_gone(job)


def test_logs_and_stacks_of_an_earlier_attempt_and_of_a_live_job(kernel: Kernel) -> None:
    ex = kernel.ok(
        "%%elastic --bg --nproc 2 --max-restarts 1\n"
        "import os, sys, time\n"
        "attempt = os.environ['TORCHELASTIC_RESTART_COUNT']\n"
        "print('attempt', attempt, flush=True)\n"
        "if attempt == '0' and os.environ['RANK'] == '1':\n"
        "    print('first try fails', file=sys.stderr, flush=True)\n"
        "    sys.exit(1)\n"
        "while True:\n"
        "    time.sleep(0.1)\n"
    )
    job = ex.result.split()[2]
    kernel.ok("job = _")
    assert wait_for(lambda: "attempt 1" in kernel.ok("print(job.logs(rank=1))").stdout, 60)
    assert "first try fails" in kernel.ok("print(job.logs(rank=1, stream='err', attempt=0))").stdout
    assert "attempt 0" in kernel.ok(f"%elastic logs {job} --rank 0 --attempt 0").stdout
    assert "attempt 1" not in kernel.ok(f"%elastic logs {job} --rank 0 --attempt 0").stdout
    assert wait_for(lambda: "time.sleep(0.1)" in kernel.ok("print(job.stacks())").stdout, 30)
    stacks = kernel.ok("print(job.stacks())").stdout
    assert re.search(r"rank 0 · cell line 9: time\.sleep\(0\.1\)", stacks), stacks
    assert re.search(r"rank 1 · cell line 9: time\.sleep\(0\.1\)", stacks), stacks
    kernel.ok("job.stop()")
    assert kernel.run("job.wait(timeout=30)").ename == "JobStopped"
    assert_job_gone(job)


def test_the_socket_directory_is_the_users_alone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    loose = tmp_path / "elastic_nb"
    loose.mkdir(mode=0o755)
    loose.chmod(0o777)
    assert runtime_dir() == loose
    assert stat.S_IMODE(loose.stat().st_mode) == 0o700  # tightened
    loose.rmdir()
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    loose.symlink_to(elsewhere)
    with pytest.raises(RuntimeError, match="not a directory owned by this user"):
        runtime_dir()
