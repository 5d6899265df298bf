"""P1 / P1b: how soon every rank runs the cell with its process group up.

Cell start -> the last of 4 ranks past `dist.init_process_group()`, on the quickstart's code.
Warm (P1): a cell after an earlier one, the next launcher warmed up in between (as between two
cells a person runs). Run All (P1, back to back): a cell sent the moment the previous cell
ended, with no pause for the next launcher to warm up (as Run All sends them). Cold (P1b): the
first cell after the kernel started. torchrun: the same script, `torchrun --standalone
--nproc-per-node 4`, from its start. No side's turn runs beside the other's leftovers: the next
warm-up has finished (or the previous kernel is gone, every process of it) before torchrun's.
"""

from __future__ import annotations

from common import HEADER, Elastic, alternate, bench_dir, row, runs, torchrun

BODY = """import torch.distributed as dist
dist.init_process_group()
mark('ready')
dist.destroy_process_group()
"""
NPROC = 4


def main() -> None:
    n = runs()
    d = bench_dir()

    def baseline() -> float:
        r = torchrun(BODY, NPROC, d)
        assert r.returncode == 0, r.output[-3000:]
        return r.after_start("ready", NPROC)

    el = Elastic(d)
    try:
        el.run(f"--nproc {NPROC}", BODY)  # the cold first cell: not counted

        def warm() -> float:
            el.wait_warm()
            took = el.run(f"--nproc {NPROC}", BODY).after_start("ready", NPROC)
            el.wait_warm()  # the next warm-up must not run beside torchrun's turn
            return took

        warm_x, warm_y = alternate(n, warm, baseline)

        def run_all() -> float:
            el.wait_warm()
            el.run(f"--nproc {NPROC}", BODY)  # the cell before: warm, not counted
            took = el.run(f"--nproc {NPROC}", BODY).after_start("ready", NPROC)
            el.wait_warm()
            return took

        all_x, all_y = alternate(n, run_all, baseline)
    finally:
        el.shutdown()

    def cold() -> float:
        fresh = Elastic(d)
        try:
            return fresh.run(f"--nproc {NPROC}", BODY).after_start("ready", NPROC)
        finally:
            fresh.shutdown()

    cold_x, cold_y = alternate(n, cold, baseline)
    print(HEADER)
    print(
        row(
            "P1 warm launch: cell start -> 4 ranks past init_process_group",
            warm_x,
            warm_y,
            "<= 0.15x",
        )
    )
    print(
        row(
            "P1 Run All: the same, the cell sent the moment the previous cell ended (no pause)",
            all_x,
            all_y,
            "-",
        )
    )
    print(row("P1b cold launch (first cell after kernel start)", cold_x, cold_y, "<= 1.1x"))


if __name__ == "__main__":
    main()
