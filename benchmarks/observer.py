"""P16: where P6's gap to torchrun goes, each part measured in the same run.

P6's training loop (throughput.py: a DDP MLP on 2 gloo ranks, steps/s after a warm-up) three
ways, in rotation: under %%elastic, under torchrun as it ships (the flight recorder on:
TORCH_FR_BUFFER_SIZE unset is 2,000 entries, as elastic_nb sets it), and under torchrun with
the recorder off (TORCH_FR_BUFFER_SIZE=0). Printed:

* P6 again (elastic_nb against torchrun, the pairs of this run);
* the flight recorder's cost per collective: torchrun with it against torchrun without, as
  microseconds per step (the loop issues one all-reduce a step: DDP's single bucket; the ranks
  count their collectives) and as a share of a step;
* the observer's CPU while the ranks train, by part: the supervisor's tasks timed from inside
  (costs/sitecustomize.py, loaded into this benchmark's supervisor only, times every task its
  task groups start: the poll loop that tails the logs, reads the records and flushes the
  updates; the desync watch and its probes; the memory samples; the launcher's pipe and the rank
  watchers; any other task), the event loop itself (the supervisor's CPU outside every task: the
  select and the timers of the tasks' wake-ups), each rank's probe thread (its answers to the
  probes), the kernel (the dashboard), as a share of one core per rank. On 2 cores that 2 ranks
  keep busy, a core-second the observer takes is one the ranks lose, and a rank held off its
  core holds the other at the next all-reduce: P6 can lose from the per-rank total to twice it.

The timed window is the ranks' own (their marks around the timed steps); a thread of this
benchmark watches for those marks every 5 ms in every turn (both sides pay it alike) and, on
elastic_nb's turns, asks the supervisor for its sums (SIGUSR2) at both ends.
"""

from __future__ import annotations

import json
import os
import signal
import tempfile
import threading
from pathlib import Path

import psutil
from common import Elastic, bench_dir, clear, median, runs, spread, torchrun
from throughput import BODY, NPROC, STEPS, WARMUP

COSTS = Path(__file__).resolve().parent / "costs"
# The loop's collectives, counted by each rank (c10d's sequence number of the default group).
COUNT = (
    "mark('collectives', dist.group.WORLD._get_backend(torch.device('cpu'))"
    "._get_sequence_number_for_group())\n"
)
TIMED_BODY = BODY.replace(
    "dist.destroy_process_group()\n", COUNT + "dist.destroy_process_group()\n"
)
PARTS = {
    "poll": "the supervisor's poll loop (logs tailed, records read, watchdogs, updates flushed to "
    "the kernel; every 50 ms)",
    "desync": "the supervisor's desync watch (a status probe of each rank every 1 s)",
    "memory": "the supervisor's memory samples (/proc, the cgroup, NVML; every 1 s)",
    "launcher": "the supervisor's reading of the launcher (a tick every 0.25 s) and rank watchers",
    "tasks": "the supervisor's other tasks",
    "loop": "the supervisor's event loop itself (select, timers: the tasks' wake-ups)",
    "supervisor": "the supervisor, all of it",
    "probe": "a rank's probe thread (its answers to the probes)",
    "kernel": "the kernel (the dashboard)",
}
# The supervisor's tasks (costs/sitecustomize.py: by coroutine name) in each part.
TASKS = {
    "poll": ("RankGroup._poll_loop",),
    "desync": ("Job._watch_desync", "Probes.", "EvidenceCollector."),
    "memory": ("RankGroup._sample_memory", "_cuda_memory."),
    "launcher": ("Launcher.read", "RankGroup._read_launcher", "RankGroup._watch_rank"),
}


def part_of(task: str) -> str:
    return next((k for k, names in TASKS.items() if task.startswith(names)), "tasks")


class MarkWatch:
    """Calls `at_start` once every rank marked t0 and `at_end` once every rank marked t1,
    looking every 5 ms from a thread."""

    def __init__(self, directory: str, at_start: object = None, at_end: object = None) -> None:
        self._dir = Path(directory)
        self._calls = [("t0", at_start), ("t1", at_end)]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> MarkWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        for event, call in self._calls:
            names = [self._dir / f"{event}-{rank}" for rank in range(NPROC)]
            while not all(p.exists() for p in names):
                if self._stop.wait(0.005):
                    return
            if callable(call):
                call()


