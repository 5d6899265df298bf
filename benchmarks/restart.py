"""P4: restart. Rank 1 fails in attempt 0 of a --max-restarts 1 job.

Time from the raise to the last of 4 ranks running line 1 of attempt 1; torchrun: the same with
`--max-restarts 1`, and TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 as elastic_nb sets it: with the
agent's store shared, a restarted attempt reads the previous attempt's keys and fails or hangs
in process-group init (the class of pytorch#135712; seen failing here in torchrun's attempt 1).
"""

from __future__ import annotations

from common import HEADER, Elastic, alternate, bench_dir, row, runs, torchrun

BODY = """import os, torch.distributed as dist
attempt = int(os.environ['TORCHELASTIC_RESTART_COUNT'])
if attempt == 1:
    mark('restarted')
dist.init_process_group()
if attempt == 0:
    dist.barrier()
    if dist.get_rank() == 1:
        mark('raise')
        raise ValueError('the first attempt fails')
    dist.barrier()   # the others wait here
dist.destroy_process_group()
"""
NPROC = 4


def main() -> None:
    n = runs()
    d = bench_dir()

    def took(r: object) -> float:
        marks = r.marks  # type: ignore[attr-defined]
        assert len(marks.get("restarted", [])) == NPROC, r.output[-3000:]  # type: ignore[attr-defined]
        return max(marks["restarted"]) - marks["raise"][0]

    def baseline() -> float:
        r = torchrun(
            BODY, NPROC, d, "--max-restarts=1", env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        )
        assert r.returncode == 0, r.output[-3000:]
        return took(r)

    el = Elastic.warm(d)
    try:

        def elastic() -> float:
            r = el.run(f"--nproc {NPROC} --max-restarts 1", BODY)
            assert r.execution is not None and r.execution.error is None, r.output[-3000:]
            el.wait_warm()
            return took(r)

        xs, ys = alternate(n, elastic, baseline)
    finally:
        el.shutdown()
    print(HEADER)
    print(row("P4 restart: rank 1 raises -> 4 ranks running attempt 1", xs, ys, "<= 1.0 s"))


if __name__ == "__main__":
    main()
