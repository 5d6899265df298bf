"""P1 / P1c / P1b: how soon every rank runs the cell with its process group up; and the memory
the warm processes hold between cells.

Cell start -> the last of 4 ranks past `dist.init_process_group()`, on the quickstart's code.
Warm (P1): a cell after an earlier one, the next launcher warmed up in between (as between two
cells a person runs). Back to back (P1c): a cell sent the moment the previous cell ended, with
no pause (as Run All sends them). First cell (P1 first): a fresh kernel's first cell, run once
%load_ext has warmed up (a person writing the cell). Cold (P1b): the first cell sent the moment
%load_ext returns. torchrun: the same script, `torchrun --standalone --nproc-per-node 4`, from
its start. No side's turn runs beside the other's leftovers: the next warm-up has finished (or
the previous kernel is gone, every process of it) before torchrun's.

--device cuda: the same on GPUs, both sides: each rank sets its GPU and brings NCCL's
communicator up in init_process_group (common.CUDA_DEVICE: ranks share GPUs when there are fewer
GPUs than ranks). --warm-only: P1 (and P1m) only.

Memory (P1m): what the warm processes (the zygote, the idle launcher, its fork server) hold
between cells, PSS (shared pages counted by their share) and RSS, as `%elastic status` reports
it; torchrun holds nothing between runs.
"""

from __future__ import annotations

import re

from common import (
    CUDA_DEVICE,
    CUDA_INIT,
    HEADER,
    Elastic,
    alternate,
    bench_dir,
    parser,
    row,
    spread,
    torchrun,
)

# The barrier: a rank that destroys its group the moment its own init returns can close a gloo
# pair that a slower rank is still finishing (connectFullMesh: "Connection closed by peer",
# seen once here on a loaded machine); after the mark, so it is not measured.
BODY = """import torch.distributed as dist
dist.init_process_group()
mark('ready')
dist.barrier()
dist.destroy_process_group()
"""
CUDA_BODY = CUDA_DEVICE + BODY.replace("dist.init_process_group()\n", CUDA_INIT)
assert CUDA_BODY != CUDA_DEVICE + BODY
NPROC = 4


def warm_memory(el: Elastic) -> tuple[float, float]:
    """(PSS, RSS) of the warm processes in MB, from %elastic status."""
    status = el.kernel.ok("%elastic status").stdout
    m = re.search(r"warm launcher: pid \d+, ready, (\d+) MB \(PSS; RSS (\d+) MB\)", status)
    assert m, status
    return float(m.group(1)), float(m.group(2))


def main() -> None:
    p = parser(cuda=True)
    p.add_argument("--warm-only", action="store_true", help="P1 and P1m only")
    args = p.parse_args()
    n, body = args.runs, CUDA_BODY if args.device == "cuda" else BODY
    d = bench_dir()

    def baseline() -> float:
        r = torchrun(body, NPROC, d)
        assert r.returncode == 0, r.output[-3000:]
        return r.after_start("ready", NPROC)

    pss: list[float] = []
    rss: list[float] = []
    el = Elastic(d)
    try:
        el.run(f"--nproc {NPROC}", body)  # the first cell: not counted

        def warm() -> float:
            el.wait_warm()
            took = el.run(f"--nproc {NPROC}", body).after_start("ready", NPROC)
            el.wait_warm()  # the next warm-up must not run beside torchrun's turn
            memory = warm_memory(el)
            pss.append(memory[0])
            rss.append(memory[1])
            return took

        warm_x, warm_y = alternate(n, warm, baseline)

        def back_to_back() -> float:
            el.wait_warm()
            el.run(f"--nproc {NPROC}", body)  # the cell before: not counted
            took = el.run(f"--nproc {NPROC}", body).after_start("ready", NPROC)
            el.wait_warm()
            return took

        if not args.warm_only:
            all_x, all_y = alternate(n, back_to_back, baseline)
    finally:
        el.shutdown()

    def first(wait: bool) -> float:
        fresh = Elastic(d)
        try:
            if wait:
                fresh.wait_warm()
            took = fresh.run(f"--nproc {NPROC}", body).after_start("ready", NPROC)
            fresh.wait_warm()
            return took
        finally:
            fresh.shutdown()

    if not args.warm_only:
        first_x, first_y = alternate(n, lambda: first(True), baseline)
        cold_x, cold_y = alternate(n, lambda: first(False), baseline)
    if args.device == "cuda":
        print("On GPUs: NCCL, its communicator up in init_process_group (--device cuda).")
    print(HEADER)
    print(
        row(
            "P1 warm launch: cell start -> 4 ranks past init_process_group",
            warm_x,
            warm_y,
            "<= 0.15x",
        )
    )
    if not args.warm_only:
        print(
            row(
                "P1c back-to-back warm launch: the same, the cell sent the moment the previous one "
                "ended (Run All)",
                all_x,
                all_y,
                "<= 0.15x",
            )
        )
        print(
            row(
                "P1 first cell, run once %load_ext has warmed up (a fresh kernel)",
                first_x,
                first_y,
                "<= 0.15x",
            )
        )
        print(
            row(
                "P1b cold launch: the first cell, sent the moment %load_ext returns",
                cold_x,
                cold_y,
                "<= 1.1x",
            )
        )
    print(
        f"| P1m warm processes between cells (zygote, launcher, fork server): PSS / RSS "
        f"| {spread(pss, 'MB', 0)} / {spread(rss, 'MB', 0)} | nothing held | - | <= 250 MB PSS "
        f"| {len(pss)} |"
    )


if __name__ == "__main__":
    main()
