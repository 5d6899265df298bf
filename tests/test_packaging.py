"""The package as a user gets it: a wheel built from a clean checkout (node builds the JupyterLab
extension into it), installed into a fresh venv with no node on PATH, where JupyterLab and
jupyter_server list both extensions enabled and OK.

About two minutes here: the wheel's JS build from the yarn cache, and a venv of jupyterlab and
the package's dependencies (torch pinned to the version this suite runs on, from pip's cache or
the local index: never an unpinned torch, which would be a multi-GB CUDA download).
"""

from __future__ import annotations

import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def _run(cmd: list[str], env: dict[str, str] | None = None, cwd: Path | None = None) -> str:
    done = subprocess.run(
        cmd, env=env, cwd=cwd, capture_output=True, text=True, timeout=600, check=False
    )
    out = _ANSI.sub("", done.stdout + done.stderr)
    assert done.returncode == 0, (
        f"{' '.join(map(str, cmd))} exited {done.returncode}:\n{out[-5000:]}"
    )
    return out


def _clean_checkout(dest: Path) -> Path:
    """The tracked files only: no node_modules, no earlier build, as CI's fresh clone has."""
    if shutil.which("git") is None or not (ROOT / ".git").exists():
        pytest.fail("the packaging test builds from the git checkout's tracked files")
    files = _run(["git", "-C", str(ROOT), "ls-files", "-z"]).split("\0")
    for name in filter(None, files):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)
    return dest


@pytest.mark.timeout(900)
def test_a_wheel_installs_both_extensions_without_node(tmp_path: Path) -> None:
    if shutil.which("node") is None:
        pytest.fail("building the wheel needs node (`make test` installs Debian's nodejs)")
    src = _clean_checkout(tmp_path / "src")
    dist = tmp_path / "dist"
    _run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(dist), str(src)])
    (wheel,) = dist.glob("elastic_nb-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    shared = "elastic_nb-0.1.0.data/data/share/jupyter/labextensions/elastic-nb/"
    assert f"{shared}package.json" in names, names
    assert f"{shared}install.json" in names, names
    assert any(n.startswith(f"{shared}static/remoteEntry.") for n in names), names
    assert not [n for n in names if "node_modules" in n or n.startswith("elastic_nb/labextension")]

    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    bin_ = venv / "bin"
    # Nothing but the venv on PATH: no node can take part in the install.
    env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
    env["PATH"] = str(bin_)
    # And only what the wheel installed under the venv counts, not the user's Jupyter dirs.
    env["JUPYTER_CONFIG_DIR"] = str(tmp_path / "jupyter-config")
    env["JUPYTER_DATA_DIR"] = str(tmp_path / "jupyter-data")
    assert shutil.which("node", path=env["PATH"]) is None
    torch = importlib.metadata.version("torch").split("+")[0]
    constraints = tmp_path / "constraints.txt"
    constraints.write_text(f"torch=={torch}\n")
    _run(
        [str(bin_ / "pip"), "install", "-q", "-c", str(constraints), str(wheel), "jupyterlab"],
        env=env,
    )

    labext = _run([str(bin_ / "jupyter"), "labextension", "list"], env=env)
    assert re.search(r"elastic-nb v0\.1\.0 enabled\s+OK \(python, elastic_nb\)", labext), labext
    serverext = _run([str(bin_ / "jupyter"), "server", "extension", "list"], env=env)
    assert re.search(r"elastic_nb\.server enabled", serverext), serverext
    assert re.search(r"elastic_nb\.server \S* ?OK", serverext), serverext
