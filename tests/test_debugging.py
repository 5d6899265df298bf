"""A rank's input() and pdb's prompt, asked in the notebook (rank/notebook_input.py,
supervisor/runs/prompts.py): real kernels whose frontend takes input (jupyter_client answers
the kernel's input requests, as JupyterLab's input box does) or none (nbclient's way), a real
supervisor and gloo ranks. Every test also checks, by its fixture, that no process is left."""

from __future__ import annotations

import re
import time
from collections.abc import Callable

import pytest

from tests.kernel import (
    Execution,
    Kernel,
    ask_supervisor,
    kill_and_see_the_job_end,
    supervisor_socket,
)

pytestmark = [pytest.mark.e2e]

INPUT_ON_RANK_1 = """%%elastic --nproc 2
import os
if int(os.environ["RANK"]) == 1:
    print("before the question")
    name = input("your name? ")
    print(f"hello {name}")
"""

BREAKPOINT_ON_RANK_0 = """%%elastic --nproc 2
import os
rank = int(os.environ["RANK"])
x = 41 + rank
if rank == 0:
    breakpoint()
y = x + 1
print(f"y = {y}")
"""


def typing(*lines: str) -> Callable[[str, Execution], str]:
    """A person who types these lines at the prompts, in turn."""
    left = list(lines)
    return lambda prompt, ex: left.pop(0)


def test_input_on_a_rank_is_asked_in_the_notebook_and_answered(kernel: Kernel) -> None:
    seen: list[str] = []

    def answer(prompt: str, ex: Execution) -> str:
        seen.append(ex.stdout)
        return "Ada"

    ex = kernel.debug(INPUT_ON_RANK_1, answer)
    assert ex.error is None, ex.stderr
    assert ex.prompts == ["[rank 1] your name? "]
    assert "[rank 1] before the question" in seen[0]  # printed before it asked, shown first
    assert "[rank 1] hello Ada" in ex.stdout


def test_a_breakpoint_on_a_rank_takes_pdb_commands_from_the_notebook(kernel: Kernel) -> None:
    ex = kernel.debug(BREAKPOINT_ON_RANK_0, typing("p x * 2", "where", "c"))
    assert ex.error is None, ex.stderr
    assert ex.prompts == ["[rank 0] (Pdb) "] * 3
    assert "[rank 0] 82" in ex.stdout  # p x * 2, answered under the cell
    # `where`: the cell's frame, named as the cell, and none of the bootstrap's under it
    assert "[rank 0] > cell(7)<module>()" in ex.stdout and "bootstrap" not in ex.stdout
    assert "[rank 0] y = 42" in ex.stdout and "[rank 1] y = 43" in ex.stdout
    # text mode: a line when the rank stopped, one when it went on (not one a command)
    assert ex.stdout.count("[elastic_nb] rank 0 paused at line 7") == 1, ex.stdout
    assert ex.stdout.count("[elastic_nb] rank 0 resumed") == 1, ex.stdout
    paused_at = ex.stdout.index("[elastic_nb] rank 0 paused at line 7")
    assert paused_at < ex.stdout.index("[rank 0] 82")  # said before its first answer


def test_quitting_the_debugger_fails_the_cell_as_a_plain_cell_would(kernel: Kernel) -> None:
    ex = kernel.debug(BREAKPOINT_ON_RANK_0, typing("q"))
    assert ex.ename == "JobFailed", ex.stderr
    assert "BdbQuit" in ex.error["evalue"] and "rank 0" in ex.error["evalue"]


def test_a_frontend_without_input_fails_the_cell_at_once_naming_the_rank(kernel: Kernel) -> None:
    t0 = time.monotonic()
    ex = kernel.run(INPUT_ON_RANK_1)
    assert ex.ename == "JobFailed"
    evalue = ex.error["evalue"]
    assert "rank 1" in evalue and "NoInput" in evalue and "takes no input" in evalue, evalue
    assert "line 5" in evalue  # the cell's line that asked
    assert time.monotonic() - t0 < 60  # nothing waited for an answer that cannot come


def test_a_breakpoint_in_a_frontend_without_input_fails_at_once_saying_why(
    kernel: Kernel,
) -> None:
    """Not a BdbQuit that says nothing: pdb would read an end of input as a quit."""
    ex = kernel.run(BREAKPOINT_ON_RANK_0)
    assert ex.ename == "JobFailed"
    evalue = ex.error["evalue"]
    assert evalue.startswith("rank 0 failed first: elastic_nb.rank.notebook_input.NoInput"), evalue
    assert "its prompt: '(Pdb) '" in evalue and "takes no input" in evalue, evalue
    assert "BdbQuit" not in evalue


