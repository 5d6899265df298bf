"""A real `jupyter lab` (or Notebook 7) server and a headless Chromium page driving it, for the
browser tests.

The server runs from this interpreter with an empty token, no XSRF check and the app exposed as
``window.jupyterapp`` (what galata's test configuration does), on a free port of 127.0.0.1, with
a temporary root directory. Notebooks are written there and driven through the app's own
commands (Notebook 7 is built from JupyterLab's, so one driver serves both). Every read of the
page goes through Playwright's `expect`, which retries until the page agrees or its timeout
passes: the dashboard renders asynchronously, so a one-shot read can see the frame before.

The fixtures `browser` and `page` live here for every browser test module to import (as
`browser_fixture`, `page_fixture`: pytest finds them by their `name`); a module names its server
fixture `lab` (`yield from serve(...)`).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nbformat
import psutil
import pytest
from playwright.sync_api import expect

from tests.kernel import TreeWatch, free_port, kernel_keeps, runs_module, wait_for

# An expectation passes as soon as the page agrees: its timeout is only a liveness bound, so it
# is set for a loaded 2-core machine (Playwright's 5 s default can pass while a widget update
# still queues behind 4 ranks' start-up).
expect.set_options(timeout=30_000)

CHROMIUM = os.environ.get("ELASTIC_NB_CHROMIUM", "/usr/bin/chromium")
# What a headless Chromium needs on a machine with no display and a closed network.
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-dev-shm-usage",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]

_CONFIG = """
c.ServerApp.ip = "127.0.0.1"
c.ServerApp.port = {port}
c.ServerApp.port_retries = 0
c.ServerApp.open_browser = False
c.ServerApp.root_dir = {root!r}
c.ServerApp.allow_root = True
c.IdentityProvider.token = ""
c.ServerApp.password = ""
c.ServerApp.disable_check_xsrf = True
c.LabApp.expose_app_in_browser = True
c.LabApp.workspaces_dir = {workspaces!r}
c.LabApp.check_for_updates_class = "jupyterlab.NeverCheckForUpdate"
c.JupyterNotebookApp.expose_app_in_browser = True
c.JupyterNotebookApp.workspaces_dir = {workspaces!r}
c.LabServerApp.extra_labextensions_path = {labextensions!r}
"""

_ROOT = Path(__file__).resolve().parent.parent
# What the JupyterLab extension is built from (the Makefile's LABEXT_SRC), and where to.
_LABEXT_SOURCES = ("src", "style", "schema", "package.json", "tsconfig.json")
_LABEXT_BUILT = _ROOT / "elastic_nb" / "labextension"


def _labextension_sources() -> list[Path]:
    found = []
    for name in _LABEXT_SOURCES:
        path = _ROOT / "labextension" / name
        found += [path] if path.is_file() else [p for p in path.rglob("*") if p.is_file()]
    return found


def labextension_stale() -> str | None:
    """Why the extension built in this tree is not this tree's, or None. The build's
    package.json (jupyter-builder writes it last; the Makefile touches it) must be newer than
    every source file: a panel whose source changed since its build would otherwise be tested
    as it was (a Stop that only dumps stacks stayed green until someone rebuilt by hand)."""
    built = _LABEXT_BUILT / "package.json"
    rebuild = "`make elastic_nb/labextension/package.json` builds it (`make test` does)"
    if not built.exists():
        return f"no JupyterLab extension is built in this tree ({built}): {rebuild}"
    newer = [p for p in _labextension_sources() if p.stat().st_mtime > built.stat().st_mtime]
    if newer:
        names = ", ".join(str(p.relative_to(_ROOT)) for p in newer[:5])
        return f"the JupyterLab extension's build is older than {names}: {rebuild}"
    return None


def _tree_labextensions(workdir: Path) -> list[str]:
    """The JupyterLab extension as built in this tree (`jlpm build` or pip's build), ahead of
    the copy a `pip install -e .` made when it ran: the pages test the extension's source
    (`serve` refuses a missing or stale build). The server finds an extension's files under a
    folder named as its package: a link gives it one."""
    (workdir / "labextensions").mkdir()
    (workdir / "labextensions" / "elastic-nb").symlink_to(_LABEXT_BUILT)
    return [str(workdir / "labextensions")]


# What each app is started as, and where it opens a notebook.
APPS = {
    "lab": ("jupyterlab", "/lab/tree/"),
    "notebook": ("notebook", "/notebooks/"),  # Notebook 7
}


def chromium_missing() -> str | None:
    """Why the browser tests cannot run here, or None."""
    if not Path(CHROMIUM).exists() and shutil.which(CHROMIUM) is None:
        return (
            f"no Chromium at {CHROMIUM}: `make test` installs Debian's chromium "
            "(apt-get install chromium), or point ELASTIC_NB_CHROMIUM at one"
        )
    return None


class LabServer:
    """`jupyter lab`, or with app="notebook" `jupyter notebook` (Notebook 7)."""

    def __init__(self, workdir: Path, env: dict[str, str], app: str = "lab") -> None:
        self.app = app
        module, self.tree = APPS[app]
        self.root = workdir / "root"
        self.root.mkdir()
        (workdir / "workspaces").mkdir()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        # No "news?" toast over the page (it would fetch from the network if accepted).
        labconfig = workdir / "config" / "labconfig"
        labconfig.mkdir(parents=True)
        (labconfig / "page_config.json").write_text(
            json.dumps(
                {"disabledExtensions": {"@jupyterlab/apputils-extension:announcements": True}}
            )
        )
        config = workdir / "jupyter_lab_config.py"
        config.write_text(
            _CONFIG.format(
                port=self.port,
                root=str(self.root),
                workspaces=str(workdir / "workspaces"),
                labextensions=_tree_labextensions(workdir),
            )
        )
        self.log_path = workdir / f"jupyter-{app}.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", module, f"--config={config}"],
                cwd=self.root,
                env={
                    **os.environ,
                    **env,
                    "JUPYTER_CONFIG_DIR": str(workdir / "config"),
                    # The server extension, enabled by the file a pip install puts in
                    # etc/jupyter (read from the source tree: the suite may run from it).
                    "JUPYTER_CONFIG_PATH": str(_ROOT / "jupyter-config"),
                },
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        # The server's process tree, for the per-test check (tests/conftest.py): its kernels
        # and what they start.
        self.watch = TreeWatch(self.proc.pid, kept=self._kept)
        self._wait_up(timeout=90)

    def _kept(self, watch: TreeWatch) -> set[int]:
        """The server's running kernels (its children started as ipykernel_launcher with the
        connection file of a kernel its API lists) and what each may keep
        (tests/kernel.py, kernel_keeps)."""
        try:
            with urllib.request.urlopen(f"{self.url}/api/kernels", timeout=10) as r:
                files = {f"kernel-{k['id']}.json" for k in json.load(r)}
        except OSError:
            return set()
        kept: set[int] = set()
        for p in psutil.Process(self.proc.pid).children():
            with contextlib.suppress(psutil.Error):
                cmd = p.cmdline()
                connection = cmd[cmd.index("-f") + 1] if "-f" in cmd[:-1] else ""
                if runs_module(cmd, "ipykernel_launcher") and Path(connection).name in files:
                    kept |= {p.pid, *kernel_keeps(p.pid, watch)}
        return kept

    def _wait_up(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter {self.app} exited:\n{self.log()}")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{self.url}/api/status", timeout=2) as r,
            ):
                if r.status == 200:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"jupyter {self.app} did not answer in {timeout} s:\n{self.log()}")

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-5000:]

    def stop(self) -> None:
        """Like Ctrl-C on the server: it shuts its kernels down (and they their supervisors)."""
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.watch.stop()
        assert wait_for(lambda: not self.watch.alive(), 10), (
            f"processes of jupyter {self.app} outlived it: {self.watch.alive()}"
        )

    def write_notebook(self, name: str, cells: list[str]) -> str:
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell(src) for src in cells]
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
        nbformat.write(nb, self.root / name)
        return name


class Notebook:
    """One open notebook in the page: run its cells, find what they render. Its cells run once
    each, as in a notebook just opened: a prompt goes from `[ ]` to `[*]` to `[N]`."""

    def __init__(self, page: Any, lab: LabServer, name: str) -> None:
        self.page = page
        page.goto(f"{lab.url}{lab.tree}{name}")
        # The app's state, not the DOM: polled in the page until it holds (the id of the panel).
        ready = page.wait_for_function(
            """(name) => {
                const w = window.jupyterapp?.shell?.currentWidget;
                return w?.context?.path === name
                    && w.sessionContext?.session?.kernel?.status === 'idle'
                    && w.id;
            }""",
            arg=name,
            timeout=120_000,
        )
        self.panel = page.locator(f'[id="{ready.json_value()}"]')

    def cell(self, i: int) -> Any:
        return self.panel.locator(".jp-Notebook .jp-Cell").nth(i)

    def prompt(self, i: int) -> Any:
        return self.cell(i).locator(".jp-InputPrompt")

    def outputs(self, i: int) -> Any:
        return self.cell(i).locator(".jp-OutputArea-output")

    def run(self, i: int) -> None:
        """Start cell i and return once its prompt has left `[ ]` (for `[*]`, or at once for its
        execution count for a quick cell), like shift-enter without moving on."""
        expect(self.prompt(i)).to_have_text(NOT_RUN)
        self.page.evaluate(
            """(i) => {
                const w = window.jupyterapp.shell.currentWidget;
                w.content.activeCellIndex = i;
                window.jupyterapp.commands.execute('notebook:run-cell');
            }""",
            i,
        )
        expect(self.prompt(i)).not_to_have_text(NOT_RUN)

    def expect_running(self, i: int) -> None:
        expect(self.prompt(i)).to_have_text(RUNNING)

    def wait_done(self, i: int, timeout: float = 120) -> None:
        expect(self.prompt(i)).to_have_text(DONE, timeout=timeout * 1000)

    def interrupt(self) -> None:
        self.page.evaluate("() => window.jupyterapp.commands.execute('notebook:interrupt-kernel')")

    def expect_output(self, i: int, *texts: str) -> None:
        """Cell i's outputs contain these texts, in this order (one output may hold several)."""
        expect(self.outputs(i)).to_contain_text(list(texts), use_inner_text=True)


