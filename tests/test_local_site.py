"""This machine's site, with real processes: the end of a process tree (SIGTERM, the grace,
SIGKILL, nothing left) and a live rank's stack dump, read whole."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import anyio
import pytest

from elastic_nb import protocol
from elastic_nb.common import procs
from elastic_nb.common.rank_state import RankState
from elastic_nb.common.rundir import RunDir
from elastic_nb.supervisor.processes.launcher_pool import LauncherPool
from elastic_nb.supervisor.processes.local_site import LocalSite
from elastic_nb.supervisor.processes.process_tree import ProcessTree
from elastic_nb.supervisor.ranks.evidence import EvidenceCollector

pytestmark = pytest.mark.unit

# A launcher stand-in that ignores SIGTERM, with a marked child that ignores it too and escapes
# into a session of its own: only the marker finds it, only SIGKILL ends them.
STUBBORN = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"],
    start_new_session=True)
print(child.pid, flush=True)
time.sleep(60)
"""


def test_the_process_tree_goes_sigterm_grace_sigkill_and_leaves_nothing() -> None:
    job_id = f"test{os.getpid()}"
    proc = subprocess.Popen(
        [sys.executable, "-c", STUBBORN],
        env={**os.environ, procs.MARKER: job_id},
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    signals: list[str] = []

    async def main() -> list[int]:
        tree = ProcessTree(job_id, proc, orphans=list)
        return await tree.stop(0.5, lambda name, _: signals.append(name))

    started = time.monotonic()
    survivors = anyio.run(main)
    assert survivors == []
    assert signals == ["SIGTERM", "SIGKILL"]  # SIGTERM was ignored: the grace, then SIGKILL
    assert time.monotonic() - started < 5
    assert proc.poll() == -signal.SIGKILL
    assert not procs.job_processes([job_id])
    state = procs.proc_state(child)
    assert state is None or state[0] == "Z"  # gone, or dead awaiting its new parent's reaping


def test_a_stack_dump_is_read_whole_when_its_rank_pauses_in_the_middle(tmp_path: Path) -> None:
    """faulthandler writes a dump thread by thread; a rank descheduled between two (a loaded
    machine) left the file still for a poll, and the supervisor took the first thread alone
    (a helper's) for the rank's stack. The dump is whole when it ends as the file says."""
    rd = RunDir(str(tmp_path))
    rd.attempt(0).mkdir(parents=True)
    path, cell = rd.stacks(0, 0), str(rd.cell)
    end = '  File "<string>", line 1 in <module>'
    path.write_text(f"{protocol.rank_probes.STACKS_END_MARK}{end}\n")
    rank = subprocess.Popen(
        [sys.executable, "-c", _PAUSING_DUMPER.format(path=str(path), cell=cell, end=end)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert rank.stdout is not None and rank.stdout.readline() == "armed\n"
        r = RankState(0, 0, pid=rank.pid, started_at=time.time())
        site = LocalSite(rd, LauncherPool(str(tmp_path / "pool")), list, lambda: None)
        where = anyio.run(EvidenceCollector(rd, lambda _: site, "x = 1\n")._where, [r])[0]
        assert where.how == "live" and where.frames[0].file == cell, where
    finally:
        rank.kill()
        rank.wait()


def test_a_rank_seen_gone_is_not_alive_while_its_exit_status_is_on_its_way(tmp_path: Path) -> None:
    """A forked rank's exit status comes from its launcher, up to seconds after its pidfd said
    it ended (a loaded machine); the book counts it dead only then. Meanwhile it is not alive:
    a session's next cell, sent in that window, met a dead rank (test_session's rank killed
    between cells, once in a full run). Nor is it signalled by a pid that is no longer its."""
    rd = RunDir(str(tmp_path))
    rank = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        r = RankState(0, 0, pid=rank.pid, started_at=time.time())
        site = LocalSite(rd, LauncherPool(str(tmp_path / "pool")), list, lambda: None)
        assert site.alive(r)
        rank.kill()
        anyio.run(site.wait_gone, r)
        assert r.died_at is None and not site.alive(r)
        assert not site.signal(r, signal.SIGTERM)  # its pid may be another process's by now
    finally:
        rank.kill()
        rank.wait()


_PAUSING_DUMPER = """
import signal, time
def dump(*_):
    with open({path!r}, "a") as f:
        f.write("Thread 0x00007f0000000001 (most recent call first):\\n")
        f.write('  File "/x/recorder.py", line 75 in _read\\n\\n')
        f.flush()
        time.sleep(0.3)  # descheduled between two threads
        f.write("Current thread 0x00007f0000000002 (most recent call first):\\n")
        f.write('  File "{cell}", line 9 in <module>\\n{end}\\n')
signal.signal(signal.SIGUSR1, dump)
print("armed", flush=True)
while True:
    time.sleep(0.05)
"""
