"""P6: training throughput. A small DDP model on the CPU, 2 ranks, a fixed number of steps.

Steps per second measured inside the ranks after a warm-up, under %%elastic and under torchrun:
what elastic_nb costs a running job (nothing, if the supervisor's tailing and the dashboard
stay out of the way).

P15, what the observer costs while those ranks train: the CPU time the supervisor (log tailing,
flight-recorder probes, the desync watch, memory samples, the zombie watchdog), the kernel (the
dashboard) and each rank's probe thread (which answers the probes) used over the timed steps,
as a share of one core per rank.
"""

from __future__ import annotations

import re
import threading
import time

import psutil
from common import HEADER, Elastic, alternate, bench_dir, median, row, runs, spread, torchrun

WARMUP, STEPS = 30, 1500
BODY = f"""import time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
def probe_cpu():
    import os, threading
    ticks = 0
    for t in threading.enumerate():
        if t.name == 'elastic_nb-probe':  # elastic_nb's rank only
            with open(f'/proc/self/task/{{t.native_id}}/stat') as f:
                fields = f.read().rsplit(')', 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf('SC_CLK_TCK')
for step in range({WARMUP + STEPS}):
    if step == {WARMUP}:
        mark('t0')
        p0 = probe_cpu()
        t0 = time.perf_counter()
    if step % 100 == 0:
        print('step', step, flush=True)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
mark('rate', {STEPS} / (time.perf_counter() - t0))
mark('probe', probe_cpu() - p0)
mark('t1')
dist.destroy_process_group()
"""
NPROC = 2
SAMPLE_S = 0.25


class Sampler:
    """Processes' CPU time (user + system), read every SAMPLE_S by a thread (a cost of its own on
    the benchmark's side, kept small: the ranks use both cores)."""

    def __init__(self, procs: dict[str, psutil.Process]) -> None:
        self._procs = procs
        self._samples: list[tuple[float, dict[str, float]]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self._sample()  # one after the end, however soon the end came

    def _run(self) -> None:
        while not self._stop.wait(SAMPLE_S):
            self._sample()

    def _sample(self) -> None:
        now = time.time()
        used: dict[str, float] = {}
        for key, p in self._procs.items():
            t = p.cpu_times()
            used[key] = t.user + t.system
        self._samples.append((now, used))

    def between(self, t0: float, t1: float) -> dict[str, float]:
        """CPU seconds each process used from the last sample before t0 to the first after t1."""
        first = max((s for s in self._samples if s[0] <= t0), key=lambda s: s[0])
        last = min((s for s in self._samples if s[0] >= t1), key=lambda s: s[0])
        return {key: last[1][key] - first[1][key] for key in first[1]}


def main() -> None:
    n = runs()
    d = bench_dir()

    def rate(r: object) -> float:
        rates = r.marks.get("rate", [])  # type: ignore[attr-defined]
        assert len(rates) == NPROC, r.output[-3000:]  # type: ignore[attr-defined]
        return sum(rates) / NPROC

    el = Elastic.warm(d, env={"ELASTIC_NB_WIDGETS": "1"})
    observer: dict[str, list[float]] = {"supervisor": [], "kernel": [], "probe": []}
    idle: dict[str, list[float]] = {"supervisor": [], "kernel": []}
    try:
        status = el.kernel.ok("%elastic status").stdout
        supervisor = psutil.Process(int(re.search(r"supervisor: pid (\d+)", status)[1]))  # type: ignore[index]
        kernel = psutil.Process(el.kernel.pid)

        def baseline() -> float:
            # The same sampler runs in torchrun's turns (both sides pay it), and says what the
            # idle supervisor and kernel take meanwhile.
            with Sampler({"supervisor": supervisor, "kernel": kernel}) as sampled:
                r = torchrun(BODY, NPROC, d)
            assert r.returncode == 0, r.output[-3000:]
            t0, t1 = max(r.marks["t0"]), min(r.marks["t1"])
            for key, used in sampled.between(t0, t1).items():
                idle[key].append(used / (t1 - t0) / NPROC * 100)
            return rate(r)

        def elastic() -> float:
            # The supervisor's and the kernel's CPU, sampled while the cell runs,
            # taken between the ranks' marks around the timed steps: what runs while ranks
            # train, not the job's start and end (P1 and P2 measure those).
            with Sampler({"supervisor": supervisor, "kernel": kernel}) as sampled:
                r = el.run(f"--nproc {NPROC}", BODY)
            assert r.execution is not None and r.execution.error is None, r.output[-3000:]
            t0, t1 = max(r.marks["t0"]), min(r.marks["t1"])
            for key, used in sampled.between(t0, t1).items():
                observer[key].append(used / (t1 - t0) / NPROC * 100)
            observer["probe"].append(max(r.marks["probe"]) / (t1 - t0) * 100)
            el.wait_warm()
            return rate(r)

        xs, ys = alternate(n, elastic, baseline)
    finally:
        el.shutdown()
    print(HEADER)
    print(
        row(
            f"P6 training throughput: DDP MLP, 2 ranks, {STEPS} steps (higher is better)",
            xs,
            ys,
            ">= 0.98x",
            unit="steps/s",
        )
    )
    print(
        "\n| P15 the observer's CPU while 2 ranks train, % of a core per rank | median (min-max) "
        "| target | runs |\n| --- | --- | --- | --- |"
    )
    for key, what in (
        ("supervisor", "the supervisor (tailing, probes, desync watch, memory samples, watchdog)"),
        ("probe", "a rank's probe thread (its answers)"),
        ("kernel", "the kernel (the dashboard)"),
    ):
        print(f"| {what} | {spread(observer[key], unit='%')} | <= 1% | {len(observer[key])} |")
    total = median(observer["supervisor"]) + median(observer["probe"]) + median(observer["kernel"])
    print(f"P15: the observer costs {total:.2f}% of a core per rank (medians summed; target <= 1%)")
    print(
        f"(idle, while torchrun's ranks train: the supervisor {spread(idle['supervisor'], unit='%')}"
        f", the kernel {spread(idle['kernel'], unit='%')} of a core per rank)"
    )


if __name__ == "__main__":
    main()