def main() -> None:
    n = runs()
    d = bench_dir()
    parts_file = tempfile.mktemp(prefix="elastic_nb-bench-parts-")

    def rate(r: object) -> float:
        rates = r.marks.get("rate", [])  # type: ignore[attr-defined]
        assert len(rates) == NPROC, r.output[-3000:]  # type: ignore[attr-defined]
        return sum(rates) / NPROC

    def collectives(r: object) -> float:
        counts = r.marks.get("collectives", [])  # type: ignore[attr-defined]
        assert len(counts) == NPROC, r.output[-3000:]  # type: ignore[attr-defined]
        return max(counts)

    counts: list[float] = []  # collectives a rank issued, torchrun's turns

    def baseline(fr: str | None) -> float:
        env = {} if fr is None else {"TORCH_FR_BUFFER_SIZE": fr}
        clear(d)  # the last turn's marks, before the watch looks
        with MarkWatch(d):
            r = torchrun(TIMED_BODY, NPROC, d, env=env)
        assert r.returncode == 0, r.output[-3000:]
        counts.append(collectives(r))
        return rate(r)

    el = Elastic.warm(
        d,
        env={
            "ELASTIC_NB_WIDGETS": "1",
            "BENCH_PARTS": parts_file,
            "PYTHONPATH": os.pathsep.join(
                [str(COSTS), *filter(None, [os.environ.get("PYTHONPATH")])]
            ),
        },
    )
    cost: dict[str, list[float]] = {key: [] for key in PARTS}
    others: dict[str, float] = {}  # CPU seconds of the other tasks, by name, over every run
    xs: list[float] = []
    ys: list[float] = []
    zs: list[float] = []
    try:
        status = el.kernel.ok("%elastic status").stdout
        supervisor = psutil.Process(int(status.split("supervisor: pid ", 1)[1].split(",")[0]))
        kernel = psutil.Process(el.kernel.pid)

        def elastic() -> float:
            kernel_cpu: list[float] = []

            def ask() -> None:
                t = kernel.cpu_times()
                kernel_cpu.append(t.user + t.system)
                supervisor.send_signal(signal.SIGUSR2)

            Path(parts_file).write_text("")
            clear(d)  # the last turn's marks, before the watch looks
            with MarkWatch(d, ask, ask):
                r = el.run(f"--nproc {NPROC}", TIMED_BODY)
            assert r.execution is not None and r.execution.error is None, r.output[-3000:]
            lines = [json.loads(x) for x in Path(parts_file).read_text().splitlines()]
            assert len(lines) == 2 and len(kernel_cpu) == 2, (lines, kernel_cpu)
            a, b = lines
            span = b["t"] - a["t"]

            def share(seconds: float) -> float:
                return seconds / span / NPROC * 100

            used = dict.fromkeys(TASKS, 0.0) | {"tasks": 0.0}
            for task, total in b["parts"].items():
                spent = total - a["parts"].get(task, 0.0)
                used[part_of(task)] += spent
                if part_of(task) == "tasks":
                    others[task] = others.get(task, 0.0) + spent
            for key, seconds in used.items():
                cost[key].append(share(seconds))
            cost["supervisor"].append(share(b["cpu"] - a["cpu"]))
            cost["loop"].append(share(b["cpu"] - a["cpu"] - sum(used.values())))
            cost["kernel"].append(share(kernel_cpu[1] - kernel_cpu[0]))
            t0, t1 = max(r.marks["t0"]), min(r.marks["t1"])
            cost["probe"].append(max(r.marks["probe"]) / (t1 - t0) * 100)
            el.wait_warm()
            return rate(r)

        turns = [
            (xs, elastic),
            (ys, lambda: baseline(None)),
            (zs, lambda: baseline("0")),
        ]
        for i in range(n):  # each order in turn: no side always first, or always after another
            for k in range(3):
                out, turn = turns[(i + k) % 3]
                out.append(turn())
    finally:
        el.shutdown()
        Path(parts_file).unlink(missing_ok=True)

    print(
        "| P16 P6's loop three ways (steps/s, higher is better) | median (min-max) "
        "| against torchrun | runs |\n| --- | --- | --- | --- |"
    )
    for name, values in (
        ("elastic_nb (%%elastic, dashboard)", xs),
        ("torchrun (flight recorder on: its default)", ys),
        ("torchrun, TORCH_FR_BUFFER_SIZE=0 (recorder off)", zs),
    ):
        print(
            f"| {name} | {spread(values, unit='steps/s')} | {median(values) / median(ys):.2f}x "
            f"| {len(values)} |"
        )
    per_step = (1 / median(ys) - 1 / median(zs)) * 1e6
    each = median(counts) / (WARMUP + STEPS)
    print(
        f"\nThe flight recorder: {per_step:+.1f} µs per step (torchrun with it against without, "
        f"medians), {each:.2f} collectives a step, so {per_step / each:+.1f} µs per collective: "
        f"{per_step / (1e6 / median(zs)) * 100:+.1f}% of a step. Both sides record (torchrun's "
        "default is elastic_nb's setting): no part of P6's ratio."
    )
    print(
        "\n| P16 the observer's CPU while 2 ranks train, % of a core per rank | median (min-max) "
        "| runs |\n| --- | --- | --- |"
    )
    for key, what in PARTS.items():
        print(f"| {what} | {spread(cost[key], unit='%')} | {len(cost[key])} |")
    busiest = sorted(others.items(), key=lambda kv: -kv[1])[:3]
    if busiest:
        print(
            "(the other tasks, most first: " + ", ".join(f"{k} {v:.3f} s" for k, v in busiest) + ")"
        )
    total = median(cost["supervisor"]) + median(cost["probe"]) + median(cost["kernel"])
    print(
        f"P16: the observer takes {total:.2f}% of a core per rank (supervisor + probe thread + "
        f"kernel, medians); P6 here {median(xs) / median(ys):.2f}x."
    )


if __name__ == "__main__":
    main()
