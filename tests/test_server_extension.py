"""The server extension's REST API (elastic_nb.server), as the JupyterLab panel uses it: a real
Jupyter server (pytest-jupyter), a kernel it started for a notebook, a real supervisor running
real gloo ranks, every call authenticated, and nothing of a job left once it is stopped.

The point of the API is control while a blocking cell keeps its kernel busy (a busy kernel takes
no widget clicks): the job tests run blocking cells and do everything through the server."""

from __future__ import annotations

import asyncio
import json
import os
import re
import socket
import subprocess
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from tornado.httpclient import HTTPClientError

from elastic_nb import protocol
from elastic_nb.common import registry
from elastic_nb.common.registry import runtime_dir
from tests.kernel import Execution, Kernel, assert_job_gone, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.core]

pytest_plugins = ["pytest_jupyter.jupyter_server"]

API = ("elastic-nb", "api", "jobs")


@pytest.fixture
def jp_server_config() -> dict[str, Any]:
    return {"ServerApp": {"jpserver_extensions": {"elastic_nb.server": True}}}


async def blocking(fn: Any, *args: Any, **kwargs: Any) -> Any:
    """A blocking call off the server's loop. Not asyncio.to_thread: it copies the context, and
    with it jupyter_core's loop variable, which makes a kernel client run on the server's loop."""
    return await asyncio.get_running_loop().run_in_executor(None, lambda: fn(*args, **kwargs))


async def get(jp_fetch: Any, *parts: str, **kw: Any) -> Any:
    r = await jp_fetch(*API, *parts, **kw)
    return json.loads(r.body)


async def post(jp_fetch: Any, *parts: str, **kw: Any) -> Any:
    r = await jp_fetch(*API, *parts, method="POST", body="", **kw)
    return json.loads(r.body)


async def refused(jp_fetch: Any, method: str, *parts: str, **kw: Any) -> HTTPClientError:
    body = {"body": ""} if method == "POST" else {}
    with pytest.raises(HTTPClientError) as e:
        await jp_fetch(*API, *parts, method=method, **body, **kw)
    return e.value


async def notebook_kernel(jp_fetch: Any, jp_serverapp: Any, path: str) -> Kernel:
    """A kernel the server starts for a notebook (POST /api/sessions, as JupyterLab does)."""
    body = json.dumps({"path": path, "type": "notebook", "kernel": {"name": "python3"}})
    r = await jp_fetch("api", "sessions", method="POST", body=body)
    kernel_id = json.loads(r.body)["kernel"]["id"]
    km = jp_serverapp.kernel_manager.get_kernel(kernel_id)
    k = await blocking(Kernel.attach, km.connection_file, km.provisioner.process.pid)
    k.kernel_id = kernel_id  # type: ignore[attr-defined]
    await blocking(k.ok, "%load_ext elastic_nb")
    return k


def job_of(jobs: list[dict[str, Any]], job_id: str) -> dict[str, Any]:
    (entry,) = [j for j in jobs if j["id"] == job_id]
    return entry


async def poll(fn: Any, timeout: float = 60) -> Any:
    """`await fn()` until it gives something truthy (a liveness bound): that, or the last."""
    deadline = time.monotonic() + timeout
    while not (found := await fn()) and time.monotonic() < deadline:
        await asyncio.sleep(0.2)
    return found


async def sent_running(jp_fetch: Any, job: str) -> bool:
    """Whether the job's renderer is sent its "running" state: at its next flush (0.1 s), which
    may come after the listing, read from the supervisor's memory, already says so."""

    async def sent() -> bool:
        events = (await get(jp_fetch, job, "events"))["events"]
        return any(e.get("state") == "running" for e in events)

    return bool(await poll(sent, timeout=30))


async def listed(jp_fetch: Any, pick: Any, timeout: float = 60) -> dict[str, Any]:
    """The one entry of GET jobs that `pick` accepts, once there is one."""

    async def one() -> dict[str, Any] | None:
        found = [j for j in (await get(jp_fetch))["jobs"] if pick(j)]
        assert len(found) <= 1, found
        return found[0] if found else None

    entry = await poll(one, timeout)
    assert entry, "no such job listed"
    return entry


