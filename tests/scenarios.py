"""The scenarios of issue 34 that more than one frontend's test runs, and what the screen must say
after each (tests/test_browser.py in JupyterLab, tests/test_notebook7.py in Notebook 7)."""

from __future__ import annotations

import re
from typing import Any

from playwright.sync_api import expect

from tests.kernel import assert_job_gone
from tests.lab import LabServer, has_class, job_of, open_notebook, shot
from tests.test_checkpoint_jobs import TRAIN

# A checkpointed restart: rank 1 fails at step 7 after a save at step 5; attempt 1 resumes at 6
# (test_checkpoint_jobs' training cell; `{ckpt}` left for the test's directory).
CHECKPOINTED_RESTART = TRAIN.format(restarts=1, ckpt="{ckpt}", save_at=5, fail_at=7)


def expect_a_checkpointed_restart(dash: Any) -> None:
    """The dashboard of CHECKPOINTED_RESTART at its end: the header counts the restart, the
    timeline draws both attempts on the job's time (the first ended in the restart, the second
    succeeded) and says once why the first ended, with what the failure cost: the restart
    alert is not said a second time above it."""
    expect(dash.locator(".enb-state")).to_have_text("succeeded")
    expect(dash.locator(".enb-restarts")).to_have_text("restarts 1/1")
    expect(dash.locator(".enb-checkpoint")).to_contain_text("checkpoint: step 5")
    timeline = dash.locator(".enb-attempts")
    expect(timeline).to_be_visible()
    expect(timeline.locator(".enb-tl-lane:not(.enb-tl-axis) .enb-tl-name")).to_have_text(
        ["this machine"]
    )
    bars = timeline.locator(".enb-tl-bar")
    expect(bars).to_have_count(2)
    expect(bars.nth(0)).to_have_class(has_class("enb-o-restarted"))
    expect(bars.nth(0)).to_have_text(re.compile(r"^attempt 0 · [\d.]+ s$"))
    expect(bars.nth(1)).to_have_class(has_class("enb-o-succeeded"))
    # The bars share one time axis: attempt 1 begins where attempt 0 ends.
    left = [float(bars.nth(i).evaluate("b => parseFloat(b.style.left)")) for i in (0, 1)]
    width0 = float(bars.nth(0).evaluate("b => parseFloat(b.style.width)"))
    assert left[0] == 0 and abs(left[0] + width0 - left[1]) < 0.05, (left, width0)
    ended = timeline.locator('.enb-attempt[data-attempt="0"] .enb-attempt-why')
    expect(ended).to_have_text(
        re.compile(
            r"^ended: attempt 0 failed: rank 1 RuntimeError: rank 1 broke at step 7 \(cell line 18\); "
            r"restarting as attempt 1 \(restart 1/1\); .*step 5"
        )
    )
    expect(timeline.locator('.enb-attempt[data-attempt="1"] .enb-attempt-why')).to_have_count(0)
    # Said once: the restart's words are the timeline's, not an alert's as well.
    expect(dash.locator('.enb-alert[data-kind="restart"]')).to_be_hidden()
    expect(dash.locator(".enb-alerts")).not_to_contain_text(
        "restarting as attempt 1", use_inner_text=True
    )


DESYNC = (
    "%%elastic --nproc 2 --collective-timeout 5\n"
    "import time, torch, torch.distributed as dist\n"
    "dist.init_process_group()\n"
    "x = torch.ones(1)\n"
    "dist.all_reduce(x)\n"
    "if dist.get_rank() != 1:\n"
    "    dist.all_reduce(x)   # rank 1 skips this one\n"
    "time.sleep(120)\n"
)
HANG_ENDED_BY_TIMEOUT = (
    "%%elastic --nproc 2 --hang-after 2 --timeout 15 --collective-timeout off\n"
    "import time, torch, torch.distributed as dist\n"
    "dist.init_process_group()\n"
    "print('initialised', flush=True)\n"
    "if dist.get_rank() == 1:\n"
    "    time.sleep(600)\n"
    "dist.all_reduce(torch.ones(1))\n"
)


