"""The notebooks in notebooks/ run, through the same command the README gives."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_quickstart(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "scripts/run_notebook.py", "notebooks/quickstart.ipynb"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "XDG_CACHE_HOME": str(tmp_path)},
    )
    out = result.stdout
    assert result.returncode == 0, out + result.stderr
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
