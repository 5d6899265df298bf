from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from elastic_nb.common import procs
from tests.kernel import Kernel, TreeWatch, pid_ended, wait_for

KINDS = ("unit", "e2e", "browser")
# This run's XDG_RUNTIME_DIR, and the one before it (pytest_configure).
_RUNTIME = pytest.StashKey[tuple[str, str | None]]()


def pytest_configure(config: pytest.Config) -> None:
    """Supervisors register in a directory of this run's (and, under `make test`'s parallel
    workers, of this worker's) own: the Jupyter servers a test starts list what registered there
    (the Elastic jobs panel), and must not list another worker's jobs, nor a notebook the user
    runs beside the suite. Every process the suite starts inherits it."""
    runtime = tempfile.mkdtemp(prefix="enb-runtime-")  # short: a socket's path has 107 bytes
    config.stash[_RUNTIME] = (runtime, os.environ.get("XDG_RUNTIME_DIR"))
    os.environ["XDG_RUNTIME_DIR"] = runtime


def pytest_unconfigure(config: pytest.Config) -> None:
    runtime, saved = config.stash.get(_RUNTIME, (None, None))
    if runtime is None:
        return
    shutil.rmtree(runtime, ignore_errors=True)
    if saved is None:
        os.environ.pop("XDG_RUNTIME_DIR", None)
    else:
        os.environ["XDG_RUNTIME_DIR"] = saved


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Every test is one of KINDS (its file's pytestmark, most often): a test nobody classified
    would escape `make floors`' selection unseen. A `cuda` test is skipped where torch sees no
    CUDA device, saying so; the GPU run runs them."""
    unmarked = [
        i.nodeid for i in items if sum(i.get_closest_marker(k) is not None for k in KINDS) != 1
    ]
    if unmarked:
        raise pytest.UsageError(f"tests with no kind (or two) of {KINDS}: {unmarked}")
    cuda = [i for i in items if i.get_closest_marker("cuda")]
    if cuda and not _cuda_device():
        skip = pytest.mark.skip(reason="needs a CUDA device (this torch sees none)")
        for item in cuda:
            item.add_marker(skip)
    _costliest_modules_first(items)


def _costliest_modules_first(items: list[pytest.Item]) -> None:
    """The parallel workers (`make test`: --dist loadscope) take whole modules in this order:
    the modules with the most processes to start come first, so that a long module does not
    start last and run alone at the end; the unit modules fill the gaps. An e2e test starts a job
    or a kernel (a unit of cost), a browser test drives a page against a server (about three),
    and a test with a time limit of its own (a wheel built, the GPU check's rehearsal: about a
    tenth of their limit) a unit per 20 s of that limit. Within a module the order is as
    written, and it is the same on every worker (computed from the collection alone)."""
    weight = {"unit": 0.0, "e2e": 1.0, "browser": 3.0}
    cost: dict[str, float] = {}
    for item in items:
        kind = next(k for k in KINDS if item.get_closest_marker(k))
        limit = item.get_closest_marker("timeout")
        own = weight[kind] if limit is None else max(weight[kind], float(limit.args[0]) / 20)
        cost[item.path.name] = cost.get(item.path.name, 0.0) + own
    items.sort(key=lambda i: -cost[i.path.name])


def _cuda_device() -> bool:
    import torch

    return bool(torch.cuda.is_available())


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
def every_process_ends_with_its_test(no_stray_processes: None) -> Iterator[None]:
    """After each test, as seen from outside the product (not only by its marker sweep), for
    every kernel and Jupyter server the suite watches (tests/kernel.py: TreeWatch.every, whoever
    started it: a fixture of any name, a test, a server):

    - every process that appeared under it during the test has ended, but for the long-lived
      ones, found by what they are: a running kernel's supervisor and what the supervisor says
      it keeps (its zygote, its idle warm launcher with that launcher's fork server, the ranks
      of its sessions), a server's kernels (`TreeWatch.kept`). Ranks killed by a signal, stuck
      or never recorded are checked too: the watch saw them;
    - every process of every one-off job its cells ran has ended: the ranks' own pids as they
      wrote them in their records and their fork server and launcher from the watch
      (Kernel.job_pids), a rank too short-lived for the watch's 20 ms included.

    A teardown's bounded time is allowed (10 s). (It asks for no_stray_processes first so that
    that one's check runs last, after the kernels' shutdown.)"""
    before = {id(w): w.mark() for w in TreeWatch.every}
    ran = {id(w): len(w.kernel.executions) for w in TreeWatch.every if w.kernel}
    yield
    watches = list(TreeWatch.every)
    jobs: dict[str, set[int]] = {}
    for w in watches:
        if w.kernel is not None:
            jobs.update(w.kernel.job_pids(w.kernel.executions[ran.get(id(w), 0) :]))

    def left() -> dict[str, list[Any]]:
        found: dict[str, list[Any]] = {
            job: live
            for job, pids in jobs.items()
            if (live := [p for p in pids if not pid_ended(p)])
        }
        for w in watches:
            if live := w.outliving(before.get(id(w), frozenset())):
                found[f"under {w.root}"] = live
        return found

    wait_for(lambda: not left(), 10, interval=0.1)
    assert not (found := left()), f"processes outlived the test that started them: {found}"
    TreeWatch.every[:] = [w for w in TreeWatch.every if not w.over]


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
