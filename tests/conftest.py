from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from elastic_nb.common import procs
from tests.kernel import Kernel, wait_for

# test_server_extension loads pytest-jupyter, and a plugin's autouse fixtures run for every
# test of the suite: its loop fixture then took the current loop for its own and closed it after
# each test (in a browser test run after a server test, Playwright's running loop: the browser
# tests broke), and its cleanup made and tore down a ServerApp after each one. These two
# overrides keep both to the tests that start its server.


def _serves(request: pytest.FixtureRequest) -> bool:
    return "jp_serverapp" in request.fixturenames


@pytest.fixture(autouse=True)
def jp_asyncio_loop(request: pytest.FixtureRequest) -> Iterator[asyncio.AbstractEventLoop | None]:
    if not _serves(request):
        yield None
        return
    from jupyter_core.utils import ensure_event_loop

    loop = ensure_event_loop(prefer_selector_loop=True)
    yield loop
    loop.close()


@pytest.fixture(autouse=True)
def jp_server_cleanup(request: pytest.FixtureRequest, jp_asyncio_loop: Any) -> Iterator[None]:
    yield
    if not _serves(request):
        return
    from jupyter_server.serverapp import ServerApp

    app = ServerApp.instance()
    with contextlib.suppress(RuntimeError, SystemExit):  # as pytest-jupyter's does
        jp_asyncio_loop.run_until_complete(app._cleanup())
    if hasattr(app, "kernel_manager"):
        app.kernel_manager.context.destroy()
    ServerApp.clear_instance()


@pytest.fixture(scope="session")
def cache_home(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Run directories of the tests' jobs go here, not into the user's cache; the supervisors
    the test process starts itself inherit it too."""
    path = tmp_path_factory.mktemp("cache")
    saved = os.environ.get("XDG_CACHE_HOME")
    os.environ["XDG_CACHE_HOME"] = str(path)
    yield path
    if saved is None:
        del os.environ["XDG_CACHE_HOME"]
    else:
        os.environ["XDG_CACHE_HOME"] = saved


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory, cache_home: Path) -> Iterator[Kernel]:
    """One real kernel with the extension loaded, shared by a module's tests."""
    cwd = tmp_path_factory.mktemp("nb")
    k = Kernel(str(cwd), env={"XDG_CACHE_HOME": str(cache_home)})
    k.ok("%load_ext elastic_nb")
    yield k
    k.shutdown()


@pytest.fixture
def fresh_kernel(tmp_path: Path, cache_home: Path) -> Iterator[Kernel]:
    """A kernel of its own, for tests that kill or interrupt it."""
    k = Kernel(str(tmp_path), env={"XDG_CACHE_HOME": str(cache_home)})
    k.ok("%load_ext elastic_nb")
    yield k
    k.shutdown()  # and nothing it started outlives it


@pytest.fixture(autouse=True)
def no_stray_processes(cache_home: Path) -> Iterator[None]:
    """Every test ends with no process of any job this suite started left alive (a notebook
    job of the user running beside the suite is not ours: its ranks have another cache home)."""
    yield
    # Kernels shut down by fixtures take their supervisor (and its jobs) with them; allow the
    # teardown its bounded time, then insist.
    wait_for(lambda: not ours(cache_home), timeout=10)
    left = [p.pid for p in ours(cache_home)]
    assert not left, f"elastic_nb job processes left behind: {left}"


def ours(cache_home: Path) -> list[psutil.Process]:
    """Processes of this suite's jobs: they carry the suite's XDG_CACHE_HOME (the kernels get it
    explicitly; jobs started from the test process inherit it, see `cache_home`)."""
    found = []
    for p in procs.job_processes():
        with contextlib.suppress(psutil.Error):
            if p.environ().get("XDG_CACHE_HOME") == str(cache_home):
                found.append(p)
    return found
