"""The server extension's REST API (elastic_nb.server), as the JupyterLab panel uses it: a real
Jupyter server (pytest-jupyter), a kernel it started for a notebook, a real supervisor running
real gloo ranks, every call authenticated, and nothing of a job left once it is stopped."""

from __future__ import annotations

import asyncio
import json
import re
import subprocess
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from tornado.httpclient import HTTPClientError

from elastic_nb import registry
from elastic_nb.client import runtime_dir
from tests.kernel import Kernel, assert_job_gone, wait_for
from tests.lab import LabServer

pytest_plugins = ["pytest_jupyter.jupyter_server"]

API = ("elastic-nb", "api", "jobs")


@pytest.fixture
def jp_server_config() -> dict[str, Any]:
    return {"ServerApp": {"jpserver_extensions": {"elastic_nb.server": True}}}


async def blocking(fn: Any, *args: Any) -> Any:
    """A blocking call off the server's loop. Not asyncio.to_thread: it copies the context, and
    with it jupyter_core's loop variable, which makes a kernel client run on the server's loop."""
    return await asyncio.get_running_loop().run_in_executor(None, fn, *args)


async def get(jp_fetch: Any, *parts: str, **kw: Any) -> Any:
    r = await jp_fetch(*API, *parts, **kw)
    return json.loads(r.body)


async def post(jp_fetch: Any, *parts: str, **kw: Any) -> Any:
    r = await jp_fetch(*API, *parts, method="POST", body="", **kw)
    return json.loads(r.body)


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


async def wait_until(predicate: Any, timeout: float) -> bool:
    return await blocking(wait_for, predicate, timeout, 0.2)


SLEEPER = """%%elastic --bg --nproc 2
import itertools, os, time
for i in itertools.count():
    print(f"rank {os.environ['RANK']} line {i}", flush=True)
    time.sleep(0.2)
"""


async def test_the_panel_lists_follows_dumps_and_stops_a_running_job(
    jp_fetch: Any, jp_serverapp: Any, cache_home: Path
) -> None:
    k = await notebook_kernel(jp_fetch, jp_serverapp, "train.ipynb")
    ex = await blocking(k.ok, SLEEPER)
    job = re.search(r"job (\w+)", ex.result or ex.stdout).group(1)  # type: ignore[union-attr]
    await blocking(k.ok, "job = _")

    jobs = (await get(jp_fetch))["jobs"]
    entry = job_of(jobs, job)
    assert entry["kind"] == "job" and entry["running"] and entry["world_size"] == 2
    assert entry["notebook"] == "train.ipynb" and entry["kernel_id"] == k.kernel_id  # type: ignore[attr-defined]
    assert entry["max_restarts"] == 0 and entry["elapsed_s"] >= 0

    # Logs: the last lines, then what follows from the offset given back.
    first: dict[str, Any] = {}

    async def has_lines() -> bool:
        first.update(await get(jp_fetch, job, "logs", params={"rank": "1", "tail": "5"}))
        return "rank 1 line 2" in first["text"]

    for _ in range(150):
        if await has_lines():
            break
        await asyncio.sleep(0.2)
    out = first
    assert out["text"].count("\n") <= 5 and out["path"].endswith("rank-1.out")
    more = ""
    for _ in range(100):
        nxt = await get(jp_fetch, job, "logs", params={"rank": "1", "offset": str(out["offset"])})
        more += nxt["text"]
        if more.count("\n") >= 2:
            break
        await asyncio.sleep(0.2)
    n = int(re.findall(r"line (\d+)", out["text"])[-1])
    assert f"rank 1 line {n + 1}\n" in more  # it follows on where the tail ended, nothing lost

    # Stacks, per rank, both in the cell's loop.
    stacks = await post(jp_fetch, job, "stacks")
    assert [r["rank"] for r in stacks["ranks"]] == [0, 1]
    for r in stacks["ranks"]:
        assert "cell line" in r["text"] and "time.sleep(0.2)" in r["text"]

    # Events: what the dashboard was sent, in order, and nothing twice.
    events = await get(jp_fetch, job, "events")
    seqs = [e["seq"] for e in events["events"]]
    assert seqs and seqs == sorted(seqs) and events["seq"] == seqs[-1]
    assert any(e.get("state") == "running" for e in events["events"])
    later = await get(jp_fetch, job, "events", params={"since": str(events["seq"])})
    assert all(e["seq"] > events["seq"] for e in later["events"])

    # Unknown jobs, and calls without credentials: nothing of the job.
    for method, part in (("GET", "logs"), ("POST", "stop"), ("POST", "stacks"), ("GET", "events")):
        with pytest.raises(HTTPClientError) as e:
            await jp_fetch(
                *API, "ffffffff", part, method=method, **({"body": ""} if method == "POST" else {})
            )
        assert e.value.code == 404
    bad = {"Authorization": "token not-the-token"}
    for method, parts in (
        ("GET", ()),
        ("GET", (job, "logs")),
        ("GET", (job, "events")),
        ("POST", (job, "stacks")),
        ("POST", (job, "stop")),
    ):
        with pytest.raises(HTTPClientError) as e:
            kw: dict[str, Any] = {"body": ""} if method == "POST" else {}
            await jp_fetch(*API, *parts, method=method, headers=bad, **kw)
        assert e.value.code == 403
        assert job not in (e.value.response.body or b"").decode()
    assert job_of((await get(jp_fetch))["jobs"], job)["running"]  # the refused stop did nothing

    # Stop, from the panel: the job ends as stopped, and nothing of it survives.
    assert (await post(jp_fetch, job, "stop"))["stopping"] == [job]
    stopped = await blocking(k.run, "job.wait(timeout=60)")
    assert stopped.ename == "JobStopped"
    entry = job_of((await get(jp_fetch))["jobs"], job)
    assert not entry["running"] and entry["outcome"] == "stopped" and job in entry["summary"]
    assert_job_gone(job)
    with pytest.raises(HTTPClientError) as e:
        await post(jp_fetch, job, "stacks")
    assert e.value.code == 409
    await blocking(k.kc.stop_channels)


