"""%%elastic --bg: the cell returns a handle at once; the job runs on."""

from __future__ import annotations

import pytest

from tests.kernel import Kernel, assert_job_gone, wait_for

pytestmark = pytest.mark.e2e

SUM = """%%elastic --bg --nproc 2 --pull total
import torch, torch.distributed as dist
dist.init_process_group()
x = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(x)
total = x.item()
print("total", total)
total
"""


def test_a_background_job_returns_at_once_and_delivers_later(kernel: Kernel) -> None:
    ex = kernel.ok(SUM)
    assert ex.result is not None and ex.result.startswith("<elastic_nb job ")
    assert ex.seconds < 10
    job = ex.result.split()[2]
    kernel.ok("job = _")
    # The notebook is free while the ranks run.
    assert kernel.ok("6 * 7").result == "42"
    assert kernel.ok("job.wait(timeout=120)").result == "3.0"
    assert kernel.ok("total").result == "3.0"  # --pull landed with wait()
    assert kernel.ok("job.state, job.result").result == "('succeeded', 3.0)"
    assert "total 3.0" in kernel.ok("print(job.logs(rank=1))").stdout
    assert kernel.ok("await job").result == "3.0"
    assert_job_gone(job)


def test_stacks_and_stop_for_a_background_job(kernel: Kernel) -> None:
    ex = kernel.ok(
        "%%elastic --bg --nproc 2\nimport time\nprint('up', flush=True)\nwhile True:\n    time.sleep(0.2)\n"
    )
    job = ex.result.split()[2]
    kernel.ok("job = _")
    assert wait_for(
        lambda: kernel.ok("print(job.logs(rank=0) + job.logs(rank=1))").stdout.count("up") == 2,
        timeout=60,
    )
    stacks = kernel.ok("%elastic stacks").stdout
    assert "rank 0 · cell line 5: time.sleep(0.2)" in stacks
    assert "rank 1 · cell line 5: time.sleep(0.2)" in stacks
    kernel.ok(f"%elastic stop {job}")
    ex = kernel.run("job.wait(timeout=30)")
    assert ex.ename == "JobStopped"
    assert kernel.ok("job.state").result == "'stopped'"
    assert_job_gone(job)


def test_job_stop_from_the_handle(kernel: Kernel) -> None:
    ex = kernel.ok("%%elastic --bg --nproc 2\nimport time\ntime.sleep(300)\n")
    job = ex.result.split()[2]
    kernel.ok("job = _")
    kernel.ok("job.stop()")
    assert kernel.run("job.wait(timeout=30)").ename == "JobStopped"
    assert_job_gone(job)


def test_a_background_failure_is_raised_by_wait_and_told_under_its_cell(kernel: Kernel) -> None:
    msg_id, ex = kernel.start(
        "%%elastic --bg --nproc 2\n"
        "import torch, torch.distributed as dist\n"
        "dist.init_process_group()\n"
        "if dist.get_rank() == 1:\n"
        "    raise KeyError('no such shard')\n"
        "dist.all_reduce(torch.ones(1))\n"
    )
    kernel.collect(msg_id, ex)
    assert ex.error is None and ex.result.startswith("<elastic_nb job ")
    job = ex.result.split()[2]
    kernel.ok("job = _")
    err = kernel.run("job.wait(timeout=120)")
    assert err.ename == "JobFailed"
    assert err.error["evalue"] == "rank 1 failed first: KeyError: 'no such shard' (cell line 5)"
    assert kernel.ok("job.state").result == "'failed'"
    assert kernel.run("job.result").ename == "JobFailed"  # asked again, the same answer
    # The end is printed under the cell that started the job, not under the one running then.
    assert wait_for(lambda: f"job {job} failed" in kernel.late_stdout(msg_id), timeout=10)
    assert f"job {job} failed" not in err.stdout
    assert_job_gone(job)