def run_the_desync_and_the_hang(page: Any, lab: LabServer, name: str, shots: str) -> None:
    """A rank skips a collective: the desync is said once (its alert; the failure adds no second
    one with the same finding). Then a rank sleeps while the other waits in all_reduce, past
    --hang-after, until --timeout ends the cell: the hang's finding stays in the error, and each
    chip says where its rank was. Screenshots named `shots` + desync.png, hang-timeout.png."""
    nb = open_notebook(page, lab, name, [DESYNC, HANG_ENDED_BY_TIMEOUT])
    nb.run(1)
    nb.wait_done(1, timeout=60)
    dash = nb.cell(1).locator(".enb")
    expect(dash.locator(".enb-state")).to_have_text("failed")
    finding = "rank 1 never entered all_reduce #2 (cell line 7): it was at cell line 8"
    expect(dash.locator(".enb-alert").filter(has_text=finding)).to_have_count(1)
    nb.expect_output(1, f"JobFailed: desync: {finding}")
    shot(page, dash, f"{shots}desync.png")
    assert_job_gone(job_of(nb, 1))

    nb.run(2)
    nb.wait_done(2, timeout=60)
    dash = nb.cell(2).locator(".enb")
    expect(dash.locator(".enb-state")).to_have_text("timeout")
    expect(dash.locator('.enb-chip[data-rank="0"] .enb-chip-label')).to_have_text(
        "stopped · waiting in all_reduce #1 · line 7"
    )
    expect(dash.locator('.enb-chip[data-rank="1"] .enb-chip-label')).to_have_text(
        re.compile(r"^stopped · silent \d+ s · line 6$")
    )
    hang = dash.locator('.enb-alert[data-kind="hang"]')
    expect(hang).to_have_count(1)
    expect(hang.locator(".enb-alert-title")).to_contain_text(
        "rank 1 never entered all_reduce #1 (cell line 7): it was at cell line 6",
        use_inner_text=True,
    )
    nb.expect_output(
        2, "ran past its deadline: the --timeout of 15 s passed; before that: no output"
    )
    expect(dash.locator(".enb-worst")).to_have_text("")  # --collective-timeout off: no note
    shot(page, dash, f"{shots}hang-timeout.png")
    assert_job_gone(job_of(nb, 2))


def debug_a_rank_in_the_input_box(page: Any, lab: LabServer, name: str, picture: str) -> None:
    """As a person debugs, in the frontend's own input box (JupyterLab's, Notebook 7's: one
    output area): `breakpoint()` on rank 0, its prompt in the input box, `p x * 2` typed there,
    the answer in the dashboard's log under the cell, the rank's chip paused at its line, rank 1's chip waiting for it in the all_reduce with its
    timeout counting down (and the next prompt saying so), then `c`, and the cell ends."""
    nb = open_notebook(
        page,
        lab,
        name,
        [
            "%%elastic --nproc 2 --collective-timeout 300\nimport torch, torch.distributed as dist\n"
            "dist.init_process_group('gloo')\nrank = dist.get_rank()\nx = 41 + rank\n"
            "if rank == 0:\n    breakpoint()\ndist.all_reduce(torch.ones(1))\n"
            "print(f'y = {x + 1}')\n"
        ],
    )
    nb.run(1)
    cell = nb.cell(1)
    box = cell.locator("input.jp-Stdin-input")
    expect(box).to_be_visible(timeout=90_000)
    expect(cell.locator(".jp-Stdin-prompt")).to_have_text("[rank 0] (Pdb) ")
    dash = cell.locator(".enb")
    chip = dash.locator('.enb-chip[data-rank="0"]')
    expect(chip).to_have_class(has_class("enb-s-paused"))
    expect(chip.locator(".enb-chip-label")).to_have_text("paused at line 8")
    expect(dash.locator(".enb-log")).to_contain_text("[rank 0] -> dist.all_reduce(torch.ones(1))")
    waiting = dash.locator('.enb-chip[data-rank="1"]')
    expect(waiting).to_have_class(has_class("enb-s-waiting"))
    expect(waiting.locator(".enb-chip-label")).to_have_text(
        re.compile(r"^waiting for rank 0 \(paused\) in all_reduce #\d+$")
    )
    countdown = waiting.locator(".enb-chip-timeout")
    expect(countdown).to_have_text(re.compile(r"^times out in 4:[0-5]\d$"))
    before = countdown.inner_text()
    expect(countdown).not_to_have_text(before, timeout=3_000)  # it counts down
    box.fill("p x * 2")
    box.press("Enter")
    expect(dash.locator(".enb-log")).to_contain_text("[rank 0] 82")
    # The answered prompt stays as text, with what was typed (its box goes half a second after
    # Enter: whether both boxes are ever there at once is how soon pdb asks again); the next
    # prompt comes in a box of its own.
    answered = re.compile(r"\[rank 0\] \(Pdb\) +p x \* 2")
    expect(cell.locator(".jp-OutputArea-output").filter(has_text=answered)).to_have_count(1)
    expect(cell.locator(".jp-Stdin-prompt").last).to_have_text(
        re.compile(
            r"^\[rank 0 · rank 1 waits in all_reduce #\d+: times out in 4:[0-5]\d\] \(Pdb\) $"
        )
    )
    box = cell.locator("input.jp-Stdin-input").last
    shot(page, cell, picture)
    box.fill("c")
    box.press("Enter")
    nb.wait_done(1, timeout=60)
    expect(dash.locator(".enb-state")).to_have_text("succeeded")
    expect(dash.locator(".enb-log")).to_contain_text("[rank 0] y = 42")
    expect(waiting).to_have_class(has_class("enb-s-done"))
    assert_job_gone(job_of(nb, 1))
