from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from elastic_nb import procs
from tests.kernel import Kernel, wait_for


@pytest.fixture(scope="session")
def cache_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Run directories of the tests' jobs go here, not into the user's cache."""
    return tmp_path_factory.mktemp("cache")


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
def no_stray_processes() -> Iterator[None]:
    """Every test ends with no process of any elastic_nb job left alive."""
    yield
    # Kernels shut down by fixtures take their supervisor (and its jobs) with them; allow the
    # teardown its bounded time, then insist.
    wait_for(lambda: not procs.job_processes(), timeout=10)
    left = [p.pid for p in procs.job_processes()]
    assert not left, f"elastic_nb job processes left behind: {left}"
