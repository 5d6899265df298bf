"""P6: training throughput. A small DDP model on the CPU, 2 ranks, a fixed number of steps.

Steps per second measured inside rank 0 after a warm-up, under %%elastic and under torchrun:
what elastic_nb costs a running job (nothing, if the supervisor's tailing and the dashboard
stay out of the way).
"""

from __future__ import annotations

from common import HEADER, Elastic, alternate, bench_dir, row, runs, torchrun

WARMUP, STEPS = 30, 1500
BODY = f"""import time, torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group()
torch.manual_seed(0)
model = DDP(torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(64, 256), torch.randint(0, 10, (64,))
for step in range({WARMUP + STEPS}):
    if step == {WARMUP}:
        t0 = time.perf_counter()
    if step % 100 == 0:
        print('step', step, flush=True)
    opt.zero_grad()
    torch.nn.functional.cross_entropy(model(x), y).backward()
    opt.step()
mark('rate', {STEPS} / (time.perf_counter() - t0))
dist.destroy_process_group()
"""
NPROC = 2


def main() -> None:
    n = runs()
    d = bench_dir()

    def rate(r: object) -> float:
        rates = r.marks.get("rate", [])  # type: ignore[attr-defined]
        assert len(rates) == NPROC, r.output[-3000:]  # type: ignore[attr-defined]
        return sum(rates) / NPROC

    def baseline() -> float:
        r = torchrun(BODY, NPROC, d)
        assert r.returncode == 0, r.output[-3000:]
        return rate(r)

    el = Elastic.warm(d, env={"ELASTIC_NB_WIDGETS": "1"})
    try:

        def elastic() -> float:
            r = el.run(f"--nproc {NPROC}", BODY)
            assert r.execution is not None and r.execution.error is None, r.output[-3000:]
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


if __name__ == "__main__":
    main()
