"""How the supervisor asks a rank for its stacks, its flight recorder and its CUDA memory: a line
"<n> <what>" written into the rank's probe FIFO (rundir.RunDir.probe), which the rank's probe
thread (rank/recorder.py) answers into rank-R.probe.json, tagged "req": n; a stack dump goes into
the rank's .stacks file.

A rank whose cell raised a collective timeout holds its exit until the supervisor has taken
every rank's evidence (``"<n> release"``), `HOLD_FOR_EVIDENCE_S` at most: once one rank exits,
torch's agent ends the others at its next monitor tick, and with them where they were.

And the other way, a rank's input() (pdb's prompt, a cell's own input()): the rank writes what
it asks (`InputAsked`) into rank-R.input.json and waits; the supervisor asks the notebook and
brings the answer back as a probe, ``"<n> answer <InputAnswer as JSON>"``.
"""

from __future__ import annotations

import re
import signal
from typing import TypedDict

__all__ = [
    "HOLD_FOR_EVIDENCE_S",
    "PROBE_ANSWER",
    "PROBE_FULL",
    "PROBE_MEMORY",
    "PROBE_RELEASE",
    "PROBE_STACKS",
    "PROBE_STATUS",
    "STACKS_END_MARK",
    "STACK_SIGNAL",
    "TIMED_OUT",
    "InputAnswer",
    "InputAsked",
]

# The supervisor asks a rank for every thread's Python stack through its probe thread
# (PROBE_STACKS), which has faulthandler write them into the rank's .stacks file while it holds
# the GIL: no other thread moves its frames then. Only a rank whose probe thread cannot start
# (the main thread holds the GIL in native code, or the rank has no probe thread) is sent this
# signal instead: faulthandler answers it without the GIL, safe only while no other thread runs
# Python (walking the frames of a thread that runs can crash the rank: it did, beside a probe).
STACK_SIGNAL = signal.SIGUSR1
# The .stacks file's first line: how every dump in it ends (the main thread, the oldest, is
# dumped last, and its outermost frame stays put), so that a dump is read whole, not as written.
STACKS_END_MARK = "# elastic_nb: each dump below ends with: "
# What a probe asks a rank (rank/recorder.py answers): its flight recorder, each group's last
# collective or every entry too; or its CUDA allocator's memory figures; or every thread's stack
# (``"<n> stacks <deadline>"``: answered into the .stacks file, unless the wall clock is past
# the deadline, when the supervisor has signalled the rank instead).
PROBE_STATUS = "status"
PROBE_FULL = "full"
PROBE_MEMORY = "memory"
PROBE_STACKS = "stacks"
PROBE_ANSWER = "answer"  # "<n> answer <InputAnswer as JSON>": the notebook's answer to an ask
PROBE_RELEASE = "release"  # the evidence is taken: a rank holding its exit for it may go

# What a rank raises when a collective of its timed out (gloo's, NCCL's and c10d's own words):
# such a rank holds its exit for the evidence, and the supervisor judges it a collective timeout.
TIMED_OUT = re.compile(
    r"timed out waiting|watchdog caught collective operation timeout|DistTimeoutError"
    r"|operation timed out|collective operation timeout",
    re.IGNORECASE,
)
# The longest a rank holds its exit: the evidence takes STACKS_WAIT_S and PROBE_WAIT_S (1 s
# each, asked together) after the supervisor's poll has seen the rank's record.
HOLD_FOR_EVIDENCE_S = 3.0


class InputAsked(TypedDict):
    """What a rank's input() asks (rank-R.input.json), numbered from 1 in the rank."""

    ask: int
    prompt: str
    # How much the rank had written to its stdout and stderr then: the prompt is shown after
    # what came before it.
    out: int
    err: int
    t: float  # the rank's wall clock
    post_mortem: bool  # pdb at the cell's exception (--pdb): the other ranks are held meanwhile
    line: int | None  # the cell's line it stopped at (the innermost of the cell's frames)


class InputAnswer(TypedDict):
    """The notebook's answer to an ask: the text typed, or None and why there is none."""

    ask: int
    text: str | None
    why: str | None