# A blocking cell in the loop the tests watch: gloo initialised, then a line every 0.2 s.
SLEEPER = """%%elastic --nproc 2
import itertools, time
import torch.distributed as dist
dist.init_process_group("gloo")
dist.barrier()
for i in itertools.count():
    print(f"rank {dist.get_rank()} line {i}", flush=True)
    time.sleep(0.2)
"""
# The same in a session, whose ranks keep their process group from cell to cell.
SESSION_INIT = "%%elastic\nimport torch.distributed as dist\ndist.init_process_group('gloo')\n"
SESSION_SLEEPER = """%%elastic
import itertools, time
for i in itertools.count():
    print(f"rank {dist.get_rank()} line {i}", flush=True)
    time.sleep(0.2)
"""


async def test_a_blocking_job_is_listed_followed_dumped_and_stopped_from_the_panel(
    jp_fetch: Any, jp_serverapp: Any, cache_home: Path
) -> None:
    k = await notebook_kernel(jp_fetch, jp_serverapp, "train.ipynb")
    kernel_id = k.kernel_id  # type: ignore[attr-defined]
    msg_id, ex = await blocking(k.start, SLEEPER)
    entry = await listed(
        jp_fetch, lambda j: j["kernel_id"] == kernel_id and j["state"] == "running"
    )
    job = entry["id"]
    assert entry["kind"] == "job" and entry["session"] is None and entry["running"]
    assert entry["world_size"] == 2 and entry["notebook"] == "train.ipynb"
    assert entry["attempt"] == entry["restarts"] == entry["max_restarts"] == 0
    assert entry["elapsed_s"] >= 0 and entry["outcome"] is None and entry["summary"] is None
    assert entry["supervisor_pid"] != k.pid
    # The cell blocks its kernel: whatever follows goes through the server alone.
    model = json.loads((await jp_fetch("api", "kernels", kernel_id)).body)
    assert model["execution_state"] == "busy"

    # Logs: the last lines, then what follows from the offset given back.
    async def lines() -> dict[str, Any] | None:
        out = await get(jp_fetch, job, "logs", params={"rank": "1", "tail": "3"})
        return out if "rank 1 line 3" in out["text"] else None

    out = await poll(lines)
    assert out, "rank 1's lines never showed"
    assert out["rank"] == 1 and out["path"].endswith("attempt-0/rank-1.out")
    assert out["text"].count("\n") == 3 and out["offset"] == out["size"]
    last = int(re.findall(r"line (\d+)", out["text"])[-1])
    more = ""

    async def follow() -> bool:
        nonlocal more
        nxt = await get(jp_fetch, job, "logs", params={"rank": "1", "offset": str(out["offset"])})
        more, out["offset"] = more + nxt["text"], nxt["offset"]
        return more.count("\n") >= 2

    assert await poll(follow)
    assert more.startswith(f"rank 1 line {last + 1}\n")  # on from where the tail ended
    err = await get(jp_fetch, job, "logs", params={"rank": "0", "stream": "err", "offset": "0"})
    assert err["path"].endswith("rank-0.err") and err["offset"] == len(err["text"].encode())

    # Stacks, per rank, both in the cell's loop, with their pids.
    stacks = await post(jp_fetch, job, "stacks")
    assert [r["rank"] for r in stacks["ranks"]] == [0, 1]
    for r in stacks["ranks"]:
        assert "cell line 8" in r["text"] and "time.sleep(0.2)" in r["text"], stacks["text"]
        assert f"ELASTIC_NB_JOB={job}".encode() in Path(f"/proc/{r['pid']}/environ").read_bytes()
    assert stacks["text"].startswith("stacks of every rank")

    # Events: what the dashboard was sent, in order; then only what is new.
    events = await get(jp_fetch, job, "events")
    seqs = [e["seq"] for e in events["events"]]
    assert seqs and seqs == sorted(seqs) and events["seq"] == seqs[-1]
    assert all(isinstance(e["t"], float) for e in events["events"])
    assert await sent_running(jp_fetch, job)

    async def stacks_alert() -> bool:
        sent = (await get(jp_fetch, job, "events"))["events"]
        return any(a["kind"] == "stacks" for e in sent for a in e.get("alerts", ()))

    assert await poll(stacks_alert)  # the dashboard shows the dump too
    later = await get(jp_fetch, job, "events", params={"since": str(events["seq"])})
    assert all(e["seq"] > events["seq"] for e in later["events"])

    # Unknown jobs: 404.
    for method, part in (("GET", "logs"), ("POST", "stop"), ("POST", "stacks"), ("GET", "events")):
        assert (await refused(jp_fetch, method, "ffffffff", part)).code == 404

    # Stop, from the panel: the blocking cell ends as stopped, and nothing of the job survives.
    assert (await post(jp_fetch, job, "stop"))["stopping"] == [job]
    ended: Execution = await blocking(k.collect, msg_id, ex, 60)
    assert ended.ename == "JobStopped" and "stopped from the JupyterLab panel" in ended.traceback
    assert "from the notebook" not in ended.traceback  # the cause line does not contradict it
    entry = job_of((await get(jp_fetch))["jobs"], job)
    assert not entry["running"] and entry["state"] == entry["outcome"] == "stopped"
    assert job in entry["summary"] and "stopped" in entry["summary"]
    assert_job_gone(job)
    assert (await refused(jp_fetch, "POST", job, "stacks")).code == 409
    assert (await get(jp_fetch, job, "events"))["events"][-1]["kind"] == "end"
    await blocking(k.kc.stop_channels)


