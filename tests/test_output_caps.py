"""Huge lines and huge outputs: what the notebook receives is bounded, the rank logs keep all.

Real kernel, real ranks, text mode (what a saved notebook keeps)."""

from __future__ import annotations

import gc
import io
import json

import psutil
import pytest

from elastic_nb.common.rundir import RunDir
from elastic_nb.kernel.dashboard.model import DashboardState
from elastic_nb.kernel.flags import job_spec
from elastic_nb.kernel.render_text import TextRenderer
from tests.kernel import Execution, Kernel

pytestmark = pytest.mark.e2e

MB = 1024 * 1024
# The docs' numbers (docs/explanation/how-a-cell-runs.md, docs/howto/dashboard.md), not the product's constants:
CELL_CHARS = 500_000  # "at most 500,000 characters of rank output per cell" in text mode
LINE_CHARS = 4_000  # "the first 4,000 characters of a line"
TAB_CHARS = 250_000  # "a tab holds at most 250,000 characters"
ALL_TAB_CHARS = 500_000  # "(500,000 across ranks)"


def _measured(kernel: Kernel, code: str) -> tuple[Execution, int, int]:
    """The cell's execution, the bytes of its output and the kernel's RSS growth."""
    kernel.ok("%%elastic --nproc 2\nprint('warm')\n")  # imports and pools are not the cell's
    kernel.ok("import gc; gc.collect();")
    rss = psutil.Process(kernel.pid).memory_info().rss
    ex = kernel.ok(code)
    kernel.ok("gc.collect();")
    gc.collect()
    grew = psutil.Process(kernel.pid).memory_info().rss - rss
    size = len(ex.stdout.encode()) + len(ex.stderr.encode())
    print(f"\ncell output {size:,} bytes, kernel RSS +{grew / MB:.1f} MB")
    return ex, size, grew


def test_a_5mb_line_per_rank_is_cut_and_the_log_keeps_it(kernel: Kernel) -> None:
    ex, size, grew = _measured(
        kernel,
        "%%elastic --nproc 2\nimport sys\nprint('x' * 5_000_000)\nprint('after', file=sys.stderr)\n",
    )
    assert size < 1 * MB, size
    assert grew < 20 * MB, grew
    rd = RunDir(ex.run_dir)
    for rank in (0, 1):
        log = rd.log(0, rank, "out")
        assert log.read_text() == "x" * 5_000_000 + "\n"  # the file keeps the whole line
        cut = 5_000_000 - LINE_CHARS
        shown = (
            f"[rank {rank}] {'x' * LINE_CHARS}… {cut:,} characters not shown (full log: {log})\n"
        )
        assert shown in ex.stdout
        assert f"[rank {rank}] after\n" in ex.stderr


def test_a_200_000_update_progress_bar_per_rank_is_its_last_state(kernel: Kernel) -> None:
    ex, size, grew = _measured(
        kernel,
        "%%elastic --nproc 2\n"
        "import sys\n"
        "for i in range(200_000):\n"
        "    sys.stdout.write(f'\\r{i + 1}/200000 |' + '#' * (i // 5000))\n"
        "sys.stdout.write('\\n')\n",
    )
    assert size < 1 * MB, size
    assert grew < 20 * MB, grew
    for rank in (0, 1):
        assert f"[rank {rank}] 200000/200000 |{'#' * 39}\n" in ex.stdout
    assert RunDir(ex.run_dir).log(0, 0, "out").read_bytes().count(b"\r") == 200_000


def _flood(rank: int, n: int, width: int = 4000) -> dict:
    lines = [f"{rank} {i} " + "y" * width for i in range(n)]
    return {
        "attempt": 0,
        "rank": rank,
        "stream": "out",
        "lines": lines,
        "skipped": 0,
        "progress": None,
    }


def test_a_cell_prints_a_bounded_total_then_says_it_stopped() -> None:
    out, err = io.StringIO(), io.StringIO()
    r = TextRenderer("cafe0001", "/runs/cafe0001", out, err)
    for _ in range(20):  # 20 updates of 200 lines of 4,000 characters from each of 2 ranks
        r.update({"logs": [_flood(0, 200), _flood(1, 200)]})
    r.update({"alerts": [{"kind": "slow", "severity": "warning", "title": "still shown"}]})
    text = out.getvalue()
    shown = sum(len(line) + 1 for line in text.splitlines() if line.startswith("[rank "))
    # Whole lines only: at most one line (4,000 characters and its prefix) short of the cap.
    assert CELL_CHARS - (LINE_CHARS + 20) < shown <= CELL_CHARS, shown
    assert err.getvalue() == ""
    assert text.count("500,000 characters of rank output shown") == 1
    assert "the rest is not printed (full logs: /runs/cafe0001/attempt-0/)" in text
    assert text.endswith("[elastic_nb] still shown\n")
    assert all(line.startswith("[") for line in text.splitlines())  # whole lines only


def test_the_dashboard_holds_a_bounded_number_of_characters(tmp_path) -> None:
    state = DashboardState("cafe0001", str(tmp_path), job_spec({"nproc": 2}))
    for _ in range(20):
        state.apply({"logs": [_flood(0, 200), _flood(1, 200)]})
        delta = state.take_delta()
        assert delta and len(json.dumps(delta)) < 2 * ALL_TAB_CHARS
    # The newest lines that fit: full to within a line of the docs' bound, never over it.
    for rank in ("0", "1"):
        tail = state.tails[rank]
        held = sum(len(t) for _, t in tail)
        assert TAB_CHARS - (LINE_CHARS + 20) < held <= TAB_CHARS, held
        assert tail[-1][1].startswith(f"{rank} 199 ")  # the newest lines stay
    held = sum(len(t) for *_, t in state.all)
    assert ALL_TAB_CHARS - (LINE_CHARS + 20) < held <= ALL_TAB_CHARS, held
    assert len(json.dumps(state.snapshot())) < 2 * MB
