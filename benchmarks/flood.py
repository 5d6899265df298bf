"""P5: log flood. 4 ranks print 100,000 lines each.

elastic_nb, under the live dashboard (the heavier path for the kernel): cell start -> the cell's
end, with every line in the run directory; the most messages the notebook received in any one
second (every kind: widget opens, deltas, snapshots, streams); the kernel's peak memory over
its idle size. torchrun: the same script with the ranks' output
redirected to files, start -> exit.
"""

from __future__ import annotations

import threading
from pathlib import Path

import psutil
from common import Elastic, alternate, bench_dir, median, runs, torchrun

LINES = 100_000
BODY = f"""import os
r = os.environ['RANK']
for i in range({LINES}):
    print(f'rank {{r}} line {{i}}')
"""
NPROC = 4
UI = ("comm_msg", "stream", "display_data", "execute_result", "error", "comm_open")


class PeakRss:
    def __init__(self, pid: int) -> None:
        self._p = psutil.Process(pid)
        self.base = self._p.memory_info().rss
        self.peak = self.base
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self._p.memory_info().rss)

    def stop(self) -> float:
        self._stop.set()
        self._t.join()
        return (self.peak - self.base) / 2**20


def main() -> None:
    n = runs()
    d = bench_dir()
    rates: list[float] = []
    peaks: list[float] = []

    def baseline() -> float:
        r = torchrun(BODY, NPROC, d)
        assert r.returncode == 0, r.output[-3000:]
        return r.wall

    el = Elastic.warm(d, env={"ELASTIC_NB_WIDGETS": "1"})
    try:

        def elastic() -> float:
            peak = PeakRss(el.kernel.pid)
            r = el.run(f"--nproc {NPROC}", BODY)
            peaks.append(peak.stop())
            ex = r.execution
            assert ex is not None and ex.error is None, r.output[-3000:]
            times = sorted(
                m["header"]["date"].timestamp() for m in ex.messages if m["msg_type"] in UI
            )
            rates.append(max(sum(1 for u in times if t <= u < t + 1.0) for t in times))
            job = ex.job_id
            for rank in range(NPROC):
                log = Path(el.cache, "elastic_nb", "runs", job, "attempt-0", f"rank-{rank}.out")
                assert sum(1 for _ in log.open()) == LINES  # every line on disk
            el.wait_warm()
            return r.wall

        xs, ys = alternate(n, elastic, baseline)
    finally:
        el.shutdown()
    mx, my = median(xs), median(ys)
    print("| benchmark | elastic_nb (median) | torchrun (median) | ratio | target | runs |")
    print("| --- | --- | --- | --- | --- | --- |")
    print(
        f"| P5 log flood, 4 x {LINES:,} lines: start -> end | {mx:.2f} s | {my:.2f} s | {mx / my:.2f}x | <= 1.3x | {len(xs)} |"
    )
    print(
        f"| P5 messages to the notebook, most in any 1 s (dashboard, every kind) | {median(rates):.0f} msg/s (max {max(rates)}) | - | - | <= 10 msg/s | {len(rates)} |"
    )
    print(
        f"| P5 kernel peak memory over idle | {median(peaks):.1f} MiB (max {max(peaks):.1f}) | - | - | bounded | {len(peaks)} |"
    )


if __name__ == "__main__":
    main()
