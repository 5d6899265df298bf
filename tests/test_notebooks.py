"""The notebooks in notebooks/ run, through the same command the README gives."""

from __future__ import annotations

import contextlib
import os
import re
import subprocess
import sys
from pathlib import Path

import psutil

from elastic_nb import procs
from tests.kernel import wait_for

ROOT = Path(__file__).resolve().parent.parent


def run_notebook(name: str, cache: Path) -> str:
    """Execute notebooks/NAME headlessly, as `make demo` does; its printed outputs."""
    result = subprocess.run(
        [sys.executable, "scripts/run_notebook.py", f"notebooks/{name}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "XDG_CACHE_HOME": str(cache)},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


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
    # Nothing of the session or the kernel is left (the kernel's shutdown is bounded).
    assert not procs.job_processes([session.group(1)])

    def left() -> list[str]:
        found = []
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if p.environ().get("XDG_CACHE_HOME") == str(tmp_path):
                    found.append(f"{p.pid} {' '.join(p.cmdline())[:100]}")
        return found

    assert wait_for(lambda: not left(), timeout=10), (
        f"processes of the notebook outlived it: {left()}"
    )
