"""The scenarios of issue 34 that more than one frontend's test runs, and what the screen must say
after each (tests/test_browser.py in JupyterLab, tests/test_notebook7.py in Notebook 7)."""

from __future__ import annotations

import re
from typing import Any

from playwright.sync_api import expect

from tests.lab import has_class

# A checkpointed restart: rank 1 fails at step 7 after a save at step 5; attempt 1 resumes at 6.
CHECKPOINTED_RESTART = """%%elastic --nproc 2 --max-restarts 1 --env ELASTIC_NB_CHECKPOINT_DIR={ckpt}
import os, torch, torch.distributed as dist
from elastic_nb import checkpoint
dist.init_process_group()
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
start = checkpoint.load(model, opt)
print("first step", 0 if start is None else start + 1, flush=True)
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
for step in range(0 if start is None else start + 1, 10):
    opt.zero_grad()
    model(torch.ones(8, 4)).sum().backward()
    opt.step()
    if step == 5:
        checkpoint.save(step, model, opt)
    if attempt == 0 and step == 7 and dist.get_rank() == 1:
        raise RuntimeError("rank 1 broke at step 7")
    dist.barrier()
"""


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
            r"^ended: attempt 0 failed: rank 1 RuntimeError: rank 1 broke at step 7 \(cell line 17\); "
            r"restarting as attempt 1 \(restart 1/1\); .*step 5"
        )
    )
    expect(timeline.locator('.enb-attempt[data-attempt="1"] .enb-attempt-why')).to_have_count(0)
    # Said once: the restart's words are the timeline's, not an alert's as well.
    expect(dash.locator('.enb-alert[data-kind="restart"]')).to_be_hidden()
    expect(dash.locator(".enb-alerts")).not_to_contain_text(
        "restarting as attempt 1", use_inner_text=True
    )
