"""Which of the suite's parallel workers this process is (pytest-xdist: `make test` runs the suite
on several), so that what a test takes for the whole machine is its worker's own: a network
address or subnet (tests/netns.py, tests/machines.py) and the directory where supervisors register
(conftest.py: `pytest_configure`). Everything else a test takes is already its own: a free port,
a temporary directory, a cache home per worker (conftest.py: `cache_home`), pids."""

from __future__ import annotations

import os
import re

MAX = 16  # more workers than this would share addresses (10.213.N.0/30, 10.78.N.0/24)


def index() -> int:
    """0 for the first worker (gw0) or a run without workers, 1 for gw1, ..."""
    name = os.environ.get("PYTEST_XDIST_WORKER", "")
    n = int(m[1]) if (m := re.fullmatch(r"gw(\d+)", name)) else 0
    if n >= MAX:
        raise RuntimeError(f"worker {name}: the suite gives addresses to {MAX} workers at most")
    return n
