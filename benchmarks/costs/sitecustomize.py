"""The supervisor's CPU by task, for benchmarks/observer.py (P16); nothing anywhere else.

Python imports `sitecustomize` at start-up from its path: observer.py puts this folder on its
kernel's PYTHONPATH, which the supervisor, the launchers and the ranks inherit. Where $BENCH_PARTS
is set and the process is the supervisor, it times every task the supervisor's task groups start
(anyio's TaskGroup._spawn): each task's own CPU, this thread's time while its coroutine runs (not
while it waits), summed by the coroutine's name. At every SIGUSR2 it appends to $BENCH_PARTS one
JSON line: the wall clock, the process's CPU time (every thread) and each task's sum so far; what
the process used outside the tasks is the event loop's own (select, timers, wake-ups). Everywhere
else it does nothing.
"""

from __future__ import annotations

import json
import os
import signal
import time
from collections.abc import Coroutine, Generator
from typing import Any

_SUMS: dict[str, float] = {}


def _is_supervisor() -> bool:
    try:
        with open("/proc/self/cmdline", "rb") as f:
            return b"elastic_nb.supervisor" in f.read()
    except OSError:
        return False


class _Timed:
    """Awaits a coroutine, adding the CPU time of each of its steps to _SUMS[key]."""

    def __init__(self, coro: Coroutine[Any, Any, Any], key: str) -> None:
        self._coro, self._key = coro, key

    def __await__(self) -> Generator[Any, Any, Any]:
        it = self._coro.__await__()
        value: Any = None
        exc: BaseException | None = None
        while True:
            t = time.thread_time()
            try:
                step = it.throw(exc) if exc is not None else it.send(value)
            except StopIteration as e:
                self._add(t)
                return e.value
            except BaseException:
                self._add(t)
                raise
            self._add(t)
            try:
                value, exc = (yield step), None
            except BaseException as e:  # a cancellation, thrown into the task
                value, exc = None, e

    def _add(self, t: float) -> None:
        _SUMS[self._key] = _SUMS.get(self._key, 0.0) + time.thread_time() - t


def _install(path: str) -> None:
    from anyio._backends import _asyncio

    spawn = _asyncio.TaskGroup._spawn

    def timed_spawn(self: Any, coro: Coroutine[Any, Any, Any], *args: Any, **kwargs: Any) -> Any:
        async def run() -> Any:
            return await _Timed(coro, getattr(coro, "__qualname__", repr(coro)))

        return spawn(self, run(), *args, **kwargs)

    _asyncio.TaskGroup._spawn = timed_spawn  # type: ignore[method-assign]

    def dump(signum: int, frame: Any) -> None:
        line = {"t": time.time(), "cpu": time.process_time(), "parts": dict(_SUMS)}
        with open(path, "a") as f:
            f.write(json.dumps(line) + "\n")

    signal.signal(signal.SIGUSR2, dump)


if os.environ.get("BENCH_PARTS") and _is_supervisor():
    _install(os.environ["BENCH_PARTS"])
