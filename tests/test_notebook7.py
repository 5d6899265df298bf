"""The dashboard in Notebook 7: a real `jupyter notebook`, a headless Chromium, real ranks.

Notebook 7 loads the same federated extensions as JupyterLab (anywidget, the widget manager),
but in a page of its own (`/notebooks/NAME`): this checks the docs' promise that the
dashboard draws there, with the same driver and assertions as tests/test_browser.py.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect

from tests.kernel import assert_job_gone
from tests.lab import (
    LabServer,
    browser_fixture,  # noqa: F401  (the fixture `browser`)
    has_class,
    job_of,
    open_notebook,
    page_fixture,  # noqa: F401  (the fixture `page`)
    serve,
    shot,
)
from tests.scenarios import (
    CHECKPOINTED_RESTART,
    debug_a_rank_in_the_input_box,
    expect_a_checkpointed_restart,
    run_the_desync_and_the_hang,
)

pytestmark = pytest.mark.browser

# Notebook 7.6.5's keyboard-shortcuts plugin reads the schema of a plugin whose settings it has
# not loaded, on any notebook page (seen here with only `1+1` in it, elastic_nb not loaded).
KNOWN_PAGE_ERRORS = [
    ("Cannot read properties of undefined (reading 'schema')", "/static/notebook/notebook_core."),
]


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory, cache_home: Path) -> Iterator[LabServer]:
    yield from serve(tmp_path_factory, cache_home, "notebook")


def test_the_dashboard_renders_in_notebook_7(page: Any, lab: LabServer) -> None:
    nb = open_notebook(
        page,
        lab,
        "notebook7.ipynb",
        [
            "%%elastic --nproc 2\n"
            "import torch, torch.distributed as dist\n"
            "dist.init_process_group()\n"
            "x = torch.ones(1) * (dist.get_rank() + 1)\n"
            "dist.all_reduce(x)\n"
            "print('sum', x.item(), flush=True)\n"
            "x.item()\n"
        ],
    )
    # The page is Notebook 7's, not JupyterLab's.
    expect(page).to_have_url(re.compile(r"/notebooks/notebook7\.ipynb$"))
    expect(page.get_by_role("button", name="JupyterLab")).to_be_visible()  # "open in Lab"
    nb.run(1)
    nb.wait_done(1)
    dash = nb.cell(1).locator(".enb")
    expect(dash.locator(".enb-state")).to_have_text("succeeded")
    chips = dash.locator(".enb-chip")
    expect(chips).to_have_count(2)
    for r in (0, 1):
        chip = dash.locator(f'.enb-chip[data-rank="{r}"]')
        expect(chip).to_have_class(has_class("enb-s-done"))
        expect(chip.locator(".enb-chip-label")).to_have_text("exited 0")
        expect(chip.locator(".enb-chip-last")).to_have_text("sum 3.0")
    nb.expect_output(1, "3.0")  # rank 0's last expression, the cell's result
    shot(page, dash, "dashboard-notebook7.png")
    assert_job_gone(job_of(nb, 1))


def test_a_checkpointed_restart_in_notebook_7(page: Any, lab: LabServer, tmp_path: Path) -> None:
    """The same screen as in JupyterLab (tests/test_browser.py): the restart counted, the
    timeline drawn, its words said once."""
    cell = CHECKPOINTED_RESTART.format(ckpt=tmp_path / "ckpt")
    nb = open_notebook(page, lab, "notebook7-restart.ipynb", [cell])
    nb.run(1)
    nb.wait_done(1, timeout=120)
    dash = nb.cell(1).locator(".enb")
    expect_a_checkpointed_restart(dash)
    shot(page, dash, "dashboard-notebook7-restart.png")
    assert_job_gone(job_of(nb, 1))


def test_a_desync_and_a_hang_ended_by_the_timeout_in_notebook_7(page: Any, lab: LabServer) -> None:
    """The same screen as in JupyterLab: the desync said once, the hang's finding kept."""
    run_the_desync_and_the_hang(page, lab, "notebook7-forensics.ipynb", "dashboard-notebook7-")


def test_pdb_on_a_rank_takes_commands_in_notebook_7s_input_box(page: Any, lab: LabServer) -> None:
    """The docs' frontends with an input box: Notebook 7's, as JupyterLab's."""
    debug_a_rank_in_the_input_box(
        page, lab, "notebook7-debugging.ipynb", "notebook7-debugging-pdb-prompt.png"
    )
