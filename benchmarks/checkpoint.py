"""P14: checkpoints. A ~100M-parameter model (24 x Linear(2048, 2048), DDP) with its Adam state,
on 2 ranks (CPU, gloo), saved and loaded with elastic_nb.checkpoint and, in the same run, the way
a user writes it without: torch.save by rank 0, then torch.load and load_state_dict on every rank
(PyTorch's DDP tutorial). Then the cost of an async save to training: the steps run while one is
written, against steps with no save.

Standalone: no kernel; `torchrun --standalone --nproc-per-node 2` runs this file with --worker, and
rank 0 hands its measurements back in a JSON file. Each side's time is from a barrier to a barrier
(the moment every rank can go on), and starts with nothing of the side before still under way: no
dirty page left to write (os.sync), and no file of an earlier save still being removed (elastic_nb
removes the step before with keep=1 in a thread of rank 0, which the next side would otherwise pay
for; torch.save's file is removed right after its turn, so that it does not pay for truncating it
either, and so that the pages both sides' removals free have aged alike when the next turn writes:
see Freed pages, below). Both sides write the same bytes (the model and Adam's two moments) to the
same disk. elastic_nb's default save does not fsync, as torch.save does not; the fsync rows compare
the two made durable (every file on disk before the save returns). The sides take turns, the same
number of each, in pairs A/B then B/A: each ratio row also gives the median of the pairs' own
ratios, which a machine's load drifting between pairs moves less.

The async rows: steps while an async save is written (its writer process niced and paused
three quarters of the time beside training, elastic_nb/checkpoint/writer.py), against steps with
no save, phases alternating. At most MAX_STEPS_DURING steps a save (then wait(), which lifts the
writer's pauses): on a machine other processes keep busy, a niced writer can take minutes. Once
the save is committed, the removal of the step before it is waited for, so that it falls into
neither.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS, WIDTH, BATCH = 24, 2048, 16  # 100.7M parameters
# Freed pages. Where memory a process frees goes back to the machine's host (a VM's free page
# reporting, as on the Firecracker VM these numbers came from: virtio_balloon's REPORTING feature),
# a page the kernel hands out again is faulted back in by the host on its first touch: 200 MB/s
# here, against 3 GB/s for a page still backed. A save's page cache is such pages. Removed just
# before its turn (as torch.save's file was, until 2026-11-26), a side rewrites into pages still
# backed; removed a turn earlier (as elastic_nb's step before is, by keep=1, once its save is
# committed), the pages have gone back meanwhile. Each side's files are therefore removed right
# after its own turn: torch.save's median went from 0.87 s to 2.09 s, elastic_nb's from 2.03 s to
# 1.76 s (benchmarks/README.md, P14).
BASELINE_STEPS = 4  # steps with no save, per run, to set the async rows against
MAX_STEPS_DURING = 20  # steps beside one async save, at most
PAIRS = 2  # of each save and load comparison per run (A/B, then B/A)


def worker(runs: int, out: str) -> None:
    """Every rank runs this; rank 0 writes what it measured to `out`."""
    sys.path.insert(0, str(ROOT))
    import torch
    import torch.distributed as dist
    from torch import nn

    from elastic_nb import checkpoint
    from elastic_nb.checkpoint.directory import wait_removals

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])
    )
    opt = torch.optim.Adam(model.parameters(), lr=1e-5)
    params = sum(p.numel() for p in model.parameters())

    def step() -> float:
        t = time.perf_counter()
        loss = model(torch.randn(BATCH, WIDTH)).square().mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        return time.perf_counter() - t

    step()  # Adam's state exists from here on: 3x the parameters to save
    scratch = Path(os.environ["BENCH_TMP"])  # made by the driver, for this run alone
    ours = checkpoint.Checkpoints(scratch / "elastic_nb")
    theirs = scratch / "torch.pt"  # the same disk

    def timed(fn: object) -> float:
        wait_removals()
        os.sync()
        dist.barrier()
        t = time.perf_counter()
        fn()  # type: ignore[operator]
        dist.barrier()
        return time.perf_counter() - t

    def torch_save(sync: bool) -> None:
        if rank == 0:
            state = {"model": model.module.state_dict(), "optim": opt.state_dict(), "step": 0}
            torch.save(state, theirs)
            if sync:
                with open(theirs, "rb+") as f:
                    os.fsync(f.fileno())

    def torch_load() -> None:
        state = torch.load(theirs, map_location="cpu", weights_only=True)
        model.module.load_state_dict(state["model"])
        opt.load_state_dict(state["optim"])

    result: dict[str, list[float]] = {}
    numbers = itertools.count()  # a checkpoint's steps only grow

    def add(name: str, value: float) -> None:
        result.setdefault(name, []).append(value)

    sides = {
        "save": lambda: ours.save(next(numbers), model, opt, keep=1),
        "torch_save": lambda: torch_save(False),
        "save_fsync": lambda: ours.save(next(numbers), model, opt, keep=1, fsync=True),
        "torch_save_fsync": lambda: torch_save(True),
        "load": lambda: ours.load(model, opt),
        "torch_load": torch_load,
    }
    for i in range(runs * PAIRS):
        for pair in (
            ("save", "torch_save"),
            ("save_fsync", "torch_save_fsync"),
            ("load", "torch_load"),
        ):
            for name in pair if i % 2 == 0 else pair[::-1]:
                add(name, timed(sides[name]))
                if name == "torch_save" and rank == 0:
                    result["bytes_torch"] = [theirs.stat().st_size]
                if name in ("torch_save", "torch_load") and rank == 0:
                    # Right after its turn (the fsync save's, once torch_load has read it),
                    # outside the timed part, as elastic_nb removes the step before once its
                    # save is committed (keep=1): see Freed pages, above.
                    theirs.unlink()

    # Async: steps while a save is written, against steps with no save. Every rank steps while
    # any rank's save is in flight (DDP needs the same number of steps on every rank).
    def in_flight() -> bool:
        flag = torch.tensor([int(ours.in_flight)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def baseline() -> None:
        for _ in range(BASELINE_STEPS):
            add("step", step())

    def during() -> None:
        dist.barrier()
        t = time.perf_counter()
        ours.save(next(numbers), model, opt, keep=1, async_save=True)
        blocked = time.perf_counter() - t
        steps = []
        while len(steps) < MAX_STEPS_DURING and in_flight():
            steps.append(step())
        add("cut_short", int(ours.in_flight))  # this rank's: rank 0's is reported
        ours.wait()
        add("blocked", blocked)
        add("written", time.perf_counter() - t)
        wait_removals()
        dist.barrier()
        add("steps_during", len(steps))
        result.setdefault("step_during", []).extend(steps)
        # the save's whole cost to the steps beside it, its blocking part (staging) included
        add("step_amortized", (blocked + sum(steps)) / max(len(steps), 1))

    for i in range(runs):
        for fn in (baseline, during) if i % 2 == 0 else (during, baseline):
            fn()
    ours.close()
    if rank == 0:
        result["params"] = [params]
        result["bytes_ours"] = [
            sum(f.stat().st_size for f in (scratch / "elastic_nb").rglob("*") if f.is_file())
        ]
        Path(out).write_text(json.dumps(result))
    dist.destroy_process_group()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--worker", metavar="OUT", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.runs, args.worker)
        return
    from common import median, spread

    tmp = tempfile.mkdtemp(prefix="elastic_nb-bench-p14-")
    out = os.path.join(tmp, "result.json")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "BENCH_TMP": tmp}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    try:
        subprocess.run(
            [*cmd, __file__, "--runs", str(args.runs), "--worker", out], env=env, check=True
        )
        r = json.loads(Path(out).read_text())
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # GBs of checkpoints
    print(
        f"{r['params'][0] / 1e6:.1f}M parameters + Adam: {r['bytes_ours'][0] / 1e9:.2f} GB "
        f"(elastic_nb), {r['bytes_torch'][0] / 1e9:.2f} GB (torch.save); 2 ranks, gloo, "
        f"{os.cpu_count()} CPU cores; {args.runs} runs"
    )
    print(
        "| benchmark | elastic_nb.checkpoint: median (min-max) | baseline: median (min-max) "
        "| elastic_nb/baseline (medians) | target | samples |\n| --- | --- | --- | --- | --- | --- |"
    )

    def row(name: str, xs: list[float], ys: list[float], target: str, paired: bool = False) -> None:
        ratio = f"{median(xs) / median(ys):.2f}x"
        if paired:  # the turns of a pair are next to each other: their ratio, pair by pair
            ratios = [x / y for x, y in zip(xs, ys, strict=True)]
            ratio += f" (pairs: {median(ratios):.2f}x, {min(ratios):.2f}-{max(ratios):.2f})"
        print(
            f"| {name} | {spread(xs)} | {spread(ys)} | {ratio} | {target} | {len(xs)}/{len(ys)} |"
        )

    row("P14 save (vs torch.save by rank 0)", r["save"], r["torch_save"], "<= 1.0x", True)
    row(
        "P14 save, fsync=True (vs torch.save + fsync)",
        r["save_fsync"],
        r["torch_save_fsync"],
        "",
        True,
    )
    row(
        "P14 load (vs torch.load + load_state_dict on every rank)",
        r["load"],
        r["torch_load"],
        "",
        True,
    )
    row(
        "P14 training step while an async save is written (vs no save)",
        r["step_during"],
        r["step"],
        "<= 1.10x",
    )
    row(
        "P14 the same, the save's blocking part (staging) spread over those steps",
        r["step_amortized"],
        r["step"],
        "",
    )
    print(
        f"async save: save() blocks {spread(r['blocked'])}, written and committed after "
        f"{spread(r['written'])}, {median(r['steps_during']):.0f} steps meanwhile (median; "
        f"{sum(r['cut_short']):.0f} of {len(r['cut_short'])} saves waited for after "
        f"{MAX_STEPS_DURING} steps)"
    )


if __name__ == "__main__":
    main()
