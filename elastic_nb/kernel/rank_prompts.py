"""The ranks that wait at a prompt (pdb's, a cell's input()), asked in the frontend's own input
box (the kernel's stdin channel, as a plain cell's input() is), one prompt at a time, each saying
which rank(s) it talks to.

When several ranks wait at the same prompt (every rank at the same `breakpoint()`), one prompt
asks them all, ``[ranks 0,1] (Pdb) ``: a command goes to each of them and each answers under the
cell, rank-prefixed, side by side; ``@1 p loss`` sends it to rank 1 only, ``@0,2 c`` to ranks 0
and 2. Ranks at different prompts are asked in turn, the lowest rank first.

Where other ranks wait for the asked ones in a collective, the prompt says so and how long its
timeout has left: ``[rank 1 · rank 0 waits in all_reduce #4: times out in 4:58] (Pdb) ``.

While the frontend's input box waits, a thread takes the job's news (`beside_input`): its
dashboard is drawn live, and a job that ends meanwhile ends the wait (`Ended`, raised in the
waiting thread).
"""

from __future__ import annotations

import contextlib
import contextvars
import ctypes
import queue
import re
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from elastic_nb import protocol

__all__ = ["GATHER_S", "Ended", "RankPrompts", "addressed", "beside_input", "waiting_words"]

GATHER_S = 0.05  # ranks that stop together (at one breakpoint) are asked together
SETTLE_S = 0.5  # for the addressed ranks' next prompts, before others are asked
PUMP_S = 0.02  # how often the job's news is looked for while the input box waits
NO_INPUT = (
    "this frontend takes no input (nbclient, papermill and nbconvert --execute send none; "
    "JupyterLab, Notebook 7, VS Code and IPython do)"
)
_ADDRESS = re.compile(r"@\s*(\d+(?:\s*,\s*\d+)*)\s*(.*)\Z", re.S)

Answer = Callable[[protocol.kernel.Prompt, str | None, str | None], None]
# Take the job's next messages for up to this long, or until the predicate holds (a prompt among
# them comes back through `RankPrompts.add`).
Take = Callable[[float, Callable[[], bool]], None]


class Ended(BaseException):
    """The job ended while the cell's thread waited at a rank's prompt (its rank is gone): a
    BaseException, as KeyboardInterrupt, which ipykernel's input() lets through."""


Beside = Callable[[], contextlib.AbstractContextManager[None]]


def addressed(line: str, waiting: list[int], asked: list[int]) -> tuple[list[int], str]:
    """The ranks a line goes to and the command: ``@R[,S...] command`` names them (each must be
    waiting), else the ranks the prompt asked. ValueError for a rank that does not wait."""
    m = _ADDRESS.match(line.strip())
    if m is None:
        return asked, line
    ranks = sorted({int(r) for r in m.group(1).split(",")})
    if not_waiting := [r for r in ranks if r not in waiting]:
        raise ValueError(
            f"rank {', '.join(map(str, not_waiting))} is not at a prompt; waiting: "
            f"{', '.join(map(str, waiting))}"
        )
    return ranks, m.group(2)


def waiting_words(waits: list[protocol.records.Waiting], now: float) -> str:
    """What the prompt says of the ranks waiting for the asked ones in a collective: whose wait
    times out first, and when ('' where none waits)."""
    if not waits:
        return ""
    first = min(waits, key=lambda w: float("inf") if w["expires"] is None else w["expires"])
    ranks = sorted({w["rank"] for w in waits})
    who = f"rank {ranks[0]} waits" if len(ranks) == 1 else f"ranks {','.join(map(str, ranks))} wait"
    words = f" · {who} in {first['op']}"
    if first["expires"] is None:
        return words
    left = first["expires"] - now
    if left <= 0:
        return f"{words}: its timeout has run out"
    clock = f"{left:.0f} s" if left < 60 else f"{int(left // 60)}:{int(left % 60):02d}"
    return f"{words}: times out in {clock}"


