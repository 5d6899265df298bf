"""Run every benchmark and print their tables; --readme also writes them into README.md.

python benchmarks/run_all.py [--runs N] [--readme]      (make bench)
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import re
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHMARKS = [
    "launch.py",
    "failure.py",
    "hang.py",
    "desync.py",
    "restart.py",
    "flood.py",
    "throughput.py",
    "observer.py",
    "quickstart.py",
    "session.py",
    "checkpoint.py",
    "multinode.py",
    "debugger.py",
    "protocol_check.py",
]
_BLOCK = re.compile(r"(<!-- results -->\n).*?(<!-- /results -->)", re.S)


def machine() -> str:
    import torch

    cpu = platform.processor() or platform.machine()
    with open("/proc/cpuinfo") as f:
        names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
    if names:
        cpu = names[0]
    mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return (
        f"{cpu}, {len(os.sched_getaffinity(0))} cores, {mem:.0f} GiB, Linux "
        f"{platform.release()}, Python {platform.python_version()}, torch {torch.__version__} "
        f"(gloo, CPU)"
    )


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--readme", action="store_true", help="write the tables into README.md")
    parser.add_argument("only", nargs="*", help="run only these (e.g. launch.py)")
    args = parser.parse_args()
    out = [
        f"Machine: {machine()}.",
        f"Run on {datetime.date.today()} with `python benchmarks/run_all.py --runs {args.runs}`.",
    ]
    print("\n".join(out), flush=True)
    for name in args.only or BENCHMARKS:
        print(f"\n### {name}", flush=True)
        proc = subprocess.run(
            [sys.executable, str(HERE / name), "--runs", str(args.runs)],
            cwd=HERE,
            stdout=subprocess.PIPE,
            text=True,
        )
        sys.stdout.write(proc.stdout)
        if proc.returncode:
            print(f"{name} failed (exit {proc.returncode})")
            return proc.returncode
        out += ["", f"### {name}", proc.stdout.rstrip()]
    if args.readme:
        readme = HERE / "README.md"
        text = readme.read_text()
        readme.write_text(
            _BLOCK.sub(lambda m: m.group(1) + "\n".join(out) + "\n" + m.group(2), text)
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
