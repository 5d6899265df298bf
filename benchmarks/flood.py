"""P5: log flood. 4 ranks import torch, then print 100,000 lines each.

Both sides run the same body, `import torch` included as in a real cell, and buffer alike:
unbuffered (elastic_nb sets PYTHONUNBUFFERED=1 for its ranks; torchrun's get it here too),
output redirected to files. Start -> end counts elastic_nb's warm start too (its ranks fork from
a server that imported torch; torchrun's import it, 4 at once on this machine's cores), so a
second row starts the clock when the first rank starts printing: the output's handling alone.

elastic_nb, under the live dashboard (the heavier path for the kernel), warm: cell start -> the
cell's end, with every line in the run directory; the most messages the notebook received in any
one second (every kind: widget opens, deltas, snapshots, streams); the peak memory of the kernel
and of the supervisor (which tails the logs) over their idle size, RSS and PSS. torchrun: start
-> exit.
"""

from __future__ import annotations

import threading
from pathlib import Path

import psutil
from common import Elastic, alternate, bench_dir, median, runs, spread, torchrun

LINES = 100_000
BODY = f"""import os, torch
r = os.environ['RANK']
mark('printing')
for i in range({LINES}):
    print(f'rank {{r}} line {{i}}')
"""
NPROC = 4
UI = ("comm_msg", "stream", "display_data", "execute_result", "error", "comm_open")


class PeakMemory:
    """A process's peak RSS and PSS over what it held when the watch started, in MiB, sampled
    every 20 ms (PSS from smaps_rollup: shared pages counted by their share, so the torch that
    a process shares with its children is not counted whole in each)."""

    def __init__(self, pid: int) -> None:
        self._p = psutil.Process(pid)
        base = self._p.memory_full_info()
        self.base_rss, self.base_pss = base.rss, base.pss
        self.peak_rss, self.peak_pss = base.rss, base.pss
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            try:
                m = self._p.memory_full_info()
            except psutil.Error:
                return
            self.peak_rss = max(self.peak_rss, m.rss)
            self.peak_pss = max(self.peak_pss, m.pss)

    def stop(self) -> tuple[float, float]:
        """(RSS, PSS) peak over the start, MiB."""
        self._stop.set()
        self._t.join()
        return (self.peak_rss - self.base_rss) / 2**20, (self.peak_pss - self.base_pss) / 2**20


def supervisor_of(kernel_pid: int) -> psutil.Process:
    (sup,) = [
        p
        for p in psutil.Process(kernel_pid).children()
        if "elastic_nb.supervisor" in " ".join(p.cmdline())
    ]
    return sup


def main() -> None:
    n = runs()
    d = bench_dir()
    rates: list[float] = []
    printing: dict[str, list[float]] = {"elastic_nb": [], "torchrun": []}
    mem: dict[str, list[float]] = {k: [] for k in ("k_rss", "k_pss", "s_rss", "s_pss")}
    idle: dict[str, list[float]] = {"k": [], "s": []}

    def baseline() -> float:
        r = torchrun(BODY, NPROC, d, env={"PYTHONUNBUFFERED": "1"})
        assert r.returncode == 0, r.output[-3000:]
        printing["torchrun"].append(r.ended - min(r.marks["printing"]))
        return r.wall

    el = Elastic.warm(d, env={"ELASTIC_NB_WIDGETS": "1"})
    try:
        supervisor = supervisor_of(el.kernel.pid)

        def elastic() -> float:
            k, s = PeakMemory(el.kernel.pid), PeakMemory(supervisor.pid)
            idle["k"].append(k.base_pss / 2**20)
            idle["s"].append(s.base_pss / 2**20)
            r = el.run(f"--nproc {NPROC}", BODY)
            (k_rss, k_pss), (s_rss, s_pss) = k.stop(), s.stop()
            for key, v in (("k_rss", k_rss), ("k_pss", k_pss), ("s_rss", s_rss), ("s_pss", s_pss)):
                mem[key].append(v)
            ex = r.execution
            assert ex is not None and ex.error is None, r.output[-3000:]
            printing["elastic_nb"].append(r.ended - min(r.marks["printing"]))
            times = sorted(
                m["header"]["date"].timestamp() for m in ex.messages if m["msg_type"] in UI
            )
            rates.append(max(sum(1 for u in times if t <= u < t + 1.0) for t in times))
            job = ex.job_id
            for rank in range(NPROC):
                log = Path(el.cache, "elastic_nb", "runs", job, "attempt-0", f"rank-{rank}.out")
                assert sum(1 for _ in log.open()) == LINES  # every line on disk
            el.wait_warm()  # the next warm-up must not run beside torchrun's turn
            return r.wall

        xs, ys = alternate(n, elastic, baseline)
        assert supervisor.is_running(), "one supervisor served every run"
    finally:
        el.shutdown()
    mx, my = median(xs), median(ys)
    print(
        "| benchmark | elastic_nb: median (min-max) | torchrun: median (min-max) "
        "| ratio (medians) | target | runs |"
    )
    print("| --- | --- | --- | --- | --- | --- |")
    print(
        f"| P5 log flood, 4 ranks import torch and print {LINES:,} lines each: start -> end "
        f"| {spread(xs)} | {spread(ys)} | {mx / my:.2f}x | <= 1.3x | {len(xs)} |"
    )
    px, py = median(printing["elastic_nb"]), median(printing["torchrun"])
    print(
        f"| P5 the same, from the first rank's first line -> end (start-up left out) "
        f"| {spread(printing['elastic_nb'])} | {spread(printing['torchrun'])} | {px / py:.2f}x "
        f"| - | {len(xs)} |"
    )
    print(
        f"| P5 messages to the notebook, most in any 1 s (dashboard, every kind) "
        f"| {spread(rates, 'msg/s', 0)} | - | - | <= 10 msg/s | {len(rates)} |"
    )
    for key, name in (("k", "kernel"), ("s", "supervisor")):
        print(
            f"| P5 {name} peak memory over idle (idle PSS {median(idle[key]):.0f} MiB): "
            f"RSS / PSS | {spread(mem[key + '_rss'], 'MiB', 1)} / "
            f"{spread(mem[key + '_pss'], 'MiB', 1)} | - | - | bounded | {len(xs)} |"
        )


if __name__ == "__main__":
    main()