async def test_every_endpoint_refuses_a_call_without_credentials(
    jp_fetch: Any, jp_serverapp: Any, cache_home: Path
) -> None:
    k = await notebook_kernel(jp_fetch, jp_serverapp, "bg.ipynb")
    ex = await blocking(k.ok, SLEEPER.replace("--nproc 2", "--nproc 2 --bg"))
    job = re.search(r"job (\w+)", ex.result or "").group(1)  # type: ignore[union-attr]
    for headers in ({"Authorization": "token not-the-token"}, {"Authorization": ""}):
        for method, parts in (
            ("GET", ()),
            ("GET", (job, "logs")),
            ("GET", (job, "events")),
            ("POST", (job, "stacks")),
            ("POST", (job, "stop")),
        ):
            e = await refused(jp_fetch, method, *parts, headers=headers)
            assert e.code == 403, (method, parts, headers)
            assert job not in (e.response.body or b"").decode()  # type: ignore[union-attr]
    assert job_of((await get(jp_fetch))["jobs"], job)["running"]  # the refused stop did nothing
    await post(jp_fetch, job, "stop")
    assert (await blocking(k.run, "_.wait(timeout=60)")).ename == "JobStopped"
    assert_job_gone(job)
    await blocking(k.kc.stop_channels)


async def test_a_session_and_its_cells_are_listed_interrupted_and_taken_down(
    jp_fetch: Any, jp_serverapp: Any, cache_home: Path
) -> None:
    k = await notebook_kernel(jp_fetch, jp_serverapp, "session.ipynb")
    await blocking(k.ok, "%elastic up --nproc 2")
    await blocking(k.ok, SESSION_INIT)
    done = await blocking(k.ok, "%%elastic\nx = 41 + 1\n")
    jobs = (await get(jp_fetch))["jobs"]
    (session,) = [j for j in jobs if j["kind"] == "session" and j["notebook"] == "session.ipynb"]
    sid = session["id"]
    assert session["running"] and session["world_size"] == 2 and session["session"] is None
    entry = job_of(jobs, done.job_id)
    assert (
        entry["kind"] == "cell" and entry["session"] == sid and entry["notebook"] == "session.ipynb"
    )
    assert not entry["running"] and entry["outcome"] == "succeeded" and entry["summary"]
    logs = await get(jp_fetch, done.job_id, "logs", params={"rank": "0"})
    assert Path(logs["path"]).parent.parent.name == sid  # a cell's ranks are its session's

    # A blocking cell, interrupted from the panel: the session keeps its ranks and state.
    msg_id, ex = await blocking(k.start, SESSION_SLEEPER)
    cell = await listed(jp_fetch, lambda j: j["session"] == sid and j["state"] == "running")
    assert cell["kind"] == "cell" and cell["notebook"] == "session.ipynb"
    stacks = await post(jp_fetch, cell["id"], "stacks")
    assert all("time.sleep(0.2)" in r["text"] for r in stacks["ranks"]), stacks["text"]
    pids = {r["rank"]: r["pid"] for r in stacks["ranks"]}
    assert await sent_running(jp_fetch, cell["id"])
    assert (await post(jp_fetch, cell["id"], "stop"))["stopping"] == [cell["id"]]
    ended = await blocking(k.collect, msg_id, ex, 60)
    assert ended.ename == "JobStopped" and "stopped from the JupyterLab panel" in ended.traceback
    jobs = (await get(jp_fetch))["jobs"]
    assert job_of(jobs, cell["id"])["outcome"] == "stopped"
    assert job_of(jobs, sid)["running"]
    # The same ranks, with their state; the pids the panel was given are theirs.
    said = await blocking(
        k.ok, "%%elastic --no-widgets\nimport os\nprint('pid', os.getpid(), x, flush=True)\n"
    )
    assert dict(re.findall(r"\[rank (\d+)\] pid (\d+) 42", said.stdout)) == {
        str(r): str(p) for r, p in pids.items()
    }

    # Stop on a session takes it down: its ranks are gone.
    assert (await post(jp_fetch, sid, "stop"))["stopping"] == [sid]

    async def down() -> dict[str, Any] | None:
        entry = job_of((await get(jp_fetch))["jobs"], sid)
        return None if entry["running"] else entry

    entry = await poll(down)
    assert entry and entry["outcome"] == "ended"
    end = (await get(jp_fetch, sid, "events"))["events"][-1]
    assert end["kind"] == "end" and end["summary"]["reason"] == "ended from the JupyterLab panel"
    assert_job_gone(sid)
    await blocking(k.kc.stop_channels)


