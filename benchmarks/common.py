"""Shared by the benchmarks: a real kernel with elastic_nb, torchrun on the same code, medians."""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.kernel import Kernel  # noqa: E402  (the same real-kernel driver the tests use)


def torchrun(body: str, nproc: int, workdir: str) -> float:
    """Wall time of `torchrun --standalone --nproc-per-node N script.py` on the cell's body."""
    script = Path(workdir) / "cell_script.py"
    script.write_text(body)
    t0 = time.monotonic()
    subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            f"--nproc-per-node={nproc}",
            str(script),
        ],
        check=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    return time.monotonic() - t0


def elastic_kernel(workdir: str) -> Kernel:
    k = Kernel(workdir, env={"XDG_CACHE_HOME": str(Path(workdir) / "cache")})
    k.ok("%load_ext elastic_nb")
    return k


def alternate(
    runs: int, a: Callable[[], float], b: Callable[[], float]
) -> tuple[list[float], list[float]]:
    """A/B/A/B... so that drift of the machine hits both sides alike."""
    xs, ys = [], []
    for _ in range(runs):
        xs.append(a())
        ys.append(b())
    return xs, ys


def row(name: str, xs: list[float], ys: list[float], unit: str = "s") -> str:
    mx, my = statistics.median(xs), statistics.median(ys)
    return f"| {name} | {mx:.2f} {unit} | {my:.2f} {unit} | {mx / my:.2f}x | {len(xs)} |"


HEADER = "| benchmark | elastic_nb (median) | torchrun (median) | elastic_nb/torchrun | runs |\n| --- | --- | --- | --- | --- |"


def workdir() -> str:
    return tempfile.mkdtemp(prefix="elastic_nb-bench-")
