"""Process ownership helpers that need no job: signalling through a pidfd, OOM-kill counts."""

from __future__ import annotations

import builtins
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from elastic_nb.common import host_memory, procs
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
    first = host_memory.oom_kills()
    assert first is None or first >= 0

    def no_cgroup_files(name: Any, *args: Any, **kwargs: Any) -> Any:
        if str(name).startswith("/sys/fs/cgroup"):
            raise FileNotFoundError(name)
        return no_vmstat(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", no_cgroup_files)
    assert host_memory.oom_kills() is None  # unknown, not a guess


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


# ---- memory: /proc and the cgroup tree, on trees the test makes --------------------------------

MiB, GiB = 2**20, 2**30
_V1_UNLIMITED = "9223372036854771712"  # what v1 says for "no limit" (2**63 rounded to pages)


def _tree(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        path = root / name.lstrip("/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)


@pytest.fixture
def fake_roots(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> tuple[Path, Path]:
    """A /proc and a /sys/fs/cgroup of the test's own, for process 4242."""
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    proc.mkdir()
    cgroup.mkdir()
    monkeypatch.setattr(host_memory, "PROC", str(proc))
    monkeypatch.setattr(host_memory, "CGROUP", str(cgroup))
    _tree(proc, {"meminfo": "MemTotal: 8388608 kB\nMemFree: 1 kB\nMemAvailable: 6291456 kB\n"})
    return proc, cgroup


def test_rss_is_statms_resident_pages(fake_roots: tuple[Path, Path]) -> None:
    proc, _ = fake_roots
    _tree(proc, {"4242/statm": "90000 25600 300 10 0 20000 0\n"})
    assert host_memory.rss(4242) == 25600 * os.sysconf("SC_PAGE_SIZE")
    assert host_memory.rss(4343) is None  # gone
    _tree(proc, {"4444/statm": "0 0 0 0 0 0 0\n"})  # exiting: its memory released
    assert host_memory.rss(4444) is None


def test_a_process_that_has_exited_unreaped_has_no_rss() -> None:
    """A zombie (a rank that exited, not yet reaped by its fork server) reads all zeros in
    /proc/PID/statm: no sample, rather than a fall to 0 bytes at every rank's end (seen in
    test_memory's growing rank, its last sample 0 MiB)."""
    child = subprocess.Popen([sys.executable, "-c", "b = bytearray(50 * 2**20)"])
    try:
        assert wait_for(lambda: procs.zombie_exit_code(child.pid) is not None, 30)
        assert host_memory.rss(child.pid) is None
    finally:
        child.wait()
    assert (host_memory.rss(os.getpid()) or 0) > 0  # a live one has


def test_v2_limit_with_the_page_cache_left_out(fake_roots: tuple[Path, Path]) -> None:
    proc, cgroup = fake_roots
    _tree(proc, {"4242/cgroup": "0::/job.slice/ranks\n"})
    _tree(
        cgroup,
        {
            "job.slice/ranks/memory.max": "max\n",
            "job.slice/ranks/memory.current": str(900 * MiB),
            "job.slice/memory.max": str(2 * GiB),
            "job.slice/memory.current": str(1200 * MiB),
            # inactive_file: page cache the kernel drops before it OOM-kills; active_file stays.
            "job.slice/memory.stat": f"anon 1\nactive_file {100 * MiB}\ninactive_file {200 * MiB}\n",
        },
    )
    assert host_memory.memory_limit(4242) == host_memory.MemoryLimit(
        1000 * MiB, 2 * GiB, "its cgroup's memory.max (/job.slice)"
    )


def test_an_ancestors_limit_nearer_to_full_is_the_tighter(fake_roots: tuple[Path, Path]) -> None:
    """The rank's own cgroup allows 4 GiB and uses 1; its parent allows 6 GiB, of which its
    other children use 5.5: the parent's is the limit the ranks reach first."""
    proc, cgroup = fake_roots
    _tree(proc, {"4242/cgroup": "0::/user/kernel\n"})
    _tree(
        cgroup,
        {
            "user/kernel/memory.max": str(4 * GiB),
            "user/kernel/memory.current": str(1 * GiB),
            "user/memory.max": str(6 * GiB),
            "user/memory.current": str(int(5.5 * GiB)),
            "memory.stat": "inactive_file 0\n",  # the root's: never read (it has no limit)
        },
    )
    assert host_memory.memory_limit(4242) == host_memory.MemoryLimit(
        int(5.5 * GiB), 6 * GiB, "its cgroup's memory.max (/user)"
    )


def test_v1_memory_controller_and_the_unified_hierarchy_beside_it(
    fake_roots: tuple[Path, Path],
) -> None:
    """A hybrid machine: v1's memory controller sets the limit (its "no limit" is a number near
    2**63, at the root), v2's unified hierarchy beside it (/sys/fs/cgroup/unified) has none."""
    proc, cgroup = fake_roots
    _tree(
        proc, {"4242/cgroup": "12:cpu,cpuacct:/docker/abc\n5:memory:/docker/abc\n0::/docker/abc\n"}
    )
    _tree(
        cgroup,
        {
            "memory/memory.limit_in_bytes": _V1_UNLIMITED,
            "memory/docker/abc/memory.limit_in_bytes": str(3 * GiB),
            "memory/docker/abc/memory.usage_in_bytes": str(2 * GiB),
            "memory/docker/abc/memory.stat": f"cache 1\ntotal_inactive_file {512 * MiB}\n",
            "unified/docker/abc/memory.events": "oom 0\noom_kill 0\n",
        },
    )
    assert host_memory.memory_limit(4242) == host_memory.MemoryLimit(
        int(1.5 * GiB), 3 * GiB, "its cgroup's memory.limit_in_bytes (/docker/abc)"
    )
    # A limit in the unified hierarchy is named from its own root, not from /sys/fs/cgroup.
    _tree(
        cgroup,
        {
            "unified/docker/abc/memory.max": str(2 * GiB),
            "unified/docker/abc/memory.current": str(1800 * MiB),
        },
    )
    assert host_memory.memory_limit(4242) == host_memory.MemoryLimit(
        1800 * MiB, 2 * GiB, "its cgroup's memory.max (/docker/abc)"
    )


def test_no_limit_anywhere_is_the_machines_memory(fake_roots: tuple[Path, Path]) -> None:
    proc, cgroup = fake_roots
    _tree(proc, {"4242/cgroup": "0::/user\n"})
    _tree(cgroup, {"user/memory.max": "max\n", "user/memory.current": str(GiB)})
    assert host_memory.memory_limit(4242) == host_memory.MemoryLimit(
        2 * GiB, 8 * GiB, "this machine's memory"
    )
    (proc / "meminfo").unlink()
    assert host_memory.memory_limit(4242) is None  # nothing to read: no guess
