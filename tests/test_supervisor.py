"""The supervisor seen from its socket: this test process plays the kernel."""

from __future__ import annotations

import os
import secrets
import signal
import socket
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastic_nb import protocol
from elastic_nb.common.errors import Refused, SupervisorDied
from elastic_nb.common.submission import Submission
from elastic_nb.kernel.cell import prepare_cell
from elastic_nb.kernel.client import GONE, SupervisorClient
from elastic_nb.kernel.flags import job_spec
from elastic_nb.kernel.job_handle import JobHandle
from tests.kernel import assert_job_gone, wait_for

pytestmark = pytest.mark.e2e


class Recorder:
    live_beside_input = False

    def __init__(self) -> None:
        self.updates: list[tuple[float, dict[str, Any]]] = []
        self.summary: dict[str, Any] | None = None
        self.flushes = 0

    def update(self, msg: dict[str, Any]) -> None:
        self.updates.append((time.monotonic(), msg))

    def flush(self) -> None:
        self.flushes += 1

    def end(self, summary: dict[str, Any]) -> None:
        self.summary = summary


@pytest.fixture
def client() -> Iterator[SupervisorClient]:
    c = SupervisorClient()
    yield c
    c.close()


def submit(client: SupervisorClient, tmp_path: Path, nproc: int, body: str) -> Any:
    spec = job_spec(
        {"nproc": str(nproc), "log_dir": str(tmp_path)}, cwd=str(tmp_path), sys_path=sys.path
    )
    cell = prepare_cell(f"--nproc {nproc}", body, {})
    return JobHandle.submit(
        client, Submission(secrets.token_hex(4), spec, cell.source, cell.meta, cell.payload)
    )


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
    summary = job.follow(rec)
    assert summary["outcome"] == "succeeded" and summary["lines"] == 400_000
    # At most one update per flush interval (0.1 s), whatever the volume...
    span = rec.updates[-1][0] - rec.updates[0][0]
    assert len(rec.updates) <= 10 * span + 2, (len(rec.updates), span)
    # ...each bounded...
    shown: dict[int, int] = defaultdict(int)
    for _, msg in rec.updates:
        for b in msg.get("logs", ()):
            assert b["stream"] == "out" and len(b["lines"]) <= 200
            shown[b["rank"]] += len(b["lines"]) + b["skipped"]
    # ...and every line either shown or counted as left out.
    assert dict(shown) == {0: 100_000, 1: 100_000, 2: 100_000, 3: 100_000}
    assert_job_gone(job.id)


def test_rank_states_flow_to_the_client(client: SupervisorClient, tmp_path: Path) -> None:
    job = submit(
        client, tmp_path, 2, "import os\nif os.environ['RANK'] == '1':\n    raise OSError('disk')\n"
    )
    rec = Recorder()
    summary = job.follow(rec)
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


def test_a_bad_connection_is_dropped_and_the_supervisor_serves_on(
    client: SupervisorClient, tmp_path: Path
) -> None:
    for garbage in (
        protocol.wire.encode({"kind": "jobs", "req": 1}),  # a request before hello
        b'{"kind": "hello", "blob": -5}\n',  # a frame that is not one
        b"\xff\xfe not json at all\n",
    ):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(client.socket_path)
            s.settimeout(10)
            s.sendall(garbage)
            assert s.recv(1024) == b""  # dropped, no reply
    assert client.status()["pid"] == client.pid
    # Said in the supervisor's log, with what was wrong: not a silent disconnect.
    said = Path(client.log_path).read_text()
    assert (
        "WARNING elastic_nb.supervisor.service: dropped a client connection: 'jobs' before hello"
        in said
    )
    assert said.count("dropped a client connection") == 3
    job = submit(client, tmp_path, 1, "print('still here')\n")
    assert job.follow(Recorder())["outcome"] == "succeeded"
    assert_job_gone(job.id)


def test_a_submit_whose_spec_does_not_fit_is_refused_and_launches_nothing(
    client: SupervisorClient, tmp_path: Path
) -> None:
    """The spec is checked where it crosses into the supervisor (JobSpec.from_dict): a request
    from a client that is not ours (or a newer one) with `nproc: "four"` is refused there,
    naming the field, with no run directory made and no launcher started."""
    spec = job_spec({"nproc": "2", "log_dir": str(tmp_path)}, cwd=str(tmp_path))
    cell = prepare_cell("--nproc 2", "print('never')\n", {})
    request = Submission(secrets.token_hex(4), spec, cell.source, cell.meta, None).request(
        client.next_req()
    )
    request["spec"] = {**request["spec"], "nproc": "four"}
    with pytest.raises(Refused, match=r"the job's spec: nproc is not a int: 'four'"):
        client.request(request, protocol.kernel.Submitted)
    assert not (tmp_path / request["job"]).exists()
    assert [j["job"] for j in client.jobs()] == []
    job = submit(client, tmp_path, 1, "print('still here')\n")  # the supervisor serves on
    assert job.follow(Recorder())["outcome"] == "succeeded"
    assert_job_gone(job.id)


