"""The JupyterLab extension as a person uses it: a real `jupyter lab` serving the extension built
from this tree (and the server extension), a headless Chromium, real kernels and ranks.

The Elastic jobs panel acts on a job while a blocking `%%elastic` cell keeps its kernel busy
(a busy kernel does not hear widget clicks): its buttons go through the Jupyter server to the
supervisor. Screenshots go to test-output/browser/ (labext-*.png).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect

from tests.kernel import assert_job_gone, job_processes, wait_for
from tests.lab import (
    SHOTS,
    LabServer,
    Notebook,
    browser_fixture,  # noqa: F401  (the fixture `browser`)
    has_class,
    job_of,
    open_notebook,
    page_fixture,  # noqa: F401  (the fixture `page`)
    serve,
)

pytestmark = pytest.mark.browser


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory, cache_home: Path) -> Iterator[LabServer]:
    yield from serve(tmp_path_factory, cache_home, "lab")


PLAIN = "import os\nfor step in range(3):\n    print(step)\n"


@pytest.mark.parametrize(
    "magic",
    [
        "%%elastic --nproc 2",
        # A colon and a quote in the flags (an endpoint, an environment value) must not leave
        # the parser inside a block or a string for the cell's own lines.
        "%%elastic --nproc 2 --rdzv-endpoint localhost:29500 --env GREETING=it's",
    ],
)
def test_an_elastic_cell_keeps_python_highlighting(page: Any, lab: LabServer, magic: str) -> None:
    """The lines under `%%elastic` are highlighted as Python, as in a plain cell: each keyword
    carries the same highlighting class as there, drawn in the theme's keyword colour."""
    name = f"highlight-{abs(hash(magic)) % 10_000}.ipynb"
    nb = Notebook(page, lab, lab.write_notebook(name, [PLAIN, f"{magic}\n{PLAIN}"]))
    keyword_color = page.evaluate(
        """() => {
            const probe = document.createElement('span');
            probe.style.color = 'var(--jp-mirror-editor-keyword-color)';
            document.body.append(probe);
            const color = getComputedStyle(probe).color;
            probe.remove();
            return color;
        }"""
    )
    for word in ("import", "for", "in"):
        plain = _token(nb, 0, word)
        expect(plain).to_have_attribute("class", re.compile(r"\S"))  # highlighted, once loaded
        highlighted = plain.get_attribute("class")
        assert _color(plain) == keyword_color, (word, _color(plain), keyword_color)
        elastic = _token(nb, 1, word)
        expect(elastic).to_have_attribute("class", highlighted)
        assert _color(elastic) == keyword_color


def _token(nb: Notebook, cell: int, text: str) -> Any:
    """The editor's span for a token (the first with exactly this text)."""
    spans = nb.cell(cell).locator(".jp-InputArea-editor .cm-content span")
    return spans.filter(has_text=re.compile(rf"^{re.escape(text)}$")).first


def _color(locator: Any) -> str:
    return locator.evaluate("(e) => getComputedStyle(e).color")


STEPS = (
    "%%elastic --nproc 2\n"
    "import os, time\n"
    "for step in range(100_000):\n"
    "    print(f'rank {os.environ[\"RANK\"]} step {step}', flush=True)\n"
    "    time.sleep(0.2)\n"
)


def test_the_panel_follows_and_stops_a_busy_cell(page: Any, lab: LabServer) -> None:
    """A blocking cell keeps its kernel busy; the panel shows its job live, follows a rank's
    log in a tab, and its Stop ends the job: the cell ends reporting the stop, and no rank
    survives."""
    nb = open_notebook(page, lab, "panel-stop.ipynb", [STEPS])
    nb.run(1)
    job = job_of(nb, 1)
    panel = open_panel(page)
    card = panel.locator(f'.enb-panel-job[data-job="{job}"]')
    expect(card.locator(".enb-panel-title")).to_have_text(f"job {job}")
    expect(card.locator(".enb-panel-state")).to_have_text("running", timeout=90_000)
    expect(card.locator(".enb-panel-where")).to_have_text("panel-stop.ipynb")
    expect(card.locator(".enb-panel-facts")).to_contain_text("2 ranks · restarts 0/0 · ")
    # Live: the elapsed time moves on by itself.
    before = card.locator(".enb-panel-facts").inner_text()
    expect(card.locator(".enb-panel-facts")).not_to_have_text(before)
    indicator = nb.panel.locator(".jp-Toolbar .enb-indicator")
    expect(indicator).to_have_attribute("data-state", "running")
    expect(indicator).to_contain_text("elastic: running · 2 ranks · ")

    # Expanded, each rank's state and latest line follow the job's events.
    card.locator(".enb-panel-head").click()
    for r in (0, 1):
        row = card.locator(f'.enb-panel-rank-row[data-rank="{r}"]')
        expect(row.locator(".enb-panel-rank-label")).to_have_text("running")
        expect(row.locator(".enb-panel-rank-last")).to_have_text(re.compile(rf"rank {r} step \d+"))

    # Rank 1's log in a tab, following it as it grows.
    card.locator(".enb-panel-rank").select_option("1")
    card.locator(".enb-panel-logs").click()
    log = page.locator(f'.enb-log-view[data-job="{job}"][data-rank="1"] .enb-log-text')
    expect(log).to_contain_text(re.compile(r"rank 1 step \d+"))
    last = max(int(n) for n in re.findall(r"rank 1 step (\d+)", log.inner_text()))
    expect(log).to_contain_text(f"rank 1 step {last + 5}")  # a second later, by itself
    assert "rank 0 step" not in log.inner_text()
    page.screenshot(path=str(_shot("labext-panel-running.png")))

    nb.expect_running(1)  # the kernel is still busy in the cell
    card.locator(".enb-panel-stop").click()
    nb.wait_done(1, timeout=30)
    nb.expect_output(
        1,
        f"[elastic_nb] job {job} stopped",
        f"JobStopped: job {job} was stopped: stopped from the JupyterLab panel",
    )
    assert_job_gone(job)
    expect(card.locator(".enb-panel-state")).to_have_text("stopped")
    expect(card.locator(".enb-panel-stop")).to_be_hidden()
    expect(card.locator(".enb-panel-summary")).to_contain_text(f"job {job} stopped")
    # At the panel's default width nothing of the card is cut: it wraps (the summary ends with
    # the logs' path, the last thing "…" used to hide).
    expect(card.locator(".enb-panel-summary")).to_contain_text(re.compile(r"logs: /\S+$"))
    _whole(card.locator(".enb-panel-where, .enb-panel-facts, .enb-panel-summary, .enb-panel-alert"))
    expect(indicator).to_be_hidden()
    page.screenshot(path=str(_shot("labext-panel-stopped.png")))


