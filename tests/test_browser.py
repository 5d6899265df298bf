"""The dashboard as a person sees it: a real `jupyter lab`, a headless Chromium, real ranks.

Every assertion reads the rendered page (scoped to a cell's output area), and every test ends
with no process of its job alive. Screenshots go to test-output/browser/.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nbformat
import pytest
from playwright.sync_api import expect

from tests.kernel import assert_job_gone, wait_for
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


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory, cache_home: Path) -> Iterator[LabServer]:
    yield from serve(tmp_path_factory, cache_home, "lab")


def test_rank_chips_appear_while_the_cell_runs(page: Any, lab: LabServer, tmp_path: Path) -> None:
    nb = open_notebook(
        page,
        lab,
        "running.ipynb",
        [
            f"%%elastic --nproc 2 --env ELASTIC_NB_CHECKPOINT_DIR={tmp_path}\n"
            "import os, time, torch, torch.distributed as dist\n"
            "from elastic_nb import checkpoint\n"
            "dist.init_process_group()\n"
            "checkpoint.save(3, torch.nn.Linear(2, 2), async_save=True)\n"
            "checkpoint.wait()\n"
            "held = []\n"
            "for step in range(10_000):\n"
            "    print(f'rank {os.environ[\"RANK\"]} step {step}', flush=True)\n"
            "    held.append(b'\\x01' * 5_000_000 * int(os.environ['RANK']))  # rank 1 grows\n"
            "    time.sleep(0.2)\n"
        ],
    )
    nb.run(1)
    dash = nb.cell(1).locator(".enb")
    try:
        # Both chips running, each showing its rank's latest line, while the cell still runs.
        for r in (0, 1):
            chip = dash.locator(f'.enb-chip[data-rank="{r}"]')
            expect(chip.locator(".enb-chip-last")).to_contain_text(
                re.compile(rf"rank {r} step \d+"), timeout=90_000
            )
            expect(chip).to_have_class(has_class("enb-s-running"))
        expect(dash.locator(".enb-chip")).to_have_count(2)
        # The header names the latest checkpoint, its age and size; its tooltip how it was written
        # (an async save: how long it blocked training and how long it ran beside it) and where.
        expect(dash.locator(".enb-checkpoint")).to_have_text(
            re.compile(r"^checkpoint: step 3 · [\d.]+ s ago · \d+ KiB$")
        )
        took = r"(?:[\d.]+ s|\d+ min(?: \d+ s)?)"  # report.duration's words
        expect(dash.locator(".enb-checkpoint")).to_have_attribute(
            "title",
            re.compile(
                rf"^written in {took} by 2 ranks \(async: {took} blocking training, {took} beside "
                rf"it\)\n{re.escape(str(tmp_path))}/step-000000000003-[0-9a-f]+$"
            ),
        )
        # Each chip draws its rank's memory: a sparkline of its samples (one a second) on the job's
        # one scale, the latest figure and the peak; rank 1's climbs (its growth a minute shown)
        # until it holds twice rank 0's, and is flagged as the outlier.
        for r in (0, 1):
            chip = dash.locator(f'.enb-chip[data-rank="{r}"]')
            expect(chip.locator(".enb-spark polyline.enb-spark-host")).to_have_attribute(
                "points", re.compile(r"^(\S+ ){3,}\S+$"), timeout=30_000
            )
        size = r"[\d.]+ [KMG]iB"
        # (Rank 0 grows too while it starts, under load for a while: its growth may show.)
        share = rf"\([\d.]+% of {size}\)"  # of the host memory its ranks may use
        expect(dash.locator('.enb-chip[data-rank="0"] .enb-chip-mem-text')).to_have_text(
            re.compile(rf"^{size} host {share} · peak {size}(?: · [+−]{size}/min)?$")
        )
        rank1 = dash.locator('.enb-chip[data-rank="1"] .enb-chip-mem')
        expect(rank1.locator(".enb-chip-mem-text")).to_have_text(
            re.compile(rf"^{size} host {share} · peak {size} · \+{size}/min · [\d.]+× the others$"),
            timeout=60_000,
        )
        expect(rank1).to_have_class(has_class("enb-mem-outlier"))
        # Each chip holds its own words: none runs past its box into the next chip.
        spill = dash.locator(".enb-chip").evaluate_all(
            "chips => chips.filter(c => [...c.querySelectorAll('*')].some(e => "
            "e.getBoundingClientRect().right > c.getBoundingClientRect().right + 1))"
            ".map(c => c.dataset.rank)"
        )
        assert not spill, spill

        def heights(r: int) -> list[float]:
            line = dash.locator(f'.enb-chip[data-rank="{r}"] polyline.enb-spark-host')
            return [float(p.split(",")[1]) for p in (line.get_attribute("points") or "").split()]

        assert heights(1)[-1] < heights(1)[0]  # higher up the chip: more memory
        assert heights(0)[-1] > heights(1)[-1]  # one scale: rank 0 holds less, its line is lower
        nb.expect_running(1)
        expect(dash.locator(".enb-state")).to_have_text("running")
        # Its ranks made a process group: the header says what a stuck collective would do.
        expect(dash.locator(".enb-worst")).to_have_text(
            re.compile(r"^a stuck collective fails the cell within [\d.]+ s$")
        )
        expect(dash.locator(".enb-hint")).to_contain_text(
            "Interrupt the kernel", use_inner_text=True
        )
        expect(dash.locator(".enb-stop")).to_be_hidden()  # a busy kernel could not act on it
        # The log tab follows: rank 1's tab shows rank 1's lines only.
        dash.locator('.enb-tab[data-tab="1"]').click()
        log = dash.locator(".enb-log")
        expect(log).to_contain_text("rank 1 step", use_inner_text=True)
        expect(log).not_to_contain_text("rank 0 step", use_inner_text=True)
        shot(page, dash, "dashboard-running.png")
        job = job_of(nb, 1)
    finally:
        # Whatever failed above, the job ends here: nothing of it reaches the next test.
        nb.interrupt()
        nb.wait_done(1, timeout=30)
    expect(dash.locator(".enb-state")).to_have_text("interrupted")
    nb.expect_output(1, "KeyboardInterrupt")
    assert_job_gone(job)


def test_a_failed_cell_says_each_thing_once(page: Any, lab: LabServer) -> None:
    """A failing cell and a succeeding one under the dashboard, as a person sees them: the
    failing rank on its chip and in the alert; the failing rank's traceback, the summary line
    and the verdict's headline each shown once (the headline: the alert's title and the
    error's first line), the start line not at all (the header says it); the verdict on the
    cell's first screen. The saved notebook carries the start line and the summary, once
    each, for readers that draw no widgets."""
    nb = open_notebook(page, lab, "failing.ipynb", [FAILING, "%%elastic --nproc 2\nprint('hi')\n"])
    nb.run(1)
    nb.wait_done(1)
    dash = nb.cell(1).locator(".enb")
    expect(dash.locator(".enb-state")).to_have_text("failed")
    failed = dash.locator(".enb-chip.enb-s-failed")
    expect(failed).to_have_count(1)
    expect(failed).to_have_attribute("data-rank", "1")
    expect(failed.locator(".enb-chip-label")).to_have_text("ValueError")
    expect(dash.locator('.enb-chip[data-rank="0"]')).not_to_have_class(has_class("enb-s-failed"))
    alert = dash.locator('.enb-alert[data-kind="failure"]')
    expect(alert.locator(".enb-alert-rank")).to_have_text("rank 1")
    expect(alert.locator(".enb-alert-title")).to_contain_text(HEADLINE, use_inner_text=True)
    nb.expect_output(1, f"JobFailed: {HEADLINE}")  # and the cell raised
    job = job_of(nb, 1)
    # The end has been drawn: the alert's detail and the logs are closed, the error has them.
    expect(alert.locator("summary")).to_have_text("details (in the error below)")
    expect(dash.locator(".enb-logs")).not_to_have_attribute("open", re.compile(".*"))
    seen = _seen(nb, 1)
    assert seen.count(TRACEBACK_LINE) == 1, seen
    assert seen.count(HEADLINE) == 2, seen
    assert seen.count(f"[elastic_nb] job {job} failed · cause: exception · 2 ranks") == 1, seen
    assert seen.count(f"[elastic_nb] job {job}") == 1, seen  # the summary, no start line
    assert "starting 2 ranks" not in seen, seen
    # The verdict is on the cell's first screen: the error starts within a third of a screen
    # of the outputs' top (under a dashboard with its logs open it started 530 px down).
    outputs = nb.cell(1).locator(".jp-OutputArea").bounding_box()
    error = nb.cell(1).locator(f'[data-mime-type="{STDERR}"]').bounding_box()
    assert error["y"] - outputs["y"] < page.viewport_size["height"] / 3, (outputs, error)
    shot(page, nb.cell(1), "dashboard-failed.png")
    # One click away: the alert's detail, and the logs (a tab opens them).
    alert.locator("summary").click()
    expect(alert.locator("details")).to_contain_text(TRACEBACK_LINE, use_inner_text=True)
    dash.locator('.enb-tab[data-tab="1"]').click()
    expect(dash.locator(".enb-log")).to_contain_text(TRACEBACK_LINE, use_inner_text=True)
    assert_job_gone(job)

    nb.run(2)
    nb.wait_done(2)
    dash = nb.cell(2).locator(".enb")
    expect(dash.locator(".enb-state")).to_have_text("succeeded")
    expect(dash.locator(".enb-log")).to_contain_text("[rank 1] hi", use_inner_text=True)
    ok = job_of(nb, 2)
    seen = _seen(nb, 2)
    assert seen.count(f"[elastic_nb] job {ok} succeeded · 2 ranks") == 1, seen
    assert seen.count(f"[elastic_nb] job {ok}") == 1 and "starting 2 ranks" not in seen, seen
    assert seen.count("[rank 0] hi") == 1, seen  # the log, open

    # Saved (JupyterLab's own save, no widget state): each dashboard's text is its start line.
    page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
    path = lab.root / "failing.ipynb"
    assert wait_for(lambda: len(_saved_text(path, 2)) > 0, timeout=30)
    for cell, job_id, outcome in ((1, job, "failed"), (2, ok, "succeeded")):
        saved = _saved_text(path, cell)
        assert saved.count(f"[elastic_nb] job {job_id}: starting 2 ranks (") == 1, saved
        assert saved.count(f"[elastic_nb] job {job_id} {outcome} · ") == 1, saved
    assert _saved_text(path, 1).count(TRACEBACK_LINE) == 1
    assert_job_gone(ok)


FAILING = (
    "%%elastic --nproc 2\n"
    "import torch, torch.distributed as dist\n"
    "dist.init_process_group()\n"
    "if dist.get_rank() == 1:\n"
    "    raise ValueError('rank 1 ran out of patience')\n"
    "dist.all_reduce(torch.ones(1))   # rank 0 waits here\n"
)
HEADLINE = "rank 1 failed first: ValueError: rank 1 ran out of patience (cell line 5)"
TRACEBACK_LINE = "raise ValueError('rank 1 ran out of patience')"
STDERR = "application/vnd.jupyter.stderr"


def _seen(nb: Any, cell: int) -> str:
    """What a person sees in the cell's outputs: innerText leaves out what is not rendered
    (the content of a closed <details>, hidden elements)."""
    return nb.cell(cell).locator(".jp-OutputArea").inner_text()


def _saved_text(path: Path, cell: int) -> str:
    """The text a saved notebook's outputs carry for readers that draw no widgets: streams,
    each display's text/plain, the error's traceback."""
    nb = nbformat.read(path, as_version=4)
    outputs = nb.cells[cell].outputs if len(nb.cells) > cell else []
    texts = []
    for o in outputs:
        if o.output_type == "stream":
            texts.append(o.text)
        elif o.output_type in ("display_data", "execute_result"):
            texts.append(o.data.get("text/plain", ""))
        elif o.output_type == "error":
            texts.extend(re.sub(r"\x1b\[[0-9;]*m", "", t) for t in o.traceback)
    return "\n".join(texts)


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
    expect(dash.locator(".enb-state")).to_have_text("succeeded")
    log = dash.locator(".enb-log")
    for r in range(4):
        dash.locator(f'.enb-tab[data-tab="{r}"]').click()
        # A bounded tail (at most 1,001 lines, the last one the rank's last) ...
        expect(log).to_have_text(
            re.compile(rf"^(?:[^\n]*\n){{0,1000}}rank {r} line 19999\n?$"), use_inner_text=True
        )
        # ... with a note of what it left out.
        expect(log).to_contain_text(
            re.compile(r"(?:^|\n)\.\.\. [\d,]+ lines not shown \(full log: "), use_inner_text=True
        )
    # The page is still ours: the next cell runs and shows its result.
    nb.run(2)
    nb.wait_done(2, timeout=30)
    expect(nb.outputs(2)).to_have_text(["42"], use_inner_text=True)
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
        expect(chip.locator(".enb-chip-last")).to_contain_text("up", timeout=90_000)
    job = job_of(nb, 1)
    # The kernel is idle, so the buttons work: first every rank's stack, then stop.
    dash.locator(".enb-stacks").click()
    stacks = dash.locator('.enb-alert[data-kind="stacks"]')
    expect(stacks).to_be_visible()
    stacks.locator("summary").click()
    details = stacks.locator("details")
    for r in (0, 1):
        expect(details).to_contain_text(
            f"rank {r} · cell line 4: time.sleep(600)", use_inner_text=True
        )
    expect(stacks.locator(".enb-stacks-grid pre")).to_have_count(2)  # side by side
    dash.locator(".enb-stop").click()
    expect(dash.locator(".enb-state")).to_have_text("stopped")
    expect(dash.locator(".enb-stop")).to_be_hidden()
    # The background thread's summary line lands under the cell that started the job.
    stdout = nb.cell(1).locator('[data-mime-type="application/vnd.jupyter.stdout"]')
    expect(stdout).to_contain_text([f"job {job} stopped"], timeout=10_000)
    shot(page, dash, "dashboard-background-stopped.png")
    assert wait_for(lambda: not _job_processes(job), timeout=10)


def test_a_session_cell_shows_its_session_and_a_partial_failure(page: Any, lab: LabServer) -> None:
    """`%elastic up`, then two bare cells on its ranks: the header names the session and the
    cell; a cell that raises on rank 1 while rank 0 sleeps in Python fails it, and rank 0 is
    interrupted (stopped), not restarted."""
    nb = open_notebook(
        page,
        lab,
        "session.ipynb",
        [
            "%elastic up --nproc 2",
            "%%elastic\n"
            "import os\n"
            "print(f'hello from rank {os.environ[\"RANK\"]}', flush=True)\n"
            "6 * 7\n",
            "%%elastic\n"
            "import os, time\n"
            "if int(os.environ['RANK']) == 1:\n"
            "    raise ValueError('x')\n"
            "time.sleep(60)\n",
            "%%elastic\n"
            "import os, time\n"
            "time.sleep(1)\n"
            "if int(os.environ['RANK']) == 1:\n"
            "    os._exit(1)\n"
            "time.sleep(60)\n",
            "%elastic down",
        ],
    )
    nb.run(1)
    nb.wait_done(1)
    session = _match(
        _stdout(nb, 1), re.compile(r"\[elastic_nb\] session ([0-9a-f]{8}): 2 ranks up")
    )

    # A cell on the session: each rank's line, its value, the session in the header.
    nb.run(2)
    nb.wait_done(2)
    dash = nb.cell(2).locator(".enb")
    cell = _match(
        dash.locator(".enb-job"), re.compile(rf"^session {session} · cell ([0-9a-f]{{8}})$")
    )
    expect(_stdout(nb, 2)).to_contain_text([f"[elastic_nb] job {cell} succeeded · 2 ranks"])
    expect(dash.locator(".enb-restarts")).to_have_text("session attempt 0 · restarts 0/3")
    expect(dash.locator(".enb-state")).to_have_text("succeeded")
    expect(dash.locator(".enb-chip")).to_have_count(2)
    for r in (0, 1):
        chip = dash.locator(f'.enb-chip[data-rank="{r}"]')
        expect(chip).to_have_class(has_class("enb-s-done"))
        expect(chip.locator(".enb-chip-label")).to_have_text("finished")
        expect(chip.locator(".enb-chip-last")).to_have_text(f"hello from rank {r}")
    result = nb.cell(2).locator(".jp-OutputArea-executeResult .jp-OutputArea-output")
    expect(result).to_have_text("42")

    # Rank 1 raises while rank 0 sleeps: rank 0 is interrupted, the session keeps both.
    nb.run(3)
    nb.wait_done(3)
    dash = nb.cell(3).locator(".enb")
    failing = _match(
        dash.locator(".enb-job"), re.compile(rf"^session {session} · cell ([0-9a-f]{{8}})$")
    )
    assert failing != cell
    expect(dash.locator(".enb-restarts")).to_have_text("session attempt 0 · restarts 0/3")
    expect(dash.locator(".enb-state")).to_have_text("failed")
    rank1 = dash.locator('.enb-chip[data-rank="1"]')
    expect(rank1).to_have_class(has_class("enb-s-failed"))
    expect(rank1.locator(".enb-chip-label")).to_have_text("ValueError")
    rank0 = dash.locator('.enb-chip[data-rank="0"]')
    expect(rank0).to_have_class(has_class("enb-s-stopped"))
    expect(rank0.locator(".enb-chip-label")).to_have_text("KeyboardInterrupt")
    alert = dash.locator('.enb-alert[data-kind="failure"]')
    expect(alert.locator(".enb-alert-title")).to_contain_text(
        "rank 1 failed first: ValueError: x (cell line 4)", use_inner_text=True
    )
    nb.expect_output(3, "JobFailed: rank 1 failed first: ValueError: x (cell line 4)")
    expect(nb.outputs(3).last).to_contain_text(
        "; the session keeps its ranks and state", use_inner_text=True
    )
    shot(page, dash, "dashboard-session-failed.png")

    # Rank 1 exits: the session restarts and replays the journal (cell 2) under this cell. Its
    # dashboard ends on its own attempt: rank 1's chip says how it ended, the header counts the
    # restart it brought, and the replay is one alert that grew to its end.
    nb.run(4)
    nb.wait_done(4, timeout=90)
    dash = nb.cell(4).locator(".enb")
    expect(dash.locator(".enb-state")).to_have_text("failed")
    expect(dash.locator(".enb-restarts")).to_have_text("session attempt 0 · restarts 1/3")
    rank1 = dash.locator('.enb-chip[data-rank="1"]')
    expect(rank1).to_have_class(has_class("enb-s-failed"))
    expect(rank1.locator(".enb-chip-label")).to_have_text("exit code 1")
    replay = dash.locator('.enb-alert[data-kind="replay"]')
    expect(replay).to_have_count(1)
    expect(replay.locator(".enb-alert-title")).to_contain_text(
        "the session's state is back: 1 cell replayed in", use_inner_text=True
    )
    shot(page, dash, "dashboard-session-restarted.png")

    nb.run(5)
    nb.wait_done(5, timeout=30)
    expect(_stdout(nb, 5)).to_contain_text([f"session {session} ended"])
    assert wait_for(lambda: not _job_processes(session), timeout=10)


def _stdout(nb: Any, cell: int) -> Any:
    return nb.cell(cell).locator('[data-mime-type="application/vnd.jupyter.stdout"]')


def _match(locator: Any, pattern: re.Pattern[str]) -> str:
    """The first group of `pattern` in the text of `locator`, once the page shows it."""
    expect(locator).to_contain_text([pattern], use_inner_text=True)
    m = pattern.search("\n".join(locator.all_inner_texts()))
    assert m, pattern
    return m.group(1)


def _job_processes(job: str) -> list[Any]:
    from elastic_nb.common import procs

    return procs.job_processes([job])


# The six scenarios of what the screen says (issue 34): memory growth on one rank
# (test_rank_chips_appear_while_the_cell_runs), a session whose rank dies
# (test_a_session_cell_shows_its_session_and_a_partial_failure), and these four.


def test_a_checkpointed_restart_on_the_timeline(page: Any, lab: LabServer, tmp_path: Path) -> None:
    """Rank 1 fails after a save; the job restarts from the checkpoint and succeeds
    (scenarios.expect_a_checkpointed_restart says what the screen says then)."""
    cell = CHECKPOINTED_RESTART.format(ckpt=tmp_path / "ckpt")
    nb = open_notebook(page, lab, "restart.ipynb", [cell])
    nb.run(1)
    nb.wait_done(1, timeout=120)
    dash = nb.cell(1).locator(".enb")
    expect_a_checkpointed_restart(dash)
    shot(page, dash, "dashboard-checkpointed-restart.png")
    assert_job_gone(job_of(nb, 1))


def test_a_desync_and_a_hang_ended_by_the_timeout(page: Any, lab: LabServer) -> None:
    """A rank skips a collective, then a hang that --timeout ends
    (scenarios.run_the_desync_and_the_hang says what the screen says after each)."""
    run_the_desync_and_the_hang(page, lab, "forensics.ipynb", "dashboard-")


def test_a_node_lost_from_a_three_node_job(page: Any, lab: LabServer) -> None:
    """The dashboard of a 3-node job that lost a node (one kept from a real run of
    test_multinode's, tests/data/history-node-lost.json, folded by the kernel's model as it
    folds one live and drawn from its snapshot as a reload draws it): every figure agrees with
    the run's records. Its world is 4 after 6, one restart spent; the timeline has a lane a
    node, the lost node's ending where it left, marked; attempt 0's ranks all ended (none stays
    "running"); the lost node's ranks keep their log tabs."""
    history = Path(__file__).parent / "data" / "history-node-lost.json"
    repo = Path(__file__).resolve().parent.parent
    nb = open_notebook(
        page,
        lab,
        "node-lost.ipynb",
        [
            f"import json, sys\nsys.path.insert(0, {str(repo)!r})\n"
            "from tests.kernel import history_dashboard\n"
            "from elastic_nb.kernel.dashboard.widget import DashboardWidget\n"
            f"state = history_dashboard(json.loads(open({str(history)!r}).read()))\n"
            "state.take_delta()\n"
            "DashboardWidget(snapshot=state.snapshot(), text='a node lost')\n"
        ],
    )
    nb.run(1)
    nb.wait_done(1)
    dash = nb.cell(1).locator(".enb")
    expect(dash.locator(".enb-state")).to_have_text("succeeded")
    expect(dash.locator(".enb-world")).to_have_text("4 ranks")
    expect(dash.locator(".enb-restarts")).to_have_text("restarts 1/1")
    expect(dash.locator(".enb-chip")).to_have_count(4)
    expect(dash.locator(".enb-tab")).to_have_text(
        ["all ranks"] + [f"rank {r}" for r in range(6)]  # the lost node's ranks keep theirs
    )
    timeline = dash.locator(".enb-attempts")
    lanes = timeline.locator(".enb-tl-lane:not(.enb-tl-axis)")
    expect(lanes.locator(".enb-tl-name")).to_have_text(
        ["node 0 (vm)", "node 1 (node-1)", "node 2 (node-2)"]
    )
    for lane in (0, 1):
        expect(lanes.nth(lane).locator(".enb-tl-bar")).to_have_count(2)
        expect(lanes.nth(lane).locator(".enb-tl-left")).to_have_count(0)
    lost = lanes.nth(2)
    expect(lost.locator(".enb-tl-bar")).to_have_count(1)
    expect(lost.locator(".enb-tl-bar")).to_have_class(has_class("enb-o-restarted"))
    expect(lost.locator(".enb-tl-left")).to_have_attribute(
        "title", re.compile(r"^node 2 \(node-2\) rank 4 was lost: its node left")
    )
    first = timeline.locator('.enb-attempt[data-attempt="0"]')
    expect(first.locator(".enb-dot")).to_have_count(6)
    expect(first.locator(".enb-dot.enb-s-running")).to_have_count(0)
    expect(first.locator(".enb-attempt-why")).to_have_text(
        re.compile(r"^ended: node 2 \(node-2\) rank 4 was lost: its node left")
    )
    second = timeline.locator('.enb-attempt[data-attempt="1"]')
    expect(second.locator(".enb-round-nodes")).to_have_text(
        "node 0 (vm), node 1 (node-1) · world size 4"
    )
    expect(second.locator(".enb-round-spent")).to_have_text("restart 1")
    expect(dash.locator('.enb-alert[data-kind="restart"]')).to_be_hidden()
    shot(page, dash, "dashboard-node-lost.png")


def test_pdb_on_a_rank_takes_commands_in_jupyterlabs_input_box(page: Any, lab: LabServer) -> None:
    debug_a_rank_in_the_input_box(page, lab, "debugging.ipynb", "debugging-pdb-prompt.png")