class RankPrompts:
    def __init__(self, answer: Answer) -> None:
        """`answer`: the reply to a rank's prompt (the line, or None and why)."""
        self._answer = answer
        self.waiting: dict[int, protocol.kernel.Prompt] = {}
        self._told = False  # the hint on addressing ranks, once a cell

    def _back(self, ranks: list[int]) -> Callable[[], bool]:
        """Whether these ranks all wait at a prompt again."""
        return lambda: set(ranks) <= self.waiting.keys()

    def add(self, prompt: protocol.kernel.Prompt) -> None:
        self.waiting[prompt["rank"]] = prompt

    def decline(self, why: str) -> None:
        """Every waiting rank is told there is no input for it (its input() raises)."""
        for prompt in list(self.waiting.values()):
            self._answer(prompt, None, why)
        self.waiting.clear()

    def converse(self, take: Take, flush: Callable[[], None], beside: Beside) -> None:
        """Ask until no rank waits (the ones that went on: `c`, or an input() answered);
        `flush`: what the ranks printed before a prompt, above the input box; `beside`: what
        goes on while the frontend's input box waits."""
        take(GATHER_S, lambda: False)
        while self.waiting:
            first = self.waiting[min(self.waiting)]
            asked = sorted(r for r, p in self.waiting.items() if p["prompt"] == first["prompt"])
            flush()
            if len(asked) > 1 and not self._told:
                self._told = True
                print(
                    f"[elastic_nb] ranks {', '.join(map(str, asked))} wait at this prompt: a "
                    "command goes to each of them; @R (or @R,S) before it sends it to those only"
                )
            who = f"rank {asked[0]}" if len(asked) == 1 else f"ranks {','.join(map(str, asked))}"
            waits = {w["rank"]: w for r in asked for w in self.waiting[r]["waits"]}
            who += waiting_words(list(waits.values()), time.time())
            try:
                with beside():
                    line = input(f"[{who}] {first['prompt']}")
            except NotImplementedError:  # IPython's StdinNotImplementedError
                self.decline(NO_INPUT)
                return
            except EOFError:
                self.decline("the frontend's input ended")
                return
            except Ended:
                self.decline("the job ended")
                return
            try:
                targets, command = addressed(line, sorted(self.waiting), asked)
            except ValueError as e:
                print(f"[elastic_nb] {e}")
                continue
            for rank in targets:
                self._answer(self.waiting.pop(rank), command, None)
            # Their next prompts (pdb asks again after each command), before anyone else's.
            take(SETTLE_S, self._back(targets))


@contextlib.contextmanager
def beside_input(
    news: queue.Queue[Any],
    deal: Callable[[Any], None],
    ends: Callable[[Any], bool],
    idle: Callable[[], None] | None,
) -> Iterator[None]:
    """While the calling thread waits in input(): a thread of its context takes each message of
    `news` and `deal`s with it (`idle` when there is none). One that `ends` the job ends the wait:
    `Ended`, raised in the waiting thread, which ipykernel's input() lets through as it does
    KeyboardInterrupt (it looks up every 10 ms). Each message is taken and dealt with under one
    lock, which the waiting thread takes back as input() returns: the news stays in order, and
    the wait is never ended after it is over."""
    lock = threading.Lock()
    over = False
    waiting = threading.get_ident()

    def pump() -> None:
        while True:
            with lock:
                if over:
                    return
                try:
                    msg = news.get_nowait()
                except queue.Empty:
                    msg = None
                try:
                    if msg is not None:
                        deal(msg)
                    elif idle is not None:
                        idle()
                except Exception:  # the waiting thread takes over once input() returns
                    return
                if msg is not None and ends(msg):
                    ctypes.pythonapi.PyThreadState_SetAsyncExc(
                        ctypes.c_ulong(waiting), ctypes.py_object(Ended)
                    )
                    return
            if msg is None:
                time.sleep(PUMP_S)

    context = contextvars.copy_context()
    threading.Thread(
        target=context.run, args=(pump,), name="elastic_nb-prompt", daemon=True
    ).start()
    try:
        yield
    finally:
        with lock:
            over = True