def test_a_rank_at_a_prompt_is_not_a_hang(kernel: Kernel) -> None:
    """--hang-after 1 and four seconds at the prompt: no hang alert, and the job succeeds."""

    def slowly(prompt: str, ex: Execution) -> str:
        time.sleep(4)  # the person thinks: the scenario under test, not a wait for the product
        return "Grace"

    ex = kernel.debug(INPUT_ON_RANK_1.replace("--nproc 2", "--nproc 2 --hang-after 1"), slowly)
    assert ex.error is None, ex.stderr
    assert "[rank 1] hello Grace" in ex.stdout
    assert "--hang-after" not in ex.stdout + ex.stderr


TORCH_BREAKPOINT = """%%elastic --nproc 2 --collective-timeout 5
import torch.distributed as dist
dist.init_process_group("gloo")
x = dist.get_rank() * 10
dist.breakpoint(rank=1)
print(f"after {x}")
"""


def test_torch_distributed_breakpoint_stops_one_rank_while_the_others_wait(
    kernel: Kernel,
) -> None:
    """torch's own API: rank 1 at the prompt, rank 0 in torch's barrier (whose timeout torch
    extends: the prompt outlasts --collective-timeout 5), then both go on."""

    def person(prompt: str, ex: Execution) -> str:
        if len(ex.prompts) == 1:
            time.sleep(6)  # longer than the collective timeout: the scenario under test
            return "up"
        return "p x" if len(ex.prompts) == 2 else "c"

    ex = kernel.debug(TORCH_BREAKPOINT, person)
    assert ex.error is None, ex.stderr
    assert ex.prompts[0] == "[rank 1] (Pdb) "
    # Six seconds later rank 0 is seen waiting in torch's barrier, whose timeout torch made an
    # hour: the prompt says so (not the 5 s of --collective-timeout).
    for prompt in ex.prompts[1:]:
        assert re.fullmatch(
            r"\[rank 1 · rank 0 waits in barrier #\d+: times out in 59:\d\d\] \(Pdb\) ", prompt
        ), ex.prompts
    assert "[rank 1] 10" in ex.stdout  # x on rank 1, in the cell's frame after `up`
    assert "[rank 0] after 0" in ex.stdout and "[rank 1] after 10" in ex.stdout
    # told once: what a paused rank costs the ranks waiting for it in a collective
    assert ex.stdout.count("rank 1 waits at a prompt: a rank waiting for it in a collective") == 1


WAITS_FOR_RANK_1 = """%%elastic --nproc 2 --collective-timeout 120
import torch, torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    breakpoint()
dist.all_reduce(torch.ones(1))
print("reduced")
"""


def test_a_rank_waiting_for_a_paused_one_says_when_its_timeout_runs_out(kernel: Kernel) -> None:
    """Rank 1 at its breakpoint, rank 0 in the all_reduce that needs it (a collective already
    started: torch cannot extend its 120 s). Its chip (text mode's line) says whom it waits for
    and when the timeout runs out, and the prompt counts down, until rank 1 goes on. Four
    seconds there with --hang-after 2: no hang, no desync, nothing but the wait is said."""

    def person(prompt: str, ex: Execution) -> str:
        if "waits in" in prompt or len(ex.prompts) > 50:
            time.sleep(4)  # the person thinks, past --hang-after: the scenario under test
            return "c"
        time.sleep(0.2)  # the person reads what rank 1 shows: the scenario, not a wait for it
        return "p 1"

    ex = kernel.debug(WAITS_FOR_RANK_1.replace("--nproc 2", "--nproc 2 --hang-after 2"), person)
    assert ex.error is None, ex.stderr
    for word in ("hang", "desync", "silent", "never entered", "zombie"):
        assert word not in ex.stdout + ex.stderr, ex.stdout + ex.stderr
    waiting = [p for p in ex.prompts if "waits in" in p]
    assert waiting, ex.prompts
    assert re.fullmatch(
        r"\[rank 1 · rank 0 waits in all_reduce #\d+: times out in 1:[0-5]\d\] \(Pdb\) ",
        waiting[0],
    ), waiting
    assert re.search(
        r"\[elastic_nb\] rank 0 waiting for rank 1 \(paused\) in all_reduce #\d+: its timeout "
        r"runs out in (2 min|1 min \d+ s)\n",
        ex.stdout,
    ), ex.stdout
    assert ex.stdout.count("[rank 0] reduced") == 1 and "[rank 1] reduced" in ex.stdout


