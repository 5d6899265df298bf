"""P3: hang diagnosis. Rank 1 goes silent; ranks 0, 2, 3 wait for it in all_reduce.

elastic_nb with --collective-timeout 10: time from the hang to the cell's error, which must
name rank 1 and show where every rank was. The control is torchrun with the same 10 s timeout
(set in the script's init_process_group): time from the hang to torchrun's exit, and the rank its
report blames. torchrun with its defaults (gloo: 30 minutes) is kept as context, given a bound
and stopped there.
"""

from __future__ import annotations

from common import Elastic, bench_dir, median, runs, spread, torchrun, torchrun_root_rank

BODY = """import time, torch, torch.distributed as dist
dist.init_process_group()
dist.barrier()
mark('hang')
if dist.get_rank() == 1:
    time.sleep(3600)   # silent: never enters the all_reduce
dist.all_reduce(torch.ones(1))
"""
CONTROL = BODY.replace(
    "dist.init_process_group()",
    "import datetime\ndist.init_process_group(timeout=datetime.timedelta(seconds=10))",
)
NPROC = 4
BOUND_S = 20.0


def main() -> None:
    n = runs()
    d = bench_dir()
    xs: list[float] = []
    ys: list[float] = []
    blamed: list[int | None] = []
    finished: list[bool] = []
    el = Elastic.warm(d)
    try:

        def elastic() -> None:
            r = el.run(f"--nproc {NPROC} --collective-timeout 10", BODY)
            ex = r.execution
            assert ex is not None and ex.ename == "JobFailed", r.output[-3000:]
            assert "rank 1 never entered all_reduce" in ex.error["evalue"], ex.error["evalue"]
            assert "where every rank was" in ex.traceback
            xs.append(r.ended - max(r.marks["hang"]))
            el.wait_warm()  # the next warm-up must not run beside torchrun's turn

        def control() -> None:
            c = torchrun(CONTROL, NPROC, d, timeout=BOUND_S)
            assert c.returncode not in (None, 0), c.output[-3000:]
            ys.append(c.ended - max(c.marks["hang"]))
            blamed.append(torchrun_root_rank(c.output))

        def defaults() -> None:
            t = torchrun(BODY, NPROC, d, timeout=BOUND_S)
            finished.append(t.returncode is not None)

        for i in range(n):
            # Neither side always first: elastic_nb, control, defaults; then the reverse.
            for turn in (elastic, control, defaults)[:: 1 if i % 2 == 0 else -1]:
                turn()
    finally:
        el.shutdown()
    done = sum(finished)
    print(
        "| benchmark | elastic_nb: median (min-max) | torchrun: median (min-max) "
        "| elastic_nb/torchrun (medians) | target | runs |\n| --- | --- | --- | --- | --- | --- |"
    )
    print(
        f"| P3 hang diagnosis, both with a 10 s collective timeout: rank 1 silent -> the error "
        f"with every rank's stack (torchrun: -> its exit) | {spread(xs)} | "
        f"{spread(ys)} | {median(xs) / median(ys):.2f}x | <= 11 s | {len(xs)} |"
    )
    print(
        f"| P3 context: torchrun with its defaults (30 min gloo timeout) | - | "
        f"{'finished in ' + str(done) if done else 'never finished'} of {len(finished)} runs "
        f"within {BOUND_S:g} s | - | - | {len(finished)} |"
    )
    print(
        f"torchrun (10 s timeout) named rank 1 in {blamed.count(1)} of {len(blamed)} runs "
        f"(blamed: {blamed}); elastic_nb named rank 1 in {len(xs)} of {len(xs)}"
    )


if __name__ == "__main__":
    main()
