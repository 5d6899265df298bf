"""Process ownership helpers that need no job: signalling through a pidfd, OOM-kill counts."""

from __future__ import annotations

import builtins
import os
import signal
import subprocess
import sys
from typing import Any

import pytest

from elastic_nb.common import procs
from tests.kernel import wait_for

pytestmark = pytest.mark.unit


def test_a_reaped_process_is_not_signalled_by_its_old_pid() -> None:
    sleep = [sys.executable, "-c", "import time; time.sleep(60)"]
    gone, newcomer = subprocess.Popen(sleep), subprocess.Popen(sleep)
    fd = procs.pidfd_open(gone.pid)
    assert fd is not None
    try:
        assert procs.send_signal(gone.pid, fd, 0)  # alive: signal 0 goes through
        gone.kill()
        gone.wait()  # reaped: its pid is free for anyone
        # The pid now names another process (here: the newcomer's, as if reused). Through the
        # pidfd the signal can only reach the process it was opened for, which is gone.
        assert not procs.send_signal(newcomer.pid, fd, signal.SIGTERM)
        assert newcomer.poll() is None
    finally:
        os.close(fd)
        newcomer.kill()
        newcomer.wait()


def test_without_a_pidfd_the_pid_is_used() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    assert procs.send_signal(child.pid, None, signal.SIGTERM)
    assert child.wait(timeout=10) == -signal.SIGTERM


def test_a_rank_that_cannot_write_its_marker_runs_on_with_a_warning(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from elastic_nb.rank import bootstrap

    def fail(job_id: str) -> None:
        raise RuntimeError("no ELASTIC_NB_SLOT in this process's environment")

    monkeypatch.setattr(procs, "mark_process", fail)
    bootstrap._mark("cafe0001")
    assert "could not write the job marker into this rank's environment" in capsys.readouterr().err


def test_oom_kills_come_from_our_cgroup_never_the_whole_machine(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    real_open = builtins.open

    def no_vmstat(name: Any, *args: Any, **kwargs: Any) -> Any:
        assert name != "/proc/vmstat", "an OOM kill elsewhere would relabel a rank's SIGKILL"
        return real_open(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_vmstat)
    first = procs.oom_kills()
    assert first is None or first >= 0

    def no_cgroup_files(name: Any, *args: Any, **kwargs: Any) -> Any:
        if str(name).startswith("/sys/fs/cgroup"):
            raise FileNotFoundError(name)
        return no_vmstat(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_cgroup_files)
    assert procs.oom_kills() is None  # unknown, not a guess


def test_killing_a_job_waits_until_none_of_it_is_left_even_what_forked_meanwhile() -> None:
    job = "f0rk5000"
    forker = (
        "import os, time\n"
        "for _ in range(3000):\n"
        "    if os.fork() == 0:\n"
        "        time.sleep(60)\n"
        "        os._exit(0)\n"
        "    time.sleep(0.002)\n"
    )
    env = dict(os.environ, **{procs.MARKER: job})
    parent = subprocess.Popen([sys.executable, "-c", forker], env=env)
    try:
        assert wait_for(lambda: len(procs.job_processes([job])) >= 5, 30)  # forking by now
        assert parent.poll() is None
        killed = procs.kill_job([job], signal.SIGKILL, wait_s=10)
        assert parent.pid in killed
        assert procs.job_processes([job]) == []  # at once: kill_job waited for every one
    finally:
        procs.kill_job([job], signal.SIGKILL)
        parent.wait()
