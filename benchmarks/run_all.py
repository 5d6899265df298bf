"""Run every benchmark in this folder and print their tables (see benchmarks/README.md)."""

from __future__ import annotations

import platform
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BENCHMARKS = ["quickstart.py"]


def main() -> int:
    import os

    import torch

    print(
        f"machine: {platform.machine()}, {os.cpu_count()} cores, Python {platform.python_version()}, torch {torch.__version__}"
    )
    for name in BENCHMARKS:
        print(f"\n## {name}")
        subprocess.run([sys.executable, str(HERE / name), *sys.argv[1:]], check=True, cwd=HERE)
    return 0


if __name__ == "__main__":
    sys.exit(main())