HANG = "%%elastic --nproc 2\nimport time\nprint('up', flush=True)\ntime.sleep(600)\n"


def test_dump_stacks_of_a_hanging_job_then_stop_it_by_its_shortcut(
    page: Any, lab: LabServer
) -> None:
    nb = open_notebook(page, lab, "panel-stacks.ipynb", [HANG])
    nb.run(1)
    job = job_of(nb, 1)
    card = open_panel(page).locator(f'.enb-panel-job[data-job="{job}"]')
    card.locator(".enb-panel-head").click()
    for r in (0, 1):  # both ranks are in the sleep
        row = card.locator(f'.enb-panel-rank-row[data-rank="{r}"]')
        expect(row.locator(".enb-panel-rank-last")).to_have_text("up", timeout=90_000)
    card.locator(".enb-panel-stacks").click()
    view = page.locator(".enb-stacks-view")
    expect(view.locator(".enb-stacks-rank")).to_have_count(2)
    boxes = []
    for r in (0, 1):
        column = view.locator(f'.enb-stacks-rank[data-rank="{r}"]')
        expect(column.locator("pre")).to_contain_text(
            f"rank {r} · cell line 4: time.sleep(600)", use_inner_text=True
        )
        boxes.append(column.bounding_box())
    assert boxes[0]["y"] == boxes[1]["y"] and boxes[0]["x"] < boxes[1]["x"], boxes  # side by side
    page.screenshot(path=str(_shot("labext-stacks.png")))

    # The palette's command does it too, for the notebook's running job.
    page.locator(".lm-DockPanel-tabBar .lm-TabBar-tab", has_text=f"Stacks · job {job}").locator(
        ".lm-TabBar-tabCloseIcon"
    ).click()
    expect(view).to_have_count(0)
    nb.cell(1).locator(".jp-InputPrompt").click()  # the notebook is the current widget
    page.keyboard.press("Control+Shift+c")
    palette = page.locator(".lm-CommandPalette-input")
    palette.fill("Elastic: dump stacks of this notebook")
    palette.press("Enter")
    for r in (0, 1):
        expect(view.locator(f'.enb-stacks-rank[data-rank="{r}"] pre')).to_contain_text(
            f"rank {r} · cell line 4: time.sleep(600)", use_inner_text=True
        )

    # The stop shortcut, in the busy notebook (its editor has the focus).
    nb.expect_running(1)
    nb.cell(1).locator(".cm-content").click()
    page.keyboard.press("Control+Alt+s")
    nb.wait_done(1, timeout=30)
    nb.expect_output(
        1,
        f"[elastic_nb] job {job} stopped",
        f"JobStopped: job {job} was stopped: stopped from the JupyterLab panel",
    )
    assert_job_gone(job)


