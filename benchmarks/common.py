"""Shared by the benchmarks: a real kernel with elastic_nb, torchrun on the same code, medians.

Both sides run the same body. Ranks mark the moments a benchmark measures by writing
``time.time()`` into files of a directory given as BENCH_DIR (a file per event and rank), so
neither side's log path is in the measurement. On the elastic_nb side the start is the moment
the cell is sent to the kernel and the end the moment its error (or idle) reaches the client.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psutil

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.kernel import (  # noqa: E402  (the tests' real-kernel driver)
    Execution,
    Kernel,
    TreeWatch,
    wait_for,
)

# What a rank calls to mark a moment (or a value): mark('ready') writes time.time() to
# BENCH_DIR/ready-<rank>.
MARK = (
    "def mark(event, value=None):\n"
    "    import os, time\n"
    "    path = os.path.join(os.environ['BENCH_DIR'], f\"{event}-{os.environ['RANK']}\")\n"
    "    with open(path + '.tmp', 'w') as f:\n"
    "        f.write(repr(time.time() if value is None else value))\n"
    "    os.replace(path + '.tmp', path)  # whole, never read half-written\n"
)


@dataclass
class Run:
    started: float  # time.time() when the cell was sent / torchrun was started
    ended: float  # ... when the cell's error or end arrived / torchrun exited
    marks: dict[str, list[float]]  # event -> every rank's time.time()
    returncode: int | None = None  # torchrun's; None when it ran past its bound
    output: str = ""
    execution: Execution | None = None

    @property
    def wall(self) -> float:
        return self.ended - self.started

    def after_start(self, event: str, n: int) -> float:
        """Start -> the moment the last of `n` ranks marked `event`."""
        times = self.marks.get(event, [])
        assert len(times) == n, (event, self.marks, self.output[-2000:])
        return max(times) - self.started


# The kernel driver's process watch (tests/kernel.py, TreeWatch: a thread that walks the process
# table every 20 ms, about a tenth of a core here) of every live Elastic kernel. It runs as long as
# the kernel lives, during torchrun's turns too (the kernel stays up between elastic_nb's), so
# `timed` pauses it for every timed turn, both sides', never for one side only.
_WATCHES: list[TreeWatch] = []


@contextlib.contextmanager
def timed() -> Iterator[None]:
    """A timed turn (either side's): the benchmark driver's own watches paused."""
    with contextlib.ExitStack() as stack:
        for watch in list(_WATCHES):
            stack.enter_context(watch.paused())
        yield


def bench_dir() -> str:
    return tempfile.mkdtemp(prefix="elastic_nb-bench-")


def read_marks(directory: str) -> dict[str, list[float]]:
    marks: dict[str, list[float]] = {}
    for path in Path(directory).iterdir():
        event, _, _rank = path.name.rpartition("-")
        if event and path.suffix != ".tmp":
            marks.setdefault(event, []).append(float(path.read_text()))
    return marks


def clear(directory: str) -> None:
    for path in Path(directory).iterdir():
        path.unlink()


def wait_gone(label: str, owns: Callable[[dict[str, str]], bool], timeout: float = 30) -> None:
    """Wait until no process whose environment `owns` says is one side's remains, so that the
    other side's turn never runs beside the previous one's leftovers (a warm-up, a rank)."""

    def left() -> list[int]:
        found = []
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if p.status() != psutil.STATUS_ZOMBIE and owns(p.environ()):
                    found.append(p.pid)
        return found

    assert wait_for(lambda: not left(), timeout, 0.1), f"{label} left processes: {left()}"


def torchrun(
    body: str,
    nproc: int,
    directory: str,
    *args: str,
    timeout: float | None = None,
    env: dict[str, str] | None = None,
) -> Run:
    """`torchrun --standalone --nproc-per-node N [args] script.py` on the body; ranks' stdout
    and stderr go to files (as elastic_nb's do) unless args say otherwise."""
    script = Path(directory).parent / f"{Path(directory).name}-script.py"
    script.write_text(MARK + body)
    clear(directory)
    logs = tempfile.mkdtemp(prefix="elastic_nb-bench-torchrun-logs-")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        "--redirects=3",
        f"--log-dir={logs}",
        *args,
        str(script),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BENCH_DIR": directory, **(env or {})}
    code: int | None
    with timed():
        t0 = time.time()
        proc = subprocess.Popen(
            cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        try:
            out, _ = proc.communicate(timeout=timeout)
            code = proc.returncode
        except subprocess.TimeoutExpired:
            out, code = b"", None
    if code is None:
        # torchrun's script ranks run in sessions of their own and outlive a killed agent
        # (SubprocessContext): find them by the BENCH_DIR they inherited.
        os.killpg(proc.pid, 9)
        for p in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if p.environ().get("BENCH_DIR") == directory:
                    p.kill()
        out, _ = proc.communicate()
    ended = time.time()
    wait_gone("torchrun", lambda e: e.get("BENCH_DIR") == directory)
    return Run(t0, ended, read_marks(directory), code, out.decode(errors="replace"))


def print_blamed(blamed: dict[str, list[int | None]], rank: int, what: str = "") -> None:
    """How often each side named the right rank: 'torchrun named rank 1 in 0 of 5 runs'."""
    for side, ranks in blamed.items():
        right = sum(r == rank for r in ranks)
        print(f"{side} named rank {rank}{what} in {right} of {len(ranks)} runs (blamed: {ranks})")


def torchrun_root_rank(output: str) -> int | None:
    """The rank torchrun's error report names as the root cause."""
    m = re.search(r"Root Cause.*?rank\s*:\s*(\d+)", output, re.S)
    return int(m.group(1)) if m else None


class Elastic:
    """A kernel with elastic_nb loaded; cells carry BENCH_DIR to their ranks."""

    def __init__(self, directory: str, env: dict[str, str] | None = None) -> None:
        self.directory = directory
        self.cache = tempfile.mkdtemp(prefix="elastic_nb-bench-cache-")
        self.kernel = Kernel(
            tempfile.mkdtemp(prefix="elastic_nb-bench-cwd-"),
            env={"XDG_CACHE_HOME": self.cache, **(env or {})},
        )
        _WATCHES.append(self.kernel.tree)
        self.kernel.ok("%load_ext elastic_nb")
        self.kernel.ok(MARK)  # a notebook function: it travels to the ranks by value

    def run(self, flags: str, body: str, timeout: float = 300) -> Run:
        clear(self.directory)
        cell = f"%%elastic {flags} --env BENCH_DIR={self.directory}\n{body}"
        t0 = time.time()
        with timed():
            ex = self.kernel.run(cell, timeout=timeout)
        end = ex.error_at or ex.idle_at
        assert end is not None
        return Run(t0, end, read_marks(self.directory), execution=ex, output=ex.stdout + ex.stderr)

    @classmethod
    def warm(cls, directory: str, env: dict[str, str] | None = None) -> Elastic:
        """A kernel past its first (cold) cell, its next launcher warmed up."""
        el = cls(directory, env)
        el.run("--nproc 1", "print('warming up')\n")
        el.wait_warm()
        return el

    def wait_warm(self, timeout: float = 120) -> None:
        """Like a person between two cells: the next launcher has warmed up."""
        ok = wait_for(
            lambda: re.search(
                r"warm launcher: pid \d+, ready", self.kernel.ok("%elastic status").stdout
            ),
            timeout,
            0.2,
        )
        assert ok, self.kernel.ok("%elastic status").stdout

    def shutdown(self) -> None:
        """The kernel and everything it started, the next warm launcher included, are gone when
        this returns (the kernel driver's own tree check, then every process that carries this
        kernel's cache home, however it was started)."""
        if self.kernel.tree in _WATCHES:
            _WATCHES.remove(self.kernel.tree)
        self.kernel.shutdown()
        wait_gone("elastic_nb", lambda e: e.get("XDG_CACHE_HOME") == self.cache)


def runs() -> int:
    """--runs N from the command line (run_all passes it on): A/B pairs to take medians of."""
    return parser().parse_args().runs


def parser(cuda: bool = False) -> argparse.ArgumentParser:
    """--runs N; with `cuda`, also --device cpu|cuda: the benchmark's body on the CPU (gloo) or
    on GPUs (NCCL, the body's tensors and model on the rank's GPU), the same on both sides."""
    p = argparse.ArgumentParser()
    p.add_argument("--runs", type=int, default=5)
    if cuda:
        p.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    return p


# The start of a body's cuda side (--device cuda): `device`, the rank's GPU, set as current. A
# GPU per rank when there are enough; else the ranks share them, and since NCCL refuses two ranks
# of one host on a GPU ("Duplicate GPU detected"), each rank then gets an NCCL_HOSTID of its own:
# NCCL takes it for a host of its own and its traffic goes over sockets (as in gpu_oom_hang.py):
# over loopback on both sides (elastic_nb's ranks have NCCL_SOCKET_IFNAME set to it already;
# torchrun's would pick the first other interface). In the body, so that torchrun's ranks do
# exactly the same.
CUDA_DEVICE = """import os, torch
if torch.cuda.device_count() < int(os.environ['WORLD_SIZE']):
    os.environ['NCCL_HOSTID'] = f"elastic-nb-bench-rank-{os.environ['RANK']}"
    os.environ.setdefault('NCCL_SOCKET_IFNAME', '=lo')
device = torch.device('cuda', int(os.environ['LOCAL_RANK']) % torch.cuda.device_count())
torch.cuda.set_device(device)
"""
# Its process group: NCCL's communicator made in init_process_group (device_id), not lazily at
# the first collective, so that "past init_process_group" means NCCL is up.
CUDA_INIT = "dist.init_process_group('nccl', device_id=device)\n"


def alternate(runs: int, a: Callable[[], Any], b: Callable[[], Any]) -> tuple[list[Any], list[Any]]:
    """A/B, B/A, A/B, ...: drift of the machine hits both sides alike, and neither side always
    runs first (after the other's leftovers, or on a machine that has just cooled down)."""
    xs, ys = [], []
    for i in range(runs):
        if i % 2 == 0:
            xs.append(a())
            ys.append(b())
        else:
            ys.append(b())
            xs.append(a())
    return xs, ys


def median(xs: list[float]) -> float:
    return statistics.median(xs)


def spread(xs: list[float], unit: str = "s", digits: int = 2) -> str:
    """'0.09 s (0.08-0.11)': the median, then the smallest and largest of the runs."""
    return f"{median(xs):.{digits}f} {unit} ({min(xs):.{digits}f}-{max(xs):.{digits}f})"


HEADER = (
    "| benchmark | elastic_nb: median (min-max) | torchrun: median (min-max) "
    "| elastic_nb/torchrun (medians) | target | runs |\n"
    "| --- | --- | --- | --- | --- | --- |"
)


def row(name: str, xs: list[float], ys: list[float], target: str, unit: str = "s") -> str:
    ratio = median(xs) / median(ys)
    return f"| {name} | {spread(xs, unit)} | {spread(ys, unit)} | {ratio:.2f}x | {target} | {len(xs)} |"