def test_a_job_that_ends_while_a_rank_waits_at_its_prompt_ends_the_wait(kernel: Kernel) -> None:
    """Nobody answers rank 1's prompt; rank 0's all_reduce, waiting for it, times out (3 s).
    The cell ends then, failed, without an answer: the collective timeout is rank 0's, told
    as the pause's, not as a desync of rank 1's."""
    ex = kernel.debug(WAITS_FOR_RANK_1.replace("120", "3"), lambda prompt, ex: None, timeout=90)
    assert ex.prompts == ["[rank 1] (Pdb) "]
    assert ex.ename == "JobFailed" and ex.error is not None
    assert ex.error["evalue"].startswith("rank 0 failed first: RuntimeError: "), ex.error
    assert "Timed out" in ex.error["evalue"] and "desync" not in ex.traceback
    assert re.search(
        r"\[elastic_nb\] rank 0 timed out in all_reduce after 3 s while rank 1 \(cell line 6\) "
        r"waited at a prompt",
        ex.stderr,
    ), ex.stderr
    assert "[elastic_nb] rank 0 waiting for rank 1 (paused) in all_reduce #" in ex.stdout
    assert "resumed" not in ex.stdout  # rank 1 was ended, not resumed


def test_the_stop_button_at_a_prompt_stops_the_job(kernel: Kernel) -> None:
    """An interrupt while the frontend waits for the pdb command ends the job as an interrupt
    does anywhere in the cell; its ranks go with it (the fixture checks)."""

    def stop(prompt: str, ex: Execution) -> None:
        kernel.interrupt()

    ex = kernel.debug(BREAKPOINT_ON_RANK_0, stop, timeout=60)
    assert ex.ename == "KeyboardInterrupt", ex.stderr
    assert "interrupted" in ex.stdout + ex.stderr


def test_a_breakpoint_in_a_session_cell_and_the_session_goes_on(fresh_kernel: Kernel) -> None:
    k = fresh_kernel
    k.ok("%elastic up --nproc 2")
    k.ok("%%elastic\nimport os\nrank = int(os.environ['RANK'])\ntotal = 0\n")
    cell = "%%elastic\ntotal += 5 + rank\nif rank == 1:\n    breakpoint()\nprint('total', total)\n"
    ex = k.debug(cell, typing("p total", "c"))
    assert ex.error is None, ex.stderr
    assert ex.prompts == ["[rank 1] (Pdb) "] * 2
    assert "[rank 1] 6" in ex.stdout and "[rank 0] total 5" in ex.stdout
    assert k.ok("%%elastic\ntotal\n").result == "5"  # the session's state, kept
    k.ok("%elastic down")


def test_elastic_debug_opens_the_failed_rank_in_its_frames(fresh_kernel: Kernel) -> None:
    """IPython's %debug habit, in a session: after a cell fails on rank 1, `%elastic debug`
    opens the debugger at rank 1's exception, with that cell's locals; the session goes on."""
    k = fresh_kernel
    k.ok("%elastic up --nproc 2")
    failing = (
        "%%elastic\nimport os\nrank = int(os.environ['RANK'])\n"
        "def step(scale):\n    local = 7 * scale\n    return local / (1 - rank)\n"
        "step(3)\n"
    )
    ex = k.run(failing)
    assert ex.ename == "JobFailed" and "ZeroDivisionError" in ex.error["evalue"]
    ex = k.debug("%elastic debug", typing("p local, scale", "up", "p rank", "q"))
    assert ex.error is None, ex.stderr
    assert ex.prompts == ["[rank 1] (Pdb) "] * 4
    assert "[rank 1] ZeroDivisionError: division by zero" in ex.stdout
    assert "[rank 1] > cell(6)step()" in ex.stdout  # the failed cell's frame, named as the cell
    assert "[rank 1] (21, 3)" in ex.stdout and "[rank 1] 1" in ex.stdout
    assert k.ok("%%elastic\nrank * 10\n").result == "0"  # the session, as it was
    ex = k.run("%elastic debug --rank 0")  # rank 0 has no failure to open
    assert "[rank 0] no cell has failed on this rank" in ex.stdout
    k.ok("%elastic down")


PDB_ON_FAILURE = """%%elastic --nproc 2 --pdb --collective-timeout 5
import torch, torch.distributed as dist
dist.init_process_group("gloo")
rank = dist.get_rank()
t = torch.ones(1)
if rank == 1:
    settings = {"lr": 0.1}
    settings["momentum"]
dist.all_reduce(t)
"""


