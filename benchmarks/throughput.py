"""P6: training throughput. A small DDP model on the CPU, 2 ranks, a fixed number of steps.

Steps per second measured inside the ranks after a warm-up, under %%elastic and under torchrun:
what elastic_nb costs a running job (nothing, if the supervisor's tailing and the dashboard
stay out of the way).

P15, what the observer costs while those ranks train: the CPU time the supervisor (log tailing,
flight-recorder probes, the desync watch, memory samples, the zombie watchdog), the kernel (the
dashboard) and each rank's probe thread (which answers the probes) used over the timed steps,
as a share of one core per rank.

--device cuda: the same loop on GPUs, both sides (NCCL; 2 ranks on one GPU share it, as
common.CUDA_DEVICE says). --steps N: fewer timed steps (a short run).
"""

from __future__ import annotations

import re
import threading
import time

import psutil
from common import (
    CUDA_DEVICE,
    CUDA_INIT,
    HEADER,
    Elastic,
    alternate,
    bench_dir,
    median,
    parser,
    row,
    spread,
    torchrun,
)

WARMUP, STEPS = 30, 1500


def body(device: str = "cpu", steps: int = STEPS) -> str:
    """The ranks' loop; `device` "cuda": the model and the data on the rank's GPU, NCCL, and the
    GPU's queue drained where the clock is read (--device cuda)."""
    if device == "cuda":
        setup = CUDA_DEVICE + CUDA_INIT + "sync = torch.cuda.synchronize\n"
    else:
        setup = "device = torch.device('cpu')\ndist.init_process_group()\nsync = lambda: None\n"
    return f"""import time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
{setup}torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)).to(device))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 256, device=device), torch.randint(0, 10, (64,), device=device)
def probe_cpu():
    import os, threading
    ticks = 0
    for t in threading.enumerate():
        if t.name == 'elastic_nb-probe':  # elastic_nb's rank only
            with open(f'/proc/self/task/{{t.native_id}}/stat') as f:
                fields = f.read().rsplit(')', 1)[1].split()
            ticks += int(fields[11]) + int(fields[12])
    return ticks / os.sysconf('SC_CLK_TCK')
for step in range({WARMUP + steps}):
    if step == {WARMUP}:
        sync()
        mark('t0')
        p0 = probe_cpu()
        t0 = time.perf_counter()
    if step % 100 == 0:
        print('step', step, flush=True)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
sync()
mark('rate', {steps} / (time.perf_counter() - t0))
mark('probe', probe_cpu() - p0)
mark('t1')
dist.destroy_process_group()
"""


BODY = body()
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
    p = parser(cuda=True)
    p.add_argument("--steps", type=int, default=STEPS, help="timed steps a run")
    args = p.parse_args()
    n, code = args.runs, body(args.device, args.steps)
    d = bench_dir()

    def rate(r: object) -> float:
        rates = r.marks.get("rate", [])  # type: ignore[attr-defined]
        assert len(rates) == NPROC, r.output[-3000:]  # type: ignore[attr-defined]
        return sum(rates) / NPROC

    el = Elastic.warm(d, env={"ELASTIC_NB_WIDGETS": "1"})
    observer: dict[str, list[float]] = {"supervisor": [], "kernel": [], "probe": []}
    idle: dict[str, list[float]] = {"supervisor": [], "kernel": []}
    aborted: list[int | None] = []  # torchrun's exits after its ranks' last mark, when not 0
    try:
        status = el.kernel.ok("%elastic status").stdout
        supervisor = psutil.Process(int(re.search(r"supervisor: pid (\d+)", status)[1]))  # type: ignore[index]
        kernel = psutil.Process(el.kernel.pid)

        def baseline() -> float:
            # The same sampler runs in torchrun's turns (both sides pay it), and says what the
            # idle supervisor and kernel take meanwhile.
            with Sampler({"supervisor": supervisor, "kernel": kernel}) as sampled:
                r = torchrun(code, NPROC, d)
            if r.returncode != 0:
                # torchrun's gloo ranks sometimes abort at their exit, once every mark is written
                # ("terminate called without an active exception"; 2 of 10 runs on this loaded
                # machine): the steps were timed whole, so the run counts, and the table says so.
                assert len(r.marks.get("t1", [])) == NPROC, r.output[-3000:]
                aborted.append(r.returncode)
            t0, t1 = max(r.marks["t0"]), min(r.marks["t1"])
            for key, used in sampled.between(t0, t1).items():
                idle[key].append(used / (t1 - t0) / NPROC * 100)
            return rate(r)

        def elastic() -> float:
            # The supervisor's and the kernel's CPU, sampled while the cell runs,
            # taken between the ranks' marks around the timed steps: what runs while ranks
            # train, not the job's start and end (P1 and P2 measure those).
            with Sampler({"supervisor": supervisor, "kernel": kernel}) as sampled:
                r = el.run(f"--nproc {NPROC}", code)
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
    if args.device == "cuda":
        print("On GPUs: the model and data on the ranks' GPUs, NCCL (--device cuda).")
    print(HEADER)
    print(
        row(
            f"P6 training throughput: DDP MLP, 2 ranks, {args.steps} steps (higher is better)",
            xs,
            ys,
            ">= 0.98x",
            unit="steps/s",
        )
    )
    if aborted:
        print(
            f"torchrun's ranks ended in an abort after the timed steps in {len(aborted)} of {n} "
            f"runs (exits {aborted}): their figures are in the table"
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
