"""P18: a breakpoint in a rank, beside a plain cell's pdb prompt in the same kernel.

Measured from the kernel's client, as a person at JupyterLab's input box sees it:

* the prompt: the moment the code reaches `breakpoint()` (the cell, or rank 0 of a 2-rank
  `%%elastic` job, writes time.time() just before it) -> the kernel's input request arriving;
* a pdb command's round trip: `p x` sent (the input reply) -> the next input request arriving,
  with the answer printed before it; 20 commands a run.

No torchrun side: torchrun's ranks share one terminal's stdin, unusable with more than one rank;
the comparison that matters is with the debugger a plain cell gives. Targets (issue 36): the
round trip at most 2x the plain cell's, the prompt at most 0.3 s.

    python benchmarks/debugger.py [--runs N]
"""

from __future__ import annotations

import statistics
import time

from common import Elastic, Execution, bench_dir, runs  # type: ignore[import-not-found]

COMMANDS = 20
# A plain cell's pdb prompt: ipykernel 7 hands `breakpoint()` to debugpy (JupyterLab's visual
# debugger), so the plain cell calls pdb itself (IPython's Pdb, on the stdin channel).
PLAIN = (
    "import pdb, time\nx = 41\nprint('hit', time.time(), flush=True)\npdb.set_trace()\ny = x + 1\n"
)
RANKS = (
    "%%elastic --nproc 2\nimport os, time\nx = 41\n"
    "if os.environ['RANK'] == '0':\n"
    "    print('hit', time.time(), flush=True)\n"
    "    breakpoint()\n"
    "y = x + 1\n"
)


def session(el: Elastic, code: str) -> tuple[float, list[float]]:
    """One breakpoint: (hit -> prompt, each command's round trip)."""
    trips: list[float] = []
    sent = [0.0]
    prompt_at: list[float] = []

    def person(prompt: str, ex: Execution) -> str:
        now = ex.prompted_at[-1]  # when the input request arrived (the output before it: read)
        prompt_at.append(now)
        if sent[0]:
            trips.append(now - sent[0])
        sent[0] = time.time()
        return "p x" if len(prompt_at) <= COMMANDS else "c"

    ex = el.kernel.debug(code, person)
    assert ex.error is None, ex.stderr
    assert ex.stdout.count("41") >= COMMANDS, ex.stdout
    hit = float(ex.stdout.split("hit ", 1)[1].split()[0])
    return prompt_at[0] - hit, trips


def p(xs: list[float], q: float) -> float:
    return statistics.quantiles(xs, n=100)[q - 1] if len(xs) > 1 else xs[0]


def main() -> None:
    el = Elastic.warm(bench_dir())
    try:
        plain_prompt, plain_trips, rank_prompt, rank_trips = [], [], [], []
        for i in range(runs()):
            for which in ("plain", "rank") if i % 2 == 0 else ("rank", "plain"):
                if which == "plain":
                    prompt, trips = session(el, PLAIN)
                    plain_prompt.append(prompt)
                    plain_trips += trips
                else:
                    el.wait_warm()
                    prompt, trips = session(el, RANKS)
                    rank_prompt.append(prompt)
                    rank_trips += trips
    finally:
        el.shutdown()
    ms = 1000.0
    print("| measure | a rank (%%elastic --nproc 2) | a plain cell | ratio | target |")
    print("| --- | --- | --- | --- | --- |")
    for name, q in (("p50", 50), ("p90", 90)):
        a, b = p(rank_trips, q) * ms, p(plain_trips, q) * ms
        print(f"| `p x` round trip, {name} | {a:.1f} ms | {b:.1f} ms | {a / b:.2f}x | <= 2x |")
    a, b = statistics.median(rank_prompt) * ms, statistics.median(plain_prompt) * ms
    print(f"| breakpoint hit -> prompt, median | {a:.0f} ms | {b:.0f} ms | | <= 300 ms |")
    print(f"\n{len(rank_trips)} and {len(plain_trips)} commands, {runs()} runs of each side")


if __name__ == "__main__":
    main()
