"""The quickstart's all_reduce cell under %%elastic --nproc 4 vs torchrun on the same code.

elastic_nb: from sending the cell to the kernel idle again, result shown: cold (the first cell
of a fresh kernel) and warm (a later cell, its launcher warmed up between the two).
torchrun: `torchrun --standalone --nproc-per-node 4 script.py`, start -> exit.
"""

from __future__ import annotations

from common import HEADER, Elastic, alternate, bench_dir, row, runs, torchrun

BODY = """import torch, torch.distributed as dist
dist.init_process_group()
x = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(x)
print(dist.get_rank(), x.item())
dist.destroy_process_group()  # without it torch 2.13's gloo sometimes aborts at interpreter exit
"""
CELL = BODY + "x.item()\n"


def main() -> None:
    n = runs()
    d = bench_dir()

    def baseline() -> float:
        r = torchrun(BODY, 4, d)
        assert r.returncode == 0, r.output[-3000:]
        return r.wall

    def cold() -> float:
        el = Elastic(d)
        try:
            r = el.run("--nproc 4", CELL)
            assert r.execution is not None and r.execution.result == "10.0", r.output
            return r.wall
        finally:
            el.shutdown()

    cold_x, cold_y = alternate(n, cold, baseline)
    el = Elastic(d)
    try:
        el.run("--nproc 4", CELL)
        el.wait_warm()

        def warm() -> float:
            r = el.run("--nproc 4", CELL)
            assert r.execution is not None and r.execution.result == "10.0", r.output
            el.wait_warm()
            return r.wall

        warm_x, warm_y = alternate(n, warm, baseline)
    finally:
        el.shutdown()
    print(HEADER)
    print(
        row(
            "quickstart cell, 4 ranks, init + all_reduce, wall (cold: first cell)",
            cold_x,
            cold_y,
            "-",
        )
    )
    print(
        row(
            "quickstart cell, 4 ranks, init + all_reduce, wall (warm: a later cell)",
            warm_x,
            warm_y,
            "-",
        )
    )


if __name__ == "__main__":
    main()
