"""The dashboard as a person sees it: a real `jupyter lab`, a headless Chromium, real ranks.

Every assertion reads the rendered page (scoped to a cell's output area), and every test ends
with no process of its job alive. Screenshots go to test-output/browser/.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.kernel import assert_job_gone, wait_for
from tests.lab import CHROMIUM, CHROMIUM_ARGS, LabServer, Notebook, chromium_missing

SHOTS = Path(__file__).resolve().parent.parent / "test-output" / "browser"


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory, cache_home: Path) -> Iterator[LabServer]:
    missing = chromium_missing()
    if missing:
        pytest.fail(missing)  # a missing browser is a broken setup, not a reason to skip
    server = LabServer(tmp_path_factory.mktemp("lab"), {"XDG_CACHE_HOME": str(cache_home)})
    yield server
    server.stop()


@pytest.fixture(scope="module")
def browser(lab: LabServer) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture
def page(browser: Any) -> Iterator[Any]:
    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    yield page
    page.close()
    assert not errors, errors


def open_notebook(page: Any, lab: LabServer, name: str, cells: list[str]) -> Notebook:
    nb = Notebook(page, lab, lab.write_notebook(name, ["%load_ext elastic_nb", *cells]))
    nb.run(0)
    nb.wait_done(0)
    return nb


def job_of(nb: Notebook, cell: int) -> str:
    text = nb.cell(cell).locator(".enb-job").first.inner_text()
    m = re.fullmatch(r"job ([0-9a-f]{8})", text)
    assert m, text
    return m.group(1)


def shot(page: Any, locator: Any, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    locator.scroll_into_view_if_needed()
    page.screenshot(path=str(SHOTS / name), full_page=False)


def test_rank_chips_appear_while_the_cell_runs(page: Any, lab: LabServer) -> None:
    nb = open_notebook(
        page,
        lab,
        "running.ipynb",
        [
            "%%elastic --nproc 2\n"
            "import os, time\n"
            "for step in range(10_000):\n"
            "    print(f'rank {os.environ[\"RANK\"]} step {step}', flush=True)\n"
            "    time.sleep(0.2)\n"
        ],
    )
    nb.run(1)
    dash = nb.cell(1).locator(".enb")
    chips = dash.locator(".enb-chip")
    # Both chips running, each showing its rank's latest line, while the cell still runs.
    for r in (0, 1):
        chip = dash.locator(f'.enb-chip[data-rank="{r}"]')
        chip.locator(".enb-chip-last", has_text=re.compile(rf"rank {r} step \d+")).wait_for(
            timeout=90_000
        )
        assert "enb-s-running" in chip.get_attribute("class")
    assert chips.count() == 2 and nb.running(1)
    assert dash.locator(".enb-state").inner_text() == "running"
    assert "Interrupt the kernel" in dash.locator(".enb-hint").inner_text()
    assert not dash.locator(".enb-stop").is_visible()  # a busy kernel could not act on it
    # The log tab follows: rank 1's tab shows rank 1's lines only.
    dash.locator('.enb-tab[data-tab="1"]').click()
    dash.locator(".enb-log", has_text="rank 1 step").wait_for()
    assert "rank 0 step" not in dash.locator(".enb-log").inner_text()
    shot(page, dash, "dashboard-running.png")
    job = job_of(nb, 1)

    nb.interrupt()
    nb.wait_done(1, timeout=30)
    assert dash.locator(".enb-state").inner_text() == "interrupted"
    assert "KeyboardInterrupt" in nb.text(1)
    assert_job_gone(job)


def test_a_failing_rank_is_named_on_its_chip_and_in_the_alert(page: Any, lab: LabServer) -> None:
    nb = open_notebook(
        page,
        lab,
        "failing.ipynb",
        [
            "%%elastic --nproc 2\n"
            "import torch, torch.distributed as dist\n"
            "dist.init_process_group()\n"
            "if dist.get_rank() == 1:\n"
            "    raise ValueError('rank 1 ran out of patience')\n"
            "dist.all_reduce(torch.ones(1))   # rank 0 waits here\n"
        ],
    )
    nb.run(1)
    nb.wait_done(1)
    dash = nb.cell(1).locator(".enb")
    assert dash.locator(".enb-state").inner_text() == "failed"
    failed = dash.locator(".enb-chip.enb-s-failed")
    assert failed.count() == 1 and failed.get_attribute("data-rank") == "1"
    assert failed.locator(".enb-chip-label").inner_text() == "ValueError"
    assert "enb-s-failed" not in dash.locator('.enb-chip[data-rank="0"]').get_attribute("class")
    alert = dash.locator('.enb-alert[data-kind="failure"]')
    assert alert.locator(".enb-alert-rank").inner_text() == "rank 1"
    title = alert.locator(".enb-alert-title").inner_text()
    assert "rank 1 failed first: ValueError: rank 1 ran out of patience (cell line 5)" in title
    assert "raise ValueError('rank 1 ran out of patience')" in alert.locator("details").inner_text()
    assert "JobFailed: rank 1 failed first" in nb.text(1)  # and the cell raised
    shot(page, dash, "dashboard-failed.png")
    assert_job_gone(job_of(nb, 1))


def test_a_log_flood_renders_and_the_page_stays_responsive(page: Any, lab: LabServer) -> None:
    nb = open_notebook(
        page,
        lab,
        "flood.ipynb",
        [
            "%%elastic --nproc 4\n"
            "import os\n"
            "r = os.environ['RANK']\n"
            "for i in range(20_000):\n"
            "    print(f'rank {r} line {i}')\n",
            "6 * 7",
        ],
    )
    nb.run(1)
    nb.wait_done(1, timeout=180)
    dash = nb.cell(1).locator(".enb")
    assert dash.locator(".enb-state").inner_text() == "succeeded"
    for r in range(4):
        dash.locator(f'.enb-tab[data-tab="{r}"]').click()
        log = dash.locator(".enb-log").inner_text().splitlines()
        assert log[-1] == f"rank {r} line 19999"
        assert 0 < len(log) <= 1001  # a bounded tail, and a note of what it left out
        assert any(re.match(r"\.\.\. [\d,]+ lines not shown \(full log: ", x) for x in log)
    # The page is still ours: the next cell runs and shows its result.
    nb.run(2)
    nb.wait_done(2, timeout=30)
    assert nb.text(2) == "42"
    assert_job_gone(job_of(nb, 1))


def test_the_stop_button_ends_a_background_job(page: Any, lab: LabServer) -> None:
    nb = open_notebook(
        page,
        lab,
        "background.ipynb",
        ["%%elastic --bg --nproc 2\nimport time\nprint('up', flush=True)\ntime.sleep(600)\n"],
    )
    nb.run(1)
    nb.wait_done(1, timeout=30)  # the cell returns at once; the job runs on
    dash = nb.cell(1).locator(".enb")
    for r in (0, 1):
        chip = dash.locator(f'.enb-chip[data-rank="{r}"]')
        chip.locator(".enb-chip-last", has_text="up").wait_for(timeout=90_000)
    job = job_of(nb, 1)
    # The kernel is idle, so the buttons work: first every rank's stack, then stop.
    dash.locator(".enb-stacks").click()
    stacks = dash.locator('.enb-alert[data-kind="stacks"]')
    stacks.wait_for(timeout=30_000)
    stacks.locator("summary").click()
    text = stacks.locator("details").inner_text()
    assert "rank 0 · cell line 4: time.sleep(600)" in text
    assert "rank 1 · cell line 4: time.sleep(600)" in text
    assert stacks.locator(".enb-stacks-grid pre").count() == 2  # side by side
    dash.locator(".enb-stop").click()
    dash.locator(".enb-state", has_text="stopped").wait_for(timeout=30_000)
    assert not dash.locator(".enb-stop").is_visible()
    # The background thread's summary line lands under the cell that started the job.
    stdout = nb.cell(1).locator('[data-mime-type="application/vnd.jupyter.stdout"]')
    stdout.filter(has_text=f"job {job} stopped").wait_for(timeout=10_000)
    shot(page, dash, "dashboard-background-stopped.png")
    assert wait_for(lambda: not _job_processes(job), timeout=10)


def _job_processes(job: str) -> list[Any]:
    from elastic_nb import procs

    return procs.job_processes([job])
