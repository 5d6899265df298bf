"""P3b: desync diagnosis. DDP on 2 ranks; rank 1 catches an OOM and skips one backward(), so
it runs out of batches one gradient all-reduce early and leaves the cell while rank 0 waits in
its last one (flyte-sdk PR #698's pattern). Both sides run with their default timeouts.

Time from the moment rank 1 leaves the cell (marked as its loop ends) to the cell's error, which
must name rank 1 as the desync; torchrun: to the moment it exits, and the rank it blames.
"""

from __future__ import annotations

from common import (
    HEADER,
    Elastic,
    alternate,
    bench_dir,
    median,
    print_blamed,
    row,
    runs,
    torchrun,
    torchrun_root_rank,
)

BODY = """import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
dist.init_process_group()
model = DDP(torch.nn.Linear(32, 32))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
for step in range(20):
    loss = model(torch.randn(16, 32)).sum()
    if dist.get_rank() == 1 and step == 7:
        continue   # caught a CUDA OOM: skip this batch's backward()
    loss.backward()
    opt.step()
    opt.zero_grad()
if dist.get_rank() == 1:
    mark('left')
"""
NPROC = 2
BOUND_S = 300.0  # torchrun's side, should it hang (gloo's default timeout is 30 min)


def main() -> None:
    n = runs()
    d = bench_dir()
    blamed: dict[str, list[int | None]] = {"elastic_nb": [], "torchrun": []}

    def baseline() -> float:
        r = torchrun(BODY, NPROC, d, timeout=BOUND_S)
        assert r.returncode != 0, r.output[-3000:]
        blamed["torchrun"].append(torchrun_root_rank(r.output))
        return r.ended - r.marks["left"][0]

    el = Elastic.warm(d)
    try:

        def elastic() -> float:
            r = el.run(f"--nproc {NPROC}", BODY)
            ex = r.execution
            assert ex is not None and ex.ename == "JobFailed", r.output[-3000:]
            named = ex.error["evalue"].startswith("desync: rank 1 left the cell")
            blamed["elastic_nb"].append(1 if named else None)
            el.wait_warm()  # the next warm-up must not run beside torchrun's turn
            return r.ended - r.marks["left"][0]

        xs, ys = alternate(n, elastic, baseline)
    finally:
        el.shutdown()
    print(HEADER)
    print(
        row(
            "P3b desync: DDP rank 1 skips a backward() and leaves the cell -> the error "
            "naming it (default timeouts)",
            xs,
            ys,
            "<= 2 s, naming rank 1",
        )
    )
    print_blamed(blamed, 1)
    verdict = "meets" if median(xs) <= 2.0 else "misses"
    print(f"elastic_nb median {median(xs):.2f} s: {verdict} the 2 s target")


if __name__ == "__main__":
    main()
