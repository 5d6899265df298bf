"""A real `jupyter lab` server and a headless Chromium page driving it, for the browser tests.

The server runs from this interpreter with an empty token, no XSRF check and the app exposed as
``window.jupyterapp`` (what galata's test configuration does), on a free port of 127.0.0.1, with
a temporary root directory. Notebooks are written there and driven through JupyterLab's own
commands; assertions read what the page renders.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import nbformat

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
"""


def chromium_missing() -> str | None:
    """Why the browser tests cannot run here, or None."""
    if not Path(CHROMIUM).exists() and shutil.which(CHROMIUM) is None:
        return (
            f"no Chromium at {CHROMIUM}: `make test` installs Debian's chromium "
            "(apt-get install chromium), or point ELASTIC_NB_CHROMIUM at one"
        )
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LabServer:
    def __init__(self, workdir: Path, env: dict[str, str]) -> None:
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
                port=self.port, root=str(self.root), workspaces=str(workdir / "workspaces")
            )
        )
        self.log_path = workdir / "jupyter-lab.log"
        with open(self.log_path, "wb") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "jupyterlab", f"--config={config}"],
                cwd=self.root,
                env={**os.environ, **env, "JUPYTER_CONFIG_DIR": str(workdir / "config")},
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        self._wait_up(timeout=90)

    def _wait_up(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"jupyter lab exited:\n{self.log()}")
            with (
                contextlib.suppress(OSError),
                urllib.request.urlopen(f"{self.url}/api/status", timeout=2) as r,
            ):
                if r.status == 200:
                    return
            time.sleep(0.2)
        raise TimeoutError(f"jupyter lab did not answer in {timeout} s:\n{self.log()}")

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

    def write_notebook(self, name: str, cells: list[str]) -> str:
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell(src) for src in cells]
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
        nbformat.write(nb, self.root / name)
        return name


class Notebook:
    """One open notebook in the page: run its cells, find what they render."""

    def __init__(self, page: Any, lab: LabServer, name: str) -> None:
        self.page = page
        page.goto(f"{lab.url}/lab/tree/{name}")
        page.wait_for_function(
            """(name) => {
                const w = window.jupyterapp?.shell?.currentWidget;
                return w?.context?.path === name
                    && w.sessionContext?.session?.kernel?.status === 'idle';
            }""",
            arg=name,
            timeout=120_000,
        )
        panel_id = page.evaluate("() => window.jupyterapp.shell.currentWidget.id")
        self.panel = page.locator(f'[id="{panel_id}"]')

    def cell(self, i: int) -> Any:
        return self.panel.locator(".jp-Notebook .jp-Cell").nth(i)

    def outputs(self, i: int) -> Any:
        return self.cell(i).locator(".jp-OutputArea-output")

    def run(self, i: int) -> None:
        """Start cell i and return once its prompt has changed (to [*], or at once to its
        execution count for a quick cell), like shift-enter without moving on."""
        prompt = self.cell(i).locator(".jp-InputPrompt")
        before = prompt.text_content()
        self.page.evaluate(
            """(i) => {
                const w = window.jupyterapp.shell.currentWidget;
                w.content.activeCellIndex = i;
                window.jupyterapp.commands.execute('notebook:run-cell');
            }""",
            i,
        )
        self.page.wait_for_function(
            "([el, before]) => el.textContent !== before",
            arg=[prompt.element_handle(), before],
            timeout=30_000,
        )

    def wait_done(self, i: int, timeout: float = 120) -> None:
        prompt = self.cell(i).locator(".jp-InputPrompt")
        self.page.wait_for_function(
            "(el) => /\\[\\d+\\]/.test(el.textContent)",
            arg=prompt.element_handle(),
            timeout=timeout * 1000,
        )

    def running(self, i: int) -> bool:
        return "[*]" in self.cell(i).locator(".jp-InputPrompt").inner_text()

    def interrupt(self) -> None:
        self.page.evaluate("() => window.jupyterapp.commands.execute('notebook:interrupt-kernel')")

    def text(self, i: int) -> str:
        return "\n".join(self.outputs(i).all_inner_texts())