def test_pdb_flag_stops_the_failing_rank_at_its_exception_while_the_others_are_held(
    kernel: Kernel,
) -> None:
    """--pdb (IPython's %pdb habit): rank 1 raises, waits in post-mortem longer than the
    collective timeout while rank 0, held, cannot time out in its all_reduce; leaving the
    debugger fails the cell with rank 1's error, rank 1 named first."""

    def person(prompt: str, ex: Execution) -> str:
        if len(ex.prompts) == 1:
            time.sleep(6)  # past --collective-timeout 5: the scenario under test
            return "p settings"
        return "q"

    ex = kernel.debug(PDB_ON_FAILURE, person)
    assert ex.prompts == ["[rank 1] (Pdb) "] * 2
    assert "[rank 1] {'lr': 0.1}" in ex.stdout
    assert "[rank 1] > cell(8)<module>()" in ex.stdout
    assert ex.ename == "JobFailed"
    assert ex.error["evalue"].startswith("rank 1 failed first: KeyError"), ex.error["evalue"]


EVERY_RANK_AT_A_BREAKPOINT = """%%elastic --nproc 3
import os
rank = int(os.environ["RANK"])
loss = 1.5 * (rank + 1)
breakpoint()
print(f"done {rank}")
"""


def test_every_rank_at_one_breakpoint_is_asked_at_one_prompt_and_addressed(
    kernel: Kernel,
) -> None:
    """Every rank at the same breakpoint: one prompt names them all, a command goes to each
    (their answers side by side), @R sends one to R only; `c` continues all."""
    script = ["p loss", "@2 p loss * 100", "@0,1 p rank", "@7 p loss", "c"]

    def person(prompt: str, ex: Execution) -> str:
        # A rank that reached the breakpoint later than the kernel's short wait for the others
        # (a loaded machine) is asked with the next prompt: an empty line (pdb: nothing to
        # repeat yet) until one names them all.
        return script.pop(0) if prompt == "[ranks 0,1,2] (Pdb) " else ""

    ex = kernel.debug(EVERY_RANK_AT_A_BREAKPOINT, person)
    assert ex.error is None, ex.stderr
    assert not script and ex.prompts[-5:] == ["[ranks 0,1,2] (Pdb) "] * 5
    assert "wait at this prompt: a command goes to each of them" in ex.stdout
    for rank, loss in ((0, 1.5), (1, 3.0), (2, 4.5)):
        assert f"[rank {rank}] {loss}" in ex.stdout  # `p loss` on every rank
        assert f"[rank {rank}] done {rank}" in ex.stdout  # `c` on every rank
    assert "[rank 2] 450.0" in ex.stdout and "[rank 0] 150.0" not in ex.stdout  # @2 alone
    assert "[rank 0] 0" in ex.stdout and "[rank 1] 1" in ex.stdout and "[rank 2] 2" not in ex.stdout
    assert "rank 7 is not at a prompt; waiting: 0, 1, 2" in ex.stdout


def test_a_kernel_killed_while_a_rank_waits_at_its_prompt_leaves_nothing(
    fresh_kernel: Kernel,
) -> None:
    """The kernel SIGKILLed while rank 0 waits in pdb and rank 1 runs on: the supervisor ends
    the job (its lifeline), every rank is gone within the teardown's bound."""
    k = fresh_kernel
    msg_id, ex = k.start(BREAKPOINT_ON_RANK_0, allow_stdin=True)
    k.collect(msg_id, ex, timeout=60, until=lambda e: bool(e.prompts), answer=lambda p, e: None)
    kill_and_see_the_job_end(k, ex.job_id)  # rank 0 waiting at its prompt


def test_the_panel_lists_the_ranks_at_a_prompt(kernel: Kernel) -> None:
    """The JupyterLab panel's entries (the supervisor's overview, as the server extension
    relays it) name the ranks waiting at a prompt while they wait, and none after."""
    path = supervisor_socket(kernel)
    seen: list[list[int]] = []

    def look(prompt: str, ex: Execution) -> str:
        jobs = ask_supervisor(path, {"kind": "overview", "req": 1})["data"]["jobs"]
        seen.extend(j["paused"] for j in jobs if j["running"])
        return "c"

    ex = kernel.debug(BREAKPOINT_ON_RANK_0, look)
    assert ex.error is None, ex.stderr
    assert seen == [[0]]
    jobs = ask_supervisor(path, {"kind": "overview", "req": 1})["data"]["jobs"]
    assert [j["paused"] for j in jobs if j["id"] == ex.job_id] == [[]]
