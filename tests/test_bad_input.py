"""Bad input gets a clear error, launches nothing, and leaves the kernel usable."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.kernel import Kernel

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(autouse=True)
def launches_nothing(kernel: Kernel, log_dir: Path) -> Iterator[None]:
    yield
    # No job ever ran in this module's kernel (its supervisor, started by %load_ext, only
    # warmed up), and no run directory exists.
    assert "running jobs: none" in kernel.ok("%elastic status").stdout
    assert "no jobs in this session yet" in kernel.ok("%elastic jobs").stdout
    assert list(log_dir.iterdir()) == []
    assert kernel.ok("21 * 2").result == "42"


def _fails(kernel: Kernel, code: str, ename: str, *fragments: str) -> None:
    ex = kernel.run(code)
    assert ex.ename == ename, f"{ex.ename}: {ex.error}"
    text = ex.error["evalue"] + "\n" + ex.traceback
    for fragment in fragments:
        assert fragment in text, text
    assert "[elastic_nb] job" not in ex.stdout


def test_unknown_flag(kernel: Kernel, log_dir: Path) -> None:
    _fails(
        kernel,
        f"%%elastic --nproc 2 --log-dir {log_dir} --nprocs 3\n1\n",
        "UsageError",
        "unrecognized arguments: --nprocs",
    )


def test_zero_ranks(kernel: Kernel, log_dir: Path) -> None:
    _fails(
        kernel,
        f"%%elastic --nproc 0 --log-dir {log_dir}\n1\n",
        "UsageError",
        "--nproc 0: must be at least 1",
    )


def test_nproc_not_a_number(kernel: Kernel, log_dir: Path) -> None:
    _fails(
        kernel, f"%%elastic --nproc four --log-dir {log_dir}\n1\n", "UsageError", "--nproc 'four'"
    )


@pytest.mark.parametrize(
    ("nnodes", "message"),
    [
        ("3:2", "MIN (3) is larger than MAX (2)"),
        ("0", "at least one node"),
        # No machine can join this kernel's notebook yet (no %elastic join-command): refused
        # in the kernel, before anything starts.
        ("2", "--nnodes 2: the job runs on other machines too, and none can join yet"),
        ("1:4 --remote-only", "the job runs on joined nodes only, and none can join yet"),
        ("2 --rdzv-conf timeout=60", "c10d rendezvous ignores it"),
        ("2 --rdzv-backend static --rdzv-endpoint localhost:29533", "rendezvous with c10d"),
    ],
)
def test_impossible_nnodes(kernel: Kernel, log_dir: Path, nnodes: str, message: str) -> None:
    _fails(kernel, f"%%elastic --nnodes {nnodes} --log-dir {log_dir}\n1\n", "UsageError", message)


def test_remote_endpoint(kernel: Kernel, log_dir: Path) -> None:
    _fails(
        kernel,
        f"%%elastic --rdzv-endpoint 10.1.2.3:29500 --log-dir {log_dir}\n1\n",
        "UsageError",
        "is not this machine",
    )


def test_fork_start_method(kernel: Kernel, log_dir: Path) -> None:
    _fails(
        kernel,
        f"%%elastic --start-method fork --log-dir {log_dir}\n1\n",
        "UsageError",
        "use spawn or forkserver",
    )


def test_managed_env_variable(kernel: Kernel, log_dir: Path) -> None:
    _fails(
        kernel,
        f"%%elastic --env RANK=3 --log-dir {log_dir}\n1\n",
        "UsageError",
        "RANK is set by the launcher",
    )


def test_syntax_error_names_the_cell_line(kernel: Kernel, log_dir: Path) -> None:
    _fails(
        kernel,
        f"%%elastic --nproc 2 --log-dir {log_dir}\nx = 1\nif x\n    print(x)\n",
        "CellError",
        "(cell line 3)",
        "if x",
        "Nothing was launched",
    )


def test_ipython_syntax_in_the_cell(kernel: Kernel, log_dir: Path) -> None:
    _fails(
        kernel, f"%%elastic --log-dir {log_dir}\n%time 1\n", "CellError", "(cell line 2)", "%magics"
    )


def test_unpicklable_push(kernel: Kernel, log_dir: Path) -> None:
    kernel.ok("import threading\nlock = threading.Lock()")
    _fails(
        kernel,
        f"%%elastic --push lock --log-dir {log_dir}\nprint(lock)\n",
        "CellError",
        "--push lock: it cannot be pickled",
        "lock",
    )


def test_push_of_a_missing_name(kernel: Kernel, log_dir: Path) -> None:
    _fails(
        kernel,
        f"%%elastic --push nothing_here --log-dir {log_dir}\n1\n",
        "CellError",
        "--push nothing_here: no such name",
    )


def test_unpicklable_notebook_function(kernel: Kernel, log_dir: Path) -> None:
    kernel.ok(
        "import threading\n_guard = threading.Lock()\ndef guarded():\n    with _guard:\n        return 1\n"
    )
    _fails(
        kernel,
        f"%%elastic --log-dir {log_dir}\nguarded()\n",
        "CellError",
        "the notebook's 'guarded'",
        "cannot be pickled",
    )


def test_log_dir_that_cannot_be_written(kernel: Kernel, tmp_path: Path) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    _fails(
        kernel,
        f"%%elastic --log-dir {blocker}/runs\n1\n",
        "UsageError",
        f"--log-dir {blocker}/runs: cannot write there",
    )


def test_busy_rendezvous_port(kernel: Kernel, log_dir: Path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        _fails(
            kernel,
            f"%%elastic --rdzv-endpoint localhost:{port} --log-dir {log_dir}\n1\n",
            "UsageError",
            f"port {port} is already in use",
        )


def test_bad_session_default_is_refused_at_config_time(kernel: Kernel, log_dir: Path) -> None:
    _fails(
        kernel,
        "%elastic config --max-restarts -1",
        "UsageError",
        "--max-restarts -1: must be at least 0",
    )
    assert "no session defaults" in kernel.ok("%elastic config").stdout


def test_memory_history_where_the_ranks_see_no_gpu(kernel: Kernel, log_dir: Path) -> None:
    """--memory-history records CUDA allocations: on a job whose ranks see no GPU (here: an empty
    CUDA_VISIBLE_DEVICES, on any machine) it is refused before anything starts, as a session's
    default is for the next cell."""
    refused = (
        "--memory-history records CUDA allocations, and no NVIDIA GPU is visible to the ranks "
        "(CUDA_VISIBLE_DEVICES included): leave the flag out for a CPU job"
    )
    _fails(
        kernel,
        f"%%elastic --nproc 2 --memory-history --env CUDA_VISIBLE_DEVICES= --log-dir {log_dir}\n1\n",
        "UsageError",
        refused,
    )
    kernel.ok("%elastic config --memory-history --env CUDA_VISIBLE_DEVICES=")
    try:
        _fails(kernel, f"%%elastic --nproc 2 --log-dir {log_dir}\n1\n", "UsageError", refused)
    finally:
        kernel.ok("%elastic config reset")
