"""The ranks that wait at a prompt (pdb's, a cell's input()), asked in the frontend's own input
box (the kernel's stdin channel, as a plain cell's input() is), one prompt at a time, each saying
which rank(s) it talks to.

When several ranks wait at the same prompt (every rank at the same `breakpoint()`), one prompt
asks them all, ``[ranks 0,1] (Pdb) ``: a command goes to each of them and each answers under the
cell, rank-prefixed, side by side; ``@1 p loss`` sends it to rank 1 only, ``@0,2 c`` to ranks 0
and 2. Ranks at different prompts are asked in turn, the lowest rank first.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from elastic_nb import protocol

__all__ = ["GATHER_S", "RankPrompts", "addressed"]

GATHER_S = 0.05  # ranks that stop together (at one breakpoint) are asked together
SETTLE_S = 0.5  # for the addressed ranks' next prompts, before others are asked
NO_INPUT = (
    "this frontend takes no input (nbclient, papermill and nbconvert --execute send none; "
    "JupyterLab, Notebook 7, VS Code and IPython do)"
)
_ADDRESS = re.compile(r"@\s*(\d+(?:\s*,\s*\d+)*)\s*(.*)\Z", re.S)

Answer = Callable[[protocol.kernel.Prompt, str | None, str | None], None]
# Take the job's next messages for up to this long, or until the predicate holds (a prompt among
# them comes back through `RankPrompts.add`).
Take = Callable[[float, Callable[[], bool]], None]


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

    def converse(self, take: Take, flush: Callable[[], None]) -> None:
        """Ask until no rank waits (the ones that went on: `c`, or an input() answered);
        `flush`: what the ranks printed before a prompt, above the input box."""
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
            try:
                line = input(f"[{who}] {first['prompt']}")
            except NotImplementedError:  # IPython's StdinNotImplementedError
                self.decline(NO_INPUT)
                return
            except EOFError:
                self.decline("the frontend's input ended")
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