async def test_stale_registrations_are_removed(jp_fetch: Any) -> None:
    """A supervisor SIGKILLed leaves its registration and socket behind: whoever lists them
    removes both, whether its pid is gone, now another process's, or still its own but not
    answering."""
    listening = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)

    def registration(pid: int, started: float, sock: str) -> Path:
        path = str(runtime_dir() / f"sup-{pid}-{os.urandom(3).hex()}.sock")
        if sock == "dead":  # a socket file nobody listens on
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
                s.bind(path)
        elif sock == "listening":  # one that would take a connection and never answer
            listening.bind(path)
            listening.listen()
        return registry.register(registry.Registration(pid, pid, None, path, started))

    gone = subprocess.Popen(["true"])
    gone.wait()
    reused = subprocess.Popen(["sleep", "60"])
    try:
        stale = [
            registration(gone.pid, time.time(), "missing"),
            # Its pid now names a process started after the registration: not a supervisor.
            registration(reused.pid, time.time() - 60, "listening"),
            # The registered process itself, alive, but nothing answers on its socket.
            registration(os.getpid(), time.time(), "dead"),
        ]
        t0 = time.monotonic()
        jobs = (await get(jp_fetch))["jobs"]
        assert time.monotonic() - t0 < 5  # the listening impostor was not asked (10 s timeout)
        pids = {gone.pid, reused.pid, os.getpid()}
        assert all(j["supervisor_pid"] not in pids for j in jobs)
        assert [p for p in stale if p.exists() or p.with_suffix(".sock").exists()] == []
    finally:
        listening.close()
        reused.kill()
        reused.wait()


def test_the_config_file_enables_the_extension(tmp_path: Path, cache_home: Path) -> None:
    from tests.lab import LabServer  # here: the floors venv runs this module without a browser

    # jupyter-config/jupyter_server_config.d/elastic_nb.json, what a pip install puts in
    # etc/jupyter, is all a `jupyter lab` needs to serve the API (LabServer puts the source
    # tree's jupyter-config on JUPYTER_CONFIG_PATH and enables nothing itself).
    server = LabServer(tmp_path, {"XDG_CACHE_HOME": str(cache_home)})
    try:
        with urllib.request.urlopen(f"{server.url}/elastic-nb/api/jobs", timeout=30) as r:
            assert r.status == 200 and isinstance(json.loads(r.read())["jobs"], list)
        assert "elastic_nb: the Elastic jobs panel's API is at /elastic-nb/api/" in server.log()
    finally:
        server.stop()


def test_the_panel_s_connection_is_not_the_kernel_s_lifeline(kernel: Kernel) -> None:
    """A panel request's connection ends after its reply; the supervisor serves on."""
    from elastic_nb.server import supervisors

    def mine() -> list[supervisors.RegisteredSupervisor]:  # %load_ext starts it in the background
        return [s for s in supervisors.find() if s.registration.kernel_pid == kernel.pid]

    assert wait_for(mine, 60)
    (sup,) = mine()
    for _ in range(3):
        assert (
            sup.request({"kind": "status", "req": 1}, protocol.kernel.SupervisorStatus)["pid"]
            == sup.pid
        )
    assert kernel.ok("%%elastic --nproc 1\n6 * 7\n").result == "42"