def has_class(name: str) -> re.Pattern[str]:
    """For `to_have_class`: the class list holds `name` (`to_contain_class` needs Playwright
    1.52; the test extra's floor is 1.45)."""
    return re.compile(rf"(?:^|\s){re.escape(name)}(?:\s|$)")


NOT_RUN = re.compile(r"^\[ \]:?$")
RUNNING = re.compile(r"^\[\*\]:?$")
DONE = re.compile(r"^\[\d+\]:?$")


def job_of(nb: Notebook, cell: int) -> str:
    """The job id the cell's dashboard shows."""
    job = nb.cell(cell).locator(".enb-job").first
    expect(job).to_have_text(re.compile(r"^job [0-9a-f]{8}$"))
    return job.inner_text().removeprefix("job ")


def serve(
    tmp_path_factory: pytest.TempPathFactory, cache_home: Path, app: str
) -> Iterator[LabServer]:
    """A module's server fixture: `yield from serve(tmp_path_factory, cache_home, "lab")`."""
    missing = chromium_missing()
    if missing:
        pytest.fail(missing)  # a missing browser is a broken setup, not a reason to skip
    stale = labextension_stale()
    if stale:
        pytest.fail(stale)  # a stale build must not pass for this tree's extension
    server = LabServer(tmp_path_factory.mktemp(app), {"XDG_CACHE_HOME": str(cache_home)}, app=app)
    yield server
    server.stop()


