"""The supervisor seen from its socket: this test process plays the kernel."""

from __future__ import annotations

import sys
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastic_nb.cell import prepare_cell
from elastic_nb.client import SupervisorClient
from elastic_nb.spec import JobSpec
from tests.kernel import assert_job_gone


class Recorder:
    def __init__(self) -> None:
        self.updates: list[tuple[float, dict[str, Any]]] = []
        self.summary: dict[str, Any] | None = None

    def update(self, msg: dict[str, Any]) -> None:
        self.updates.append((time.monotonic(), msg))

    def end(self, summary: dict[str, Any]) -> None:
        self.summary = summary


@pytest.fixture
def client() -> Iterator[SupervisorClient]:
    c = SupervisorClient()
    yield c
    c.close()


def submit(client: SupervisorClient, tmp_path: Path, nproc: int, body: str) -> Any:
    spec = JobSpec.from_options(
        {"nproc": str(nproc), "log_dir": str(tmp_path)}, cwd=str(tmp_path), sys_path=sys.path
    )
    cell = prepare_cell(f"--nproc {nproc}", body, {})
    return client.submit(spec, cell.source, cell.meta, cell.payload)


def test_updates_are_batched_and_account_for_every_line(
    client: SupervisorClient, tmp_path: Path
) -> None:
    job = submit(
        client,
        tmp_path,
        4,
        "import os\nr = os.environ['RANK']\nfor i in range(100_000):\n    print(r, i)\n",
    )
    rec = Recorder()
    summary = job.wait(rec)
    assert summary["outcome"] == "succeeded" and summary["lines"] == 400_000
    # At most one update per flush interval (0.1 s), whatever the volume...
    span = rec.updates[-1][0] - rec.updates[0][0]
    assert len(rec.updates) <= 10 * span + 2, (len(rec.updates), span)
    # ...each bounded...
    shown: dict[int, int] = defaultdict(int)
    for _, msg in rec.updates:
        for _attempt, rank, stream, lines, skipped, _progress in msg.get("logs", ()):
            assert stream == "out" and len(lines) <= 200
            shown[rank] += len(lines) + skipped
    # ...and every line either shown or counted as left out.
    assert dict(shown) == {0: 100_000, 1: 100_000, 2: 100_000, 3: 100_000}
    assert_job_gone(job.id)


def test_rank_states_flow_to_the_client(client: SupervisorClient, tmp_path: Path) -> None:
    job = submit(
        client, tmp_path, 2, "import os\nif os.environ['RANK'] == '1':\n    raise OSError('disk')\n"
    )
    rec = Recorder()
    summary = job.wait(rec)
    states = [m["state"] for _, m in rec.updates if "state" in m]
    assert (
        states[0] in ("starting", "rendezvous") and "running" in states and states[-1] == "failed"
    )
    last: dict[str, dict[str, Any]] = {}
    for _, m in rec.updates:
        last.update(m.get("ranks", {}))
    assert last["1"]["state"] == "failed" and last["1"]["detail"].startswith("OSError: disk")
    assert (
        summary["failure"]["rank"] == 1 and summary["failure"]["record"]["cell_line"] == 4
    )  # line 1 is the magic
    assert_job_gone(job.id)


def test_closing_the_lifeline_ends_jobs_and_the_supervisor(tmp_path: Path) -> None:
    c = SupervisorClient()
    job = submit(c, tmp_path, 2, "import time\ntime.sleep(300)\n")
    proc = c._proc
    deadline = time.monotonic() + 60
    while (
        not (tmp_path / job.id / "attempt-0" / "rank-1.out").exists()
        and time.monotonic() < deadline
    ):
        time.sleep(0.05)
    c.close()  # what the OS does when a kernel dies
    assert proc.wait(timeout=15) == 0
    assert_job_gone(job.id)