def test_a_session_and_its_cell_in_the_panel(page: Any, lab: LabServer) -> None:
    """A session shows as a job of kind "session", its running cell as a "cell" of it. The
    cell's Stop interrupts the cell and leaves the session up; the session's Stop (confirmed)
    takes it down."""
    nb = open_notebook(
        page,
        lab,
        "panel-session.ipynb",
        ["%elastic up --nproc 2", "%%elastic\nimport time\ntime.sleep(600)\n"],
    )
    nb.run(1)
    nb.wait_done(1)
    stdout = nb.cell(1).locator('[data-mime-type="application/vnd.jupyter.stdout"]')
    expect(stdout).to_contain_text(re.compile(r"session [0-9a-f]{8}: 2 ranks up"))
    session = re.search(r"session ([0-9a-f]{8}): 2 ranks up", stdout.inner_text()).group(1)
    panel = open_panel(page)
    up = panel.locator(f'.enb-panel-job[data-job="{session}"]')
    expect(up).to_have_attribute("data-kind", "session")
    expect(up.locator(".enb-panel-title")).to_have_text(f"session {session}")
    expect(nb.panel.locator(".jp-Toolbar .enb-indicator")).to_have_attribute(
        "data-state", "session"
    )

    nb.run(2)
    # (Scoped to this session: other supervisors of this user may show their own.)
    cell = panel.locator(
        f'.enb-panel-job[data-kind="cell"][data-session="{session}"][data-running="true"]'
    )
    expect(cell).to_have_count(1, timeout=60_000)
    expect(cell.locator(".enb-panel-facts")).to_contain_text(f"session {session}")
    # Grouped: the cell right under its session, set in.
    listed = panel.locator(".enb-panel-list > .enb-panel-job").evaluate_all(
        "cards => cards.map(c => c.dataset.job)"
    )
    assert listed.index(cell.get_attribute("data-job")) == listed.index(session) + 1, listed
    expect(cell).to_have_class(has_class("enb-panel-in-session"))
    page.screenshot(path=str(_shot("labext-panel-session.png")))
    # Drawn with the theme's own colours: dark in JupyterLab Dark.
    _theme(page, "JupyterLab Dark")
    expect(cell).to_have_css("background-color", _dark)
    page.screenshot(path=str(_shot("labext-panel-session-dark.png")))
    _theme(page, "JupyterLab Light")
    expect(cell).not_to_have_css("background-color", _dark)
    cell.locator(".enb-panel-stop").click()
    nb.wait_done(2, timeout=30)
    nb.expect_output(2, "KeyboardInterrupt")
    # The session stays up, between cells.
    expect(up).to_have_attribute("data-running", "true")
    expect(up.locator(".enb-panel-state")).to_have_text("ready")

    up.locator(".enb-panel-stop").click()
    page.locator(".jp-Dialog").get_by_role("button", name="Take down").click()
    expect(up).to_have_attribute("data-running", "false")
    assert wait_for(lambda: not job_processes(session), timeout=15), job_processes(session)


def _whole(parts: Any) -> None:
    """Each of `parts` shows all of its text: none overflows its box (cut, or hidden)."""
    cut = parts.evaluate_all(
        "els => els.filter(e => e.scrollWidth > e.clientWidth + 1 || e.scrollHeight > "
        "e.clientHeight + 1).map(e => e.className + ': ' + e.textContent)"
    )
    assert parts.count() and not cut, cut


def open_panel(page: Any) -> Any:
    """The Elastic jobs panel, opened as a person does: its tab in the left sidebar."""
    panel = page.locator("#elastic-nb-jobs")
    if not panel.is_visible():
        page.locator('.jp-SideBar .lm-TabBar-tab[data-id="elastic-nb-jobs"]').click()
    expect(panel).to_be_visible()
    return panel


_dark = re.compile(r"rgb\((?:[0-5]?\d), (?:[0-5]?\d), (?:[0-5]?\d)\)")  # each channel < 60


def _theme(page: Any, name: str) -> None:
    page.evaluate(
        "(theme) => window.jupyterapp.commands.execute('apputils:change-theme', {theme})", name
    )
    expect(page.locator("#jupyterlab-splash")).to_have_count(0)  # the theme is loaded


def _shot(name: str) -> Path:
    SHOTS.mkdir(parents=True, exist_ok=True)
    return SHOTS / name


def test_the_panel_lists_the_machines_of_a_notebook_open_to_others(
    page: Any, lab: LabServer
) -> None:
    """A notebook that printed its join command is open to other machines: the panel lists its
    machines (%elastic nodes: here, this machine alone) and where agents join."""
    nb = open_notebook(page, lab, "machines.ipynb", ["%elastic join-command --host 127.0.0.1"])
    nb.run(1)
    nb.wait_done(1)
    nb.expect_output(1, "elastic-nb join 127.0.0.1:")
    panel = open_panel(page)
    machines = panel.locator(".enb-panel-machines")
    expect(machines.locator(".enb-panel-machines-heading")).to_have_text(
        "Machines of machines.ipynb"
    )
    here = machines.locator(".enb-panel-machine").first
    expect(here).to_have_attribute("data-state", "here")
    expect(here).to_contain_text(
        re.compile(r"node 0: \S+ \(127\.0\.0\.1\) · \d+ GPUs? · \d+ CPUs · torch ")
    )
    expect(here).to_contain_text("the notebook's machine")
    expect(machines).to_contain_text(re.compile(r"agents join on 127\.0\.0\.1:\d+"))
    page.screenshot(path=str(_shot("labext-panel-machines.png")))