@pytest.fixture(scope="module", name="browser")
def browser_fixture(lab: LabServer) -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        b = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        yield b
        b.close()


@pytest.fixture(name="page")
def page_fixture(browser: Any, request: pytest.FixtureRequest) -> Iterator[Any]:
    """A page that fails its test on any uncaught error in it, but for the module's
    `KNOWN_PAGE_ERRORS`: (message, a piece of its stack) pairs of the app's own, shown to
    happen without elastic_nb on the page."""
    known = getattr(request.module, "KNOWN_PAGE_ERRORS", ())
    page = browser.new_page(viewport={"width": 1400, "height": 1100})
    errors: list[str] = []

    def on_error(e: Any) -> None:
        if not any(e.message == m and where in (e.stack or "") for m, where in known):
            errors.append(f"{e.message}\n{e.stack}")

    page.on("pageerror", on_error)
    yield page
    page.close()
    assert not errors, errors


def open_notebook(page: Any, lab: LabServer, name: str, cells: list[str]) -> Notebook:
    """A notebook of `%load_ext elastic_nb` and `cells`, open, its first cell run."""
    nb = Notebook(page, lab, lab.write_notebook(name, ["%load_ext elastic_nb", *cells]))
    nb.run(0)
    nb.wait_done(0)
    return nb


def shot(page: Any, locator: Any, name: str) -> None:
    SHOTS.mkdir(parents=True, exist_ok=True)
    locator.scroll_into_view_if_needed()
    page.screenshot(path=str(SHOTS / name), full_page=False)


SHOTS = Path(__file__).resolve().parent.parent / "test-output" / "browser"