# In the kernel: whether a thread is inside JobHandle.wait (its stack says), and two threads that
# act once the cell's thread is: one says so, one takes a SIGINT itself.
IN_JOB_WAIT = (
    "import signal, sys, threading, time\n"
    "def _in_job_wait(ident):\n"
    "    f = sys._current_frames().get(ident)\n"
    "    while f is not None:\n"
    "        if f.f_code.co_name == 'wait' and f.f_code.co_filename.endswith('job_handle.py'):\n"
    "            return True\n"
    "        f = f.f_back\n"
    "    return False\n"
    "def _say_when_waiting(waiter):\n"
    "    while not _in_job_wait(waiter):\n"
    "        time.sleep(0.01)\n"
    "    print('waiting', flush=True)\n"
    "def _poke(waiter):\n"
    "    while not _in_job_wait(waiter):\n"
    "        time.sleep(0.01)\n"
    "    signal.pthread_kill(threading.get_ident(), signal.SIGINT)  # to this thread\n"
)


def test_an_interrupted_wait_leaves_the_job_running(fresh_kernel: Kernel) -> None:
    k = fresh_kernel
    ex = k.ok("%%elastic --bg --nproc 1\nimport time\ntime.sleep(600)\n")
    job = ex.result.split()[2]
    k.ok("job = _")
    k.ok(IN_JOB_WAIT)
    # A thread of the kernel says "waiting" once the cell's thread is inside job.wait() (seen
    # in its stack), and only then is the kernel interrupted.
    msg_id, waiting = k.start(
        "threading.Thread(target=_say_when_waiting, args=(threading.get_ident(),), "
        "daemon=True).start()\n"
        "job.wait()"
    )
    k.collect(msg_id, waiting, until=lambda e: "waiting" in e.stdout)
    k.interrupt()
    k.collect(msg_id, waiting, timeout=30)
    assert waiting.ename == "KeyboardInterrupt"
    # Waiting stopped, not the job: it goes on to run.
    assert wait_for(lambda: k.ok("job.state").result == "'running'", 60)
    k.ok("job.stop()")
    assert k.run("job.wait(timeout=30)").ename == "JobStopped"
    assert "stopped with job.stop()" in k.ok("print(job.summary['reason'])").stdout
    assert_job_gone(job)


def test_an_interrupt_another_thread_of_the_kernel_took_still_ends_the_wait(
    fresh_kernel: Kernel,
) -> None:
    """A process-wide SIGINT may be taken by any thread of the kernel; Python then only flags
    it for the main thread, which a wait must wake up to see (a thread takes one here, once the
    cell's thread waits in job.wait())."""
    k = fresh_kernel
    job = k.ok("%%elastic --bg --nproc 1\nimport time\ntime.sleep(600)\n").result.split()[2]
    k.ok("job = _")
    k.ok(IN_JOB_WAIT)
    ex = k.run(
        "threading.Thread(target=_poke, args=(threading.get_ident(),), daemon=True).start()\n"
        "job.wait()",
        timeout=30,
    )
    assert ex.ename == "KeyboardInterrupt"
    # Waiting stopped, not the job.
    assert wait_for(lambda: k.ok("job.state").result == "'running'", 60)
    k.ok("job.stop()")
    assert k.run("job.wait(timeout=30)").ename == "JobStopped"
    assert_job_gone(job)


def test_the_handle_says_the_jobs_state_as_it_goes(fresh_kernel: Kernel) -> None:
    k = fresh_kernel
    k.ok(
        "%%elastic --bg --nproc 2 --no-warm\nimport time\nprint('up', flush=True)\ntime.sleep(300)\n"
    )
    k.ok("job = _")
    # Its launcher is still importing torch: no rank runs yet, and the handle does not pretend.
    assert k.ok("job.state").result in ("'starting'", "'rendezvous'")
    assert wait_for(lambda: k.ok("job.state").result == "'running'", 60)
    assert "running" in k.ok("job").result
    k.ok("job.stop()")
    assert k.run("job.wait(timeout=30)").ename == "JobStopped"
    assert k.ok("job.state").result == "'stopped'"