async def test_a_session_and_its_cells_are_listed_and_stopped(
    jp_fetch: Any, jp_serverapp: Any, cache_home: Path
) -> None:
    k = await notebook_kernel(jp_fetch, jp_serverapp, "session.ipynb")
    await blocking(k.ok, "%elastic up --nproc 2")
    cell = await blocking(k.ok, "%%elastic\nx = 41 + 1\n")
    jobs = (await get(jp_fetch))["jobs"]
    (session,) = [j for j in jobs if j["kind"] == "session" and j["notebook"] == "session.ipynb"]
    assert session["running"] and session["world_size"] == 2
    entry = job_of(jobs, cell.job_id)
    assert entry["kind"] == "cell" and entry["session"] == session["id"]
    assert not entry["running"] and entry["outcome"] == "succeeded"
    logs = await get(jp_fetch, cell.job_id, "logs", params={"rank": "0"})
    assert Path(logs["path"]).parent.parent.name == session["id"]

    # Stop on a session takes it down: its ranks are gone.
    assert (await post(jp_fetch, session["id"], "stop"))["stopping"] == [session["id"]]

    async def down() -> bool:
        return not job_of((await get(jp_fetch))["jobs"], session["id"])["running"]

    for _ in range(150):
        if await down():
            break
        await asyncio.sleep(0.2)
    assert await down()
    assert_job_gone(session["id"])
    await blocking(k.kc.stop_channels)


async def test_a_stale_registration_is_removed(jp_fetch: Any) -> None:
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = registry.register(
        registry.Registration(
            dead.pid, dead.pid, None, str(runtime_dir() / f"sup-{dead.pid}-000000.sock"), 0.0
        )
    )
    jobs = (await get(jp_fetch))["jobs"]
    assert not stale.exists()
    assert all(j["supervisor_pid"] != dead.pid for j in jobs)


def test_the_config_file_enables_the_extension(tmp_path: Path, cache_home: Path) -> None:
    # jupyter-config/jupyter_server_config.d/elastic_nb.json, what a pip install puts in
    # etc/jupyter, is all a `jupyter lab` needs to serve the API (LabServer reads it).
    server = LabServer(tmp_path, {"XDG_CACHE_HOME": str(cache_home)})
    try:
        with urllib.request.urlopen(f"{server.url}/elastic-nb/api/jobs", timeout=30) as r:
            assert r.status == 200 and isinstance(json.loads(r.read())["jobs"], list)
        assert "elastic_nb: the Elastic jobs panel's API is at /elastic-nb/api/" in server.log()
    finally:
        server.stop()
