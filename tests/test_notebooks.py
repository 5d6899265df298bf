"""The notebooks in notebooks/ run, through the same command `make demo` runs, and say what their
prose says they say. Each runs in a kernel of its own, on CPU (gloo), with a cache home of its
own: nothing of the notebook (a job, a session, the supervisor, the kernel) may outlive it."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path

import nbformat
import psutil
import pytest

from elastic_nb.common import procs
from tests.kernel import wait_for

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = ROOT / "notebooks"
_JOB = re.compile(r"\[elastic_nb\] (?:job|session) ([0-9a-f]{8})")


def run_notebook(name: str, cache: Path) -> str:
    """Execute notebooks/NAME headlessly, as `make demo` does; its printed outputs. Then insist
    that nothing it started is left: no process of its jobs or sessions, and none carrying its
    cache home (the kernel, its supervisor, a warm launcher)."""
    result = subprocess.run(
        [sys.executable, "scripts/run_notebook.py", f"notebooks/{name}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "XDG_CACHE_HOME": str(cache)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert not procs.job_processes(sorted(set(_JOB.findall(out))))

    def left() -> list[str]:
        found = []
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if p.environ().get("XDG_CACHE_HOME") == str(cache):
                    found.append(f"{p.pid} {' '.join(p.cmdline())[:100]}")
        return found

    # The kernel's shutdown is bounded; what it started goes with it.
    assert wait_for(lambda: not left(), timeout=10), f"processes outlived the notebook: {left()}"
    return out


def cell_output(out: str, name: str, source_start: str) -> str:
    """What run_notebook printed for the first code cell of notebooks/NAME whose source starts
    with `source_start`."""
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    index = next(
        i
        for i, cell in enumerate(nb.cells)
        if cell.cell_type == "code" and cell.source.startswith(source_start)
    )
    start = out.index(f"\n### cell {index}: ")
    end = out.find("\n### cell ", start + 1)
    return out[start : end if end != -1 else len(out)]


def test_every_notebook_is_tested_and_committed_without_outputs() -> None:
    # Each notebook NAME.ipynb has its test_NAME below.
    tested = {f"{name[5:]}.ipynb" for name in globals() if name.startswith("test_")}
    found = {p.name for p in NOTEBOOKS.glob("*.ipynb")}
    assert found <= tested, f"notebooks without a test: {found - tested}"
    for path in sorted(NOTEBOOKS.glob("*.ipynb")):
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert cell.outputs == [] and cell.execution_count is None, (
                    f"{path.name}: a cell was committed with its outputs: {cell.source[:60]!r}"
                )


def test_quickstart(tmp_path: Path) -> None:
    out = run_notebook("quickstart.ipynb", tmp_path)
    for rank in range(4):
        assert f"[rank {rank}] {rank} 10.0" in out
    assert "Out: 10.0" in out
    assert "pulled 30 losses from rank 0" in out
    assert (
        "JobFailed: rank 1 failed first: ValueError: rank 1 ran out of patience (cell line 5)"
        in out
    )
    assert "Out: 4" in out
    assert len(re.findall(r"job [0-9a-f]{8} succeeded · 4 ranks", out)) == 3


def test_session(tmp_path: Path) -> None:
    """The debugging loop: set up once, a failure inside a collective, the restart and the
    replay, and the next step runs on the state the replay brought back."""
    out = run_notebook("session.ipynb", tmp_path)
    session = re.search(r"session ([0-9a-f]{8}): 2 ranks up", out)
    assert session, out
    assert "Out: ('step', 1)" in out
    # The failure names rank 1 and its line; rank 0, stuck in the all_reduce, was ended.
    assert "JobFailed: rank 1 failed first: ValueError: rank 1 hit a bad batch (cell line 3)" in out
    assert "rank 0 could not be interrupted within 2 s" in out
    # The restart and the replay of the two cells that had succeeded.
    assert "the session restarts its ranks as attempt 1" in out
    assert "replayed cell 1 (import torch, torch.distributed as dist) in" in out
    assert "replayed cell 2 (loss = train_step()) in" in out
    assert "the session's state is back: 2 cells replayed in" in out
    # The state is back: the next step is step 2, on the new ranks.
    assert "Out: ('step', 2)" in out
    for rank in range(2):
        assert re.search(rf"\[rank {rank}\] step 2: loss [0-9.]+ \(attempt 1\)", out), out
    assert f"session {session.group(1)}: ready, 2 ranks, attempt 1, restarts 1/3" in out
    assert f"session {session.group(1)} ended: ended with %elastic down" in out


def test_debugging_oom_hangs(tmp_path: Path) -> None:
    """An OOM on rank 1 in DDP training (simulated on CPU), raised, then caught and skipped
    (a desync), then the fix, on a session: what elastic_nb reports is what the prose says."""
    nb = "debugging_oom_hangs.ipynb"
    out = run_notebook(nb, tmp_path)
    session = re.search(r"session ([0-9a-f]{8}): 2 ranks up", out)
    assert session, out
    setup = re.search(
        r"job ([0-9a-f]{8}) succeeded", cell_output(out, nb, "%%elastic\nimport torch")
    )
    assert setup, out

    # 1. The OOM propagates: rank 1 failed first, with its error, line and memory figures; the
    # alert comes as it happens, before the restart it brings; rank 0 was stuck in DDP's
    # all-reduce and ended; the session restarted and replayed the setup cell.
    oom = cell_output(
        out, nb, "%%elastic\nfor step in range(6):\n    x, y = batch(step)\n    scratch"
    )
    alert = (
        "[elastic_nb] rank 1 ran out of CUDA memory on GPU 1 at cell line 4 (requested 160.00 GiB)"
    )
    assert alert in oom and oom.count(alert) == 1
    assert oom.index(alert) < oom.index("the session restarts its ranks as attempt 1")
    assert (
        "JobFailed: rank 1 failed first: torch.OutOfMemoryError: CUDA out of memory. Tried to "
        "allocate 160.00 GiB. GPU 1 has a total capacity of 80.00 GiB (simulated on CPU by this "
        "notebook) (cell line 4)"
    ) in oom
    assert "cause: cuda_oom" in oom
    assert "  %%elastic cell, line 4, in <module>\n    scratch = workspace(" in oom
    # The frame in workspace() is the setup cell's, named by its job.
    assert f"  %%elastic cell of job {setup.group(1)}, line 31, in workspace" in oom
    assert "rank 0: stopped by elastic_nb (SIGKILL) after rank 1 failed" in oom
    assert "rank 0 could not be interrupted within 2 s" in oom
    assert "the session's state is back: 1 cell replayed in" in oom

    # 2. Caught and skipped: a desync naming rank 1, found while rank 0 waited in its last
    # gradient all-reduce (its stack shows it), long before --collective-timeout 30.
    desync = cell_output(
        out, nb, "%%elastic\nfor step in range(6):\n    x, y = batch(step)\n    try:"
    )
    assert "[rank 1] rank 1: out of memory at step 3, skipping this batch" in desync
    m = re.search(
        r"JobFailed: desync: rank 1 left the cell after (\d+) collectives \(its last: "
        r"all_reduce #(\d+)\); rank 0 waits in all_reduce #(\d+) \(cell line 10: "
        r"loss\.backward\(\): DDP's gradient all-reduce\)",
        desync,
    )
    assert m and m[1] == m[2] and int(m[3]) == int(m[1]) + 1, desync
    assert "cause: desync" in desync and "must skip it on every rank together" in desync
    stacks = desync[desync.index("--- where every rank was") :]
    assert "rank 0 · cell line 10: loss.backward()" in stacks
    assert "rank 1 · finished the cell" in stacks
    assert "rank 0: stopped by elastic_nb (SIGKILL) after rank 1 left the cell" in desync
    assert "restarts 2/3" in desync
    took = re.search(
        r"job [0-9a-f]{8} failed · cause: desync · 2 ranks · restarts 2/3 · ([0-9.]+) s", desync
    )
    assert took and float(took[1]) < 30, desync  # the grace, the restart and the replay included

    # 3. The fix: both ranks skip step 3 together and train the other 5, on the replayed state.
    fix = cell_output(out, nb, "%%elastic\nsteps = 0")
    for rank in range(2):
        assert f"[rank {rank}] rank {rank}: step 3 skipped on every rank" in fix
        assert f"[rank {rank}] rank {rank}: 5 steps trained" in fix
    assert "Out: 5" in fix
    assert f"session {session[1]}: ready, 2 ranks, attempt 2, restarts 2/3" in out
    assert "replayed on attempt 1: 1 cell in" in out and "replayed on attempt 2: 1 cell in" in out
    assert f"session {session[1]} ended: ended with %elastic down" in out

    # 4. The debugger: the NaN on rank 1 fails its assert; %elastic debug opens rank 1 at it,
    # and a frontend with no input (nbclient, running this notebook) fails that cell at once,
    # saying why, with the rank's frame shown first.
    nan = cell_output(out, nb, "%%elastic\nx, y = batch(0)\nscale")
    assert "JobFailed: rank 1 failed first: AssertionError: loss is nan on rank 1" in nan
    debug = cell_output(out, nb, "%elastic debug")
    assert "[rank 1] AssertionError: loss is nan on rank 1" in debug
    assert "[rank 1] > cell(5)<module>()" in debug
    assert "NoInput: rank 1 waits for a line of input (its prompt: '(Pdb) ')" in debug
    assert "this frontend takes no input" in debug


def test_elastic_restarts_and_checkpoints(tmp_path: Path) -> None:
    nb = "elastic_restarts_and_checkpoints.ipynb"
    out = run_notebook(nb, tmp_path)
    # A rank that fails once: one restart, and attempt 1's result.
    once = cell_output(out, nb, "%%elastic --nproc 2 --max-restarts 2\nimport os, torch")
    assert (
        "[elastic_nb] attempt 0 failed: rank 1 ConnectionError: rank 1 lost its connection to the "
        "data server (once) (cell line 6); restarting as attempt 1 (restart 1/2)"
    ) in once
    for rank in range(2):
        assert f"[rank {rank}] attempt 1: the all_reduce gives 2.0" in once
    assert re.search(r"job [0-9a-f]{8} succeeded · 2 ranks · restarts 1/2", once)
    assert "Out: 1" in once
    # The checkpoint: attempt 1 resumes from step 9's, says what the failure cost, and the
    # history (the checkpoint's extra) is whole.
    ckpt = cell_output(out, nb, "%%elastic --nproc 2 --max-restarts 1 --env ELASTIC_NB_CHECKPOINT")
    assert "[elastic_nb] checkpoint saved: step 4 (" in ckpt
    assert "[elastic_nb] checkpoint saved: step 9 (" in ckpt
    assert re.search(
        r"attempt 0 failed: rank 1 RuntimeError: rank 1 lost its device at step 12 \(once\) "
        r"\(cell line 22\); restarting as attempt 1 \(restart 1/1\); the last checkpoint is step "
        r"9, saved [\d.]+ s before rank 1 failed \(about [\d.]+ s of work to redo\)",
        ckpt,
    ), ckpt
    assert re.search(r"resumed from step 9, saved [\d.]+ s before rank 1 failed: about", ckpt)
    for rank in range(2):
        assert f"[rank {rank}] attempt 0: starts at step 0" in ckpt
        assert f"[rank {rank}] attempt 1: starts at step 10" in ckpt
        assert f"[rank {rank}] rank {rank}: attempt 1 trained steps 10 to 19" in ckpt
    assert re.search(r"job [0-9a-f]{8} succeeded · 2 ranks · restarts 1/1", ckpt)
    assert re.search(r"20 losses, from [0-9.]+ at step 0 to [0-9.]+ at step 19", out)
    # The failed attempt's log is kept.
    logs = cell_output(out, nb, "%elastic logs --attempt 0 --rank 1")
    assert "rank 1 stderr, attempt 0" in logs
    assert "[rank 1] RuntimeError: rank 1 lost its device at step 12 (once)" in logs
    # A failure no restart fixes: the budget is spent, the error names rank 1 in attempt 2.
    always = cell_output(out, nb, "%%elastic --nproc 2 --max-restarts 2\nimport os\n")
    assert "restarting as attempt 1 (restart 1/2)" in always
    assert "restarting as attempt 2 (restart 2/2)" in always
    assert (
        "JobFailed: rank 1 failed first: FileNotFoundError: /data/shard-1.bin is missing "
        "(attempt 2) (cell line 5)"
    ) in always
    assert "--- rank 1 (attempt 2) ---" in always
    assert re.search(r"job [0-9a-f]{8} failed · cause: exception · 2 ranks · restarts 2/2", always)
    # Across machines (two join agents on this one): 3 nodes; one killed once step 14 is saved:
    # a restart spent, the newest checkpoint named, 2 nodes go on from it; another joins once
    # step 19 is saved: no restart spent, 3 nodes from the newest step. 100 losses, although no
    # round ran them all; the agents and their jobs' processes gone (run_notebook).
    rounds = cell_output(out, nb, "%%elastic --nnodes 2:3")
    assert re.search(r"attempt 0: first round · world size 3 · node 0 \(\S+\): ranks 0; ", rounds)
    assert "[rank 0] attempt 0: 3 ranks on 3 nodes, from step 0" in rounds
    lost = re.search(
        r"\[elastic_nb\] attempt 1: node (\d) \(\S+\) rank \d was lost: its node left: its "
        r"connection dropped \(the agent or its machine died\); 2 nodes, world size 2 \(restart "
        r"1/3\); the last checkpoint is step (\d+), saved ",
        rounds,
    )
    assert lost and int(lost[2]) >= 14, rounds
    step = int(lost[2])
    assert f"[elastic_nb] resumed from step {step}, " in rounds
    assert f"[rank 0] attempt 1: 2 ranks on 2 nodes, from step {step + 1}" in rounds
    joined = re.search(
        r"\[elastic_nb\] attempt 2: node (\d) \(\S+\) joined; 3 nodes, world size 3 \(no "
        r"restart spent\)",
        rounds,
    )
    assert joined, rounds
    grown = re.search(r"\[rank 0\] attempt 2: 3 ranks on 3 nodes, from step (\d+)", rounds)
    assert grown and int(grown[1]) >= 20, rounds
    assert re.search(r"job [0-9a-f]{8} succeeded · 3 ranks · restarts 1/3", rounds)
    assert "Out: '3 ranks at the end'" in rounds
    assert re.search(r"100 losses, from [0-9.]+ at step 0 to [0-9.]+ at step 99", out)
    listed = cell_output(out, nb, "%elastic nodes")
    assert re.search(rf"node {lost[1]}: .* · lost: its connection dropped", listed), listed
    assert re.search(rf"node {joined[1]}: .* · ready, joined", listed), listed


def test_background_jobs(tmp_path: Path) -> None:
    nb = "background_jobs.ipynb"
    out = run_notebook(nb, tmp_path)
    started = re.search(
        r"Out: <elastic_nb job ([0-9a-f]{8}) (starting|rendezvous|running) run_dir=", out
    )
    assert started, out
    job = started[1]
    # While it runs: its state, the supervisor's list, a rank's last lines, every stack.
    assert "Out: 'running'" in cell_output(out, nb, "import time\nwhile")
    assert f"  running jobs: {job}" in cell_output(out, nb, "%elastic status")
    logs = cell_output(out, nb, "%elastic logs --rank 1 --tail 3")
    assert (
        f"==> rank 1 stdout, attempt 0: {tmp_path}/elastic_nb/runs/{job}/attempt-0/rank-1.out"
        in logs
    )
    assert len(re.findall(r"\[rank 1\] step \d+: loss [0-9.]+", logs)) == 3
    stacks = cell_output(out, nb, "%elastic stacks")
    assert "stacks of every rank, attempt 0" in stacks
    for rank in range(2):
        assert re.search(rf"rank {rank} · .*cell line \d+: ", stacks), stacks
    # Its result, and the pulled losses.
    assert re.search(r"Out: 0\.0[0-9]+", cell_output(out, nb, "job.wait(timeout=300)"))
    assert re.search(r"succeeded: 40 losses pulled, from [0-9.]+ to 0\.0", out)
    # The stuck job: where each rank was, then stopped.
    stuck = re.findall(r"Out: <elastic_nb job ([0-9a-f]{8}) ", out)[1]
    where = cell_output(out, nb, "stuck = _")
    assert (
        "stacks of every rank, attempt 0: rank 1 never entered all_reduce #1 (cell line 9): "
        "it was at cell line 7; rank 0 waited in it"
    ) in where
    assert "rank 0 · waiting in all_reduce · cell line 9: dist.all_reduce(torch.ones(1))" in where
    assert "rank 1 · cell line 7: time.sleep(0.5)" in where
    assert f"stopping: {stuck}" in out
    wait = cell_output(out, nb, "stuck.wait(timeout=60)")
    assert f"JobStopped: job {stuck} was stopped: stopped with %elastic stop" in wait
    for rank in range(2):
        assert f"rank {rank}: stopped by elastic_nb (SIGTERM)" in wait
    assert "Out: 'stopped'" in cell_output(out, nb, "stuck.state")
    jobs = cell_output(out, nb, "%elastic jobs")
    assert re.search(rf"{job}\s+succeeded\s+2\s+0/0", jobs)
    assert re.search(rf"{stuck}\s+stopped\s+2\s+0/0", jobs)
    assert "Out:" not in jobs  # the table is printed, not returned as a value
