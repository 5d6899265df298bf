"""The quickstart's all_reduce cell under %%elastic --nproc 4 vs torchrun on the same code.

elastic_nb: from the execute request to the kernel idle again (cell wall time, result shown).
torchrun:   `torchrun --standalone --nproc-per-node 4 script.py`, process wall time.
"""

from __future__ import annotations

import argparse

from common import HEADER, alternate, elastic_kernel, row, torchrun, workdir

BODY = """import torch, torch.distributed as dist
dist.init_process_group()
x = torch.ones(1) * (dist.get_rank() + 1)
dist.all_reduce(x)
print(dist.get_rank(), x.item())
dist.destroy_process_group()  # without it torch 2.13's gloo sometimes aborts at interpreter exit
"""


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    wd = workdir()
    kernel = elastic_kernel(wd)
    try:
        cell = "%%elastic --nproc 4\n" + BODY + "x.item()\n"

        def elastic() -> float:
            ex = kernel.ok(cell)
            assert ex.result == "10.0", ex.stdout
            return ex.seconds

        xs, ys = alternate(args.runs, elastic, lambda: torchrun(BODY, 4, wd))
    finally:
        kernel.shutdown()
    print(HEADER)
    print(row("quickstart cell, 4 ranks, init + all_reduce (wall)", xs, ys))


if __name__ == "__main__":
    main()