def test_a_renderer_that_raises_stops_its_job(client: SupervisorClient, tmp_path: Path) -> None:
    class Broken(Recorder):
        def update(self, msg: dict[str, Any]) -> None:
            if "logs" in msg:
                raise ValueError("renderer bug")

    job = submit(client, tmp_path, 2, "print('go', flush=True)\nimport time\ntime.sleep(300)\n")
    with pytest.raises(ValueError, match="renderer bug"):
        job.follow(Broken())
    assert job.summary is not None and job.summary["outcome"] == "stopped"
    assert_job_gone(job.id)
    assert client.alive


def test_a_supervisor_that_does_not_answer_is_abandoned(tmp_path: Path) -> None:
    c = SupervisorClient()
    proc = c._proc
    try:
        os.kill(c.pid, signal.SIGSTOP)
        with pytest.raises(SupervisorDied, match="did not answer"):
            c.request(
                {"kind": "status", "req": c.next_req()},
                protocol.kernel.SupervisorStatus,
                timeout=1.0,
            )
        assert not c.alive
    finally:
        os.kill(c.pid, signal.SIGCONT)
    # Its lifeline is closed: it shuts down by itself once it runs again.
    assert proc.wait(timeout=15) == 0
    c.close()


def test_closing_the_lifeline_ends_jobs_and_the_supervisor(tmp_path: Path) -> None:
    c = SupervisorClient()
    job = submit(c, tmp_path, 2, "import time\ntime.sleep(300)\n")
    proc = c._proc
    assert wait_for(lambda: (tmp_path / job.id / "attempt-0" / "rank-1.out").exists(), 60)
    c.close()  # what the OS does when a kernel dies
    assert proc.wait(timeout=15) == 0
    assert_job_gone(job.id)


def test_a_rank_that_crashes_after_finishing_is_reported(
    client: SupervisorClient, tmp_path: Path
) -> None:
    body = (
        "import atexit, os, signal\n"
        "if os.environ['RANK'] == '1':\n"
        "    atexit.register(lambda: os.kill(os.getpid(), signal.SIGABRT))\n"
    )
    job = submit(client, tmp_path, 2, body)
    rec = Recorder()
    summary = job.follow(rec)
    assert summary["outcome"] == "succeeded"
    alerts = [a for _, m in rec.updates for a in m.get("alerts", ())]
    assert [(a["kind"], a["rank"]) for a in alerts] == [("exit_after_done", 1)]
    assert "killed by SIGABRT" in alerts[0]["title"]
    assert_job_gone(job.id)


def test_a_long_session_keeps_a_bounded_history_of_finished_jobs(tmp_path: Path) -> None:
    from types import SimpleNamespace

    from elastic_nb.supervisor.roster import KEEP_FINISHED, forget_old_jobs

    jobs = {f"j{i}": SimpleNamespace(running=False) for i in range(KEEP_FINISHED + 5)}
    jobs["live"] = SimpleNamespace(running=True)
    forget_old_jobs(jobs)
    assert "live" in jobs and "j0" not in jobs and "j4" not in jobs
    assert len(jobs) == KEEP_FINISHED + 1 and f"j{KEEP_FINISHED + 4}" in jobs


def test_an_unreadable_frame_drops_the_connection_and_says_why(tmp_path: Path) -> None:
    """The client's reader on a socket whose other end sends garbage (a unit below the real
    supervisor, which never does): every waiter hears GONE, and the error says what broke."""
    ours, theirs = socket.socketpair()
    c = SupervisorClient.__new__(SupervisorClient)
    c._conn = protocol.connection.Connection(ours, protocol.kernel.kernel_news)
    c._proc, c._alive, c.gone_reason, c._subscribers = None, True, "it exited", {}
    c.log_path = str(tmp_path / "supervisor.log")
    job = c.subscribe("cafe0001")
    reader = threading.Thread(target=c._read)
    reader.start()
    theirs.sendall(b"this is not a frame\n")
    reader.join(timeout=5)
    assert not reader.is_alive() and not c.alive
    assert job.get(timeout=1) is GONE
    assert "could not read" in c.gone_reason and "not a frame" in c.gone_reason
    assert theirs.recv(1) == b""  # the kernel dropped its end: the supervisor sees EOF
    with pytest.raises(SupervisorDied, match="could not read"):
        c.request({"kind": "status", "req": 1}, protocol.kernel.SupervisorStatus, timeout=1)
