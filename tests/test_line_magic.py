"""%elastic status | jobs | logs | stop | config, and %%elastic? help."""

from __future__ import annotations

import re

import pytest

from elastic_nb.kernel.options import OPTIONS, shown_default
from tests.kernel import Kernel, ask_supervisor, assert_job_gone, supervisor_socket

pytestmark = pytest.mark.e2e


def test_help_lists_every_flag_with_its_default(kernel: Kernel) -> None:
    text = " ".join(kernel.run("%%elastic?").pager.split())  # unwrapped
    for o in OPTIONS:
        assert all(flag in text for flag in o.spellings if flag != "--warm"), o.flags
        shown = shown_default(o)
        if shown:
            assert f"(default: {shown})" in text, o.dest


def test_config_sets_session_defaults(kernel: Kernel) -> None:
    out = kernel.ok("%elastic config --nproc 2 --env MARK=from-config --no-widgets").stdout
    # Printed as the flags that give them, so that they can be pasted back.
    assert out.splitlines()[1:] == ["  --nproc 2", "  --env MARK=from-config", "  --no-widgets"]
    try:
        ex = kernel.ok(
            "%%elastic\nimport os\nprint(os.environ['WORLD_SIZE'], os.environ['MARK'])\n"
        )
        assert "[rank 1] 2 from-config" in ex.stdout
        ex = kernel.ok("%%elastic --nproc 1\nimport os\nprint(os.environ['WORLD_SIZE'])\n")
        assert "[rank 0] 1" in ex.stdout  # a flag on the cell wins
    finally:
        kernel.ok("%elastic config reset")
    assert "no session defaults" in kernel.ok("%elastic config").stdout


def test_status_jobs_and_logs(kernel: Kernel) -> None:
    ex = kernel.ok(
        "%%elastic --nproc 2\nimport os\nfor i in range(100):\n    print('line', i, 'of rank', os.environ['RANK'])\n"
    )
    job = ex.job_id
    status = kernel.ok("%elastic status").stdout
    assert re.search(r"supervisor: pid \d+", status) and "running jobs: none" in status
    jobs = kernel.ok("%elastic jobs")
    assert re.search(rf"{job}\s+succeeded\s+2\s+0/0", jobs.stdout)
    assert jobs.result is None  # printed, not also shown as a value ([])
    logs = kernel.ok(f"%elastic logs {job} --rank 1 --tail 3").stdout
    assert "rank 1 stdout, attempt 0" in logs and "(100 lines)" in logs
    assert logs.strip().endswith("[rank 1] line 99 of rank 1")
    assert "[rank 1] line 96 of rank 1" not in logs
    assert "rank 0" not in logs  # --rank 1: nothing of the other rank
    assert "line 99 of rank 0" in kernel.ok("%elastic logs").stdout  # the last job, every rank


def test_unknown_subcommand_and_job(kernel: Kernel) -> None:
    ex = kernel.run("%elastic restart")
    assert (
        ex.ename == "UsageError"
        and "status, jobs, logs, stop, stacks, config" in ex.error["evalue"]
    )
    ex = kernel.run("%elastic logs deadbeef")
    assert ex.ename == "UsageError" and "no job 'deadbeef'" in ex.error["evalue"]


def test_stop_from_another_client(kernel: Kernel) -> None:
    """What %elastic stop (or the lab extension) does while the cell blocks: the cell ends
    with JobStopped and every rank is gone."""
    socket_path = supervisor_socket(kernel)
    msg_id, ex = kernel.start(
        "%%elastic --nproc 2\nimport time\nprint('up', flush=True)\ntime.sleep(300)\n"
    )
    kernel.collect(msg_id, ex, timeout=60, until=lambda e: e.stdout.count("up") == 2)
    reply = ask_supervisor(
        socket_path, {"kind": "stop", "req": 1, "job": ex.job_id, "reason": "user"}
    )
    assert reply == {"kind": "reply", "req": 1, "ok": True, "data": {"stopping": [ex.job_id]}}
    kernel.collect(msg_id, ex, timeout=30)
    assert ex.ename == "JobStopped"
    assert "stopped with %elastic stop" in ex.error["evalue"]
    assert_job_gone(ex.job_id)
    # Closing that second connection did not take the supervisor down.
    assert kernel.ok("%%elastic --nproc 1\n'still here'\n").result == "'still here'"


def test_stop_with_nothing_running(kernel: Kernel) -> None:
    assert "no running jobs" in kernel.ok("%elastic stop").stdout
