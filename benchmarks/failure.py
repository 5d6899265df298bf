"""P2: failure detection. Rank 1 raises while ranks 0, 2, 3 wait in all_reduce.

Time from the raise (marked in rank 1) to the cell's error reaching the notebook, which must
name rank 1; torchrun: to the moment torchrun exits. Also shown: which rank each side blames
(torchrun's root cause uses whole-second timestamps and breaks ties by the lowest rank).

--device cuda: the same on GPUs, both sides: NCCL, the others wait on the GPU in the all_reduce
(NCCL's returns at once; a synchronize waits for it, as gloo's all_reduce waits inside the call).
"""

from __future__ import annotations

from common import (
    CUDA_DEVICE,
    CUDA_INIT,
    HEADER,
    Elastic,
    alternate,
    bench_dir,
    median,
    parser,
    print_blamed,
    row,
    torchrun,
    torchrun_root_rank,
)

BODY = """import torch, torch.distributed as dist
dist.init_process_group()
dist.barrier()
if dist.get_rank() == 1:
    mark('raise')
    raise ValueError('rank 1 gives up')
dist.all_reduce(torch.ones(1))
"""
CUDA_BODY = CUDA_DEVICE + BODY.replace("dist.init_process_group()\n", CUDA_INIT).replace(
    "dist.all_reduce(torch.ones(1))\n",
    "dist.all_reduce(torch.ones(1, device=device))\ntorch.cuda.synchronize()\n",
)
assert "synchronize" in CUDA_BODY and "'nccl'" in CUDA_BODY
NPROC = 4


def main() -> None:
    args = parser(cuda=True).parse_args()
    n, body = args.runs, CUDA_BODY if args.device == "cuda" else BODY
    d = bench_dir()
    blamed: dict[str, list[int | None]] = {"elastic_nb": [], "torchrun": []}

    def baseline() -> float:
        r = torchrun(body, NPROC, d)
        assert r.returncode not in (0, None), r.output[-3000:]
        blamed["torchrun"].append(torchrun_root_rank(r.output))
        return r.ended - r.marks["raise"][0]

    el = Elastic.warm(d)
    try:

        def elastic() -> float:
            r = el.run(f"--nproc {NPROC}", body)
            assert r.execution is not None and r.execution.ename == "JobFailed"
            evalue = r.execution.error["evalue"]
            blamed["elastic_nb"].append(1 if evalue.startswith("rank 1 failed first") else None)
            el.wait_warm()  # the next warm-up must not run beside torchrun's turn
            return r.ended - r.marks["raise"][0]

        xs, ys = alternate(n, elastic, baseline)
    finally:
        el.shutdown()
    if args.device == "cuda":
        print("On GPUs: NCCL, the others waiting on the GPU in the all_reduce (--device cuda).")
    print(HEADER)
    print(
        row(
            "P2 failure detection: rank 1 raises -> the error in hand, every process gone (elastic_nb: the cell's error; torchrun: its exit with the report)",
            xs,
            ys,
            "<= 0.5 s",
        )
    )
    print_blamed(blamed, 1, " as the failure")
    print(
        f"elastic_nb median {median(xs):.2f} s: {'meets' if median(xs) <= 0.5 else 'misses'} the 0.5 s target"
    )


if __name__ == "__main__":
    main()
