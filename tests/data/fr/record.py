"""Record real gloo flight-recorder dumps for tests/test_desync.py (run: python record.py).

Each scenario runs 2 gloo ranks; every rank writes torch's own dump (pickled, the format NCCL
writes to TORCH_FR_DUMP_TEMP_FILE on a timeout) as <scenario>/fr-rank-<R>: a rank that
finishes the cell when it finishes, a rank that waits from a thread while its main thread is
blocked in the collective. Cells run under the file name CELL, as the worker runs them.
"""

from __future__ import annotations

import contextlib
import os
import threading
from datetime import timedelta
from pathlib import Path

import torch.multiprocessing as mp

HERE = Path(__file__).resolve().parent
CELL = "/run/elastic_nb/job/cell.py"

SCENARIOS = {
    # Rank 1 catches an OOM and skips backward() once: it finishes one all-reduce early.
    "ddp_skip": """
import torch, torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP
model = DDP(torch.nn.Linear(8, 8))
for step in range(3):
    loss = model(torch.randn(4, 8)).sum()
    if rank == 1 and step == 1:
        continue
    loss.backward()
""",
    # Rank 1 skips an all_reduce and waits in a barrier: two ops at the same number.
    "mismatch": """
import torch, torch.distributed as dist
x = torch.ones(1)
dist.all_reduce(x)
if rank == 0:
    dist.all_reduce(x)
dist.barrier()
""",
    # Rank 1 is slow: rank 0 waits in all_reduce #2 while rank 1 still computes.
    "slow": """
import time, torch, torch.distributed as dist
x = torch.ones(1)
dist.all_reduce(x)
if rank == 1:
    time.sleep(3)
dist.all_reduce(x)
""",
}


def _dump(path: Path) -> None:
    from torch._C._distributed_c10d import _dump_fr_trace

    path.write_bytes(_dump_fr_trace(True, True, False))


def _rank(rank: int, scenario: str, port: int) -> None:
    import torch._inductor  # noqa: F401  (stack traces in the dump need it; see recorder.py)
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=timedelta(seconds=6))
    out = HERE / scenario / f"fr-rank-{rank}"
    # Every rank dumps at 2 s: a rank that finished the cell by then (its last state), a rank
    # that waits from this thread while its main thread sits in the collective.
    timer = threading.Timer(2.0, _dump, (out,))
    timer.start()
    with contextlib.suppress(RuntimeError):  # gloo's timeout, or its peer gone, after the dump
        exec(compile(SCENARIOS[scenario], CELL, "exec"), {"rank": rank})
    timer.join()
    os._exit(0)


def main() -> None:
    for port, scenario in enumerate(SCENARIOS, start=29611):
        (HERE / scenario).mkdir(exist_ok=True)
        mp.start_processes(_rank, args=(scenario, port), nprocs=2, start_method="spawn")
        print("recorded", scenario)


if __name__ == "__main__":
    main()
