"""P3: hang diagnosis. Rank 1 goes silent; ranks 0, 2, 3 wait for it in all_reduce.

elastic_nb with --collective-timeout 10: time from the hang to the cell's error, which must
name rank 1 and show where every rank was. torchrun with its defaults (gloo: 30 minutes) is
given a bound and stopped there.
"""

from __future__ import annotations

from common import Elastic, bench_dir, median, runs, torchrun

BODY = """import time, torch, torch.distributed as dist
dist.init_process_group()
dist.barrier()
mark('hang')
if dist.get_rank() == 1:
    time.sleep(3600)   # silent: never enters the all_reduce
dist.all_reduce(torch.ones(1))
"""
NPROC = 4
BOUND_S = 20.0


def main() -> None:
    n = runs()
    d = bench_dir()
    xs: list[float] = []
    finished: list[bool] = []
    el = Elastic.warm(d)
    try:
        for _ in range(n):
            r = el.run(f"--nproc {NPROC} --collective-timeout 10", BODY)
            ex = r.execution
            assert ex is not None and ex.ename == "JobFailed", r.output[-3000:]
            assert "rank 1 never entered all_reduce" in ex.error["evalue"], ex.error["evalue"]
            assert "where every rank was" in ex.traceback
            xs.append(r.ended - max(r.marks["hang"]))
            el.wait_warm()
            t = torchrun(BODY, NPROC, d, timeout=BOUND_S)
            finished.append(t.returncode is not None)
    finally:
        el.shutdown()
    done = sum(finished)
    print(
        "| benchmark | elastic_nb (median) | torchrun | target | runs |\n| --- | --- | --- | --- | --- |"
    )
    print(
        f"| P3 hang diagnosis: rank 1 silent -> the error with every rank's stack "
        f"(--collective-timeout 10) | {median(xs):.2f} s | "
        f"{'finished in ' + str(done) if done else 'never finished'} of {len(finished)} runs "
        f"within {BOUND_S:g} s (defaults: 30 min gloo timeout) | <= 11 s | {len(xs)} |"
    )


if __name__ == "__main__":
    main()
