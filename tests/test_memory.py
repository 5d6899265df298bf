"""Memory per rank: sampled each second, alerts before a limit, the peaks a job leaves, what
filled the GPU at a CUDA OOM, the words of a host OOM.

The supervisor's side is played on a fake node (the test sets what each reading finds); the host
side runs real ranks: one that grows in steps (seen in the dashboard's samples and in
`%elastic status`), and one that grows in a memory cgroup the test limits, until the OOM killer
ends it (root only). What needs a GPU (the allocator's figures, the snapshot) is in
test_cuda.py.
"""

from __future__ import annotations

import itertools
import re
import signal
from pathlib import Path
from typing import Any

import anyio
import pytest

from elastic_nb.common import protocol, report
from elastic_nb.common.procs import MemoryLimit
from elastic_nb.common.rundir import RunDir
from elastic_nb.kernel.dashboard.model import DashboardState
from elastic_nb.kernel.flags import job_spec
from elastic_nb.rank.memory import largest
from elastic_nb.supervisor.processes.node import MemoryReading
from elastic_nb.supervisor.runs import rank_group
from elastic_nb.supervisor.runs.job import Job
from tests import cgroups
from tests.fake_node import FakeNode
from tests.kernel import (
    Kernel,
    ask_supervisor,
    assert_job_gone,
    run_events,
    run_summary,
    supervisor_socket,
    wait_for,
)

MiB, GiB = 2**20, 2**30
# The README: each rank's sparkline is "its last five minutes", of samples taken once a second.
FIVE_MINUTES_OF_SAMPLES = 5 * 60
_META = {"display": True, "modules": {}, "objects": [], "pull": []}


# ---- the supervisor's side, on a fake node -------------------------------------------------------


def _job(tmp_path: Path) -> tuple[Job, FakeNode, list[dict[str, Any]]]:
    spec = job_spec({"nproc": "2", "log_dir": str(tmp_path)}, cwd=str(tmp_path))
    sent: list[dict[str, Any]] = []

    async def send(msg: Any) -> None:
        sent.append(dict(msg))

    node = FakeNode(RunDir.of(spec.log_dir, "cafe0001"))
    job = Job("cafe0001", spec, "x = 1\n", _META, None, {}, node, send)
    job.prepare()
    return job, node, sent


def _reading(used: int, rss: dict[int, int], gpu_used: int = 10 * GiB) -> MemoryReading:
    share = protocol.GpuShare(index=3, process=gpu_used, used=gpu_used, total=80 * GiB)
    return MemoryReading(
        rss, {0: share}, MemoryLimit(used, 10 * GiB, "its cgroup's memory.max (/job)"), gpus=True
    )


def _cuda(reserved: int) -> protocol.CudaMemory:
    return protocol.CudaMemory(
        device=0, allocated=reserved // 2, reserved=reserved, peak=reserved, total=80 * GiB
    )


@pytest.mark.unit
def test_samples_alerts_once_per_crossing_and_a_host_ooms_peak(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Samples reach the kernel in the updates (host from the node, CUDA from the ranks where
    the node has GPUs); the host limit's alert fires once at 90%, again only after falling below
    85%; a GPU's alert names the rank and its GPU; a rank the OOM killer ends is reported with
    its sampled peak; the summary keeps every rank's peaks."""
    monkeypatch.setattr(rank_group, "SAMPLE_S", 0.01)
    job, node, sent = _job(tmp_path)
    node.kills = 0
    node.cuda = {0: _cuda(12 * GiB)}

    def samples() -> list[protocol.MemorySample]:
        return [s for m in sent if m["kind"] == protocol.UPDATE for s in m.get("memory", ())]

    def memory_alerts() -> list[protocol.Alert]:
        return [
            a
            for m in sent
            if m["kind"] == protocol.UPDATE
            for a in m.get("alerts", ())
            if a["kind"] == "memory"
        ]

    async def settle(n: int = 5) -> None:
        """n more samples of each rank reach the kernel."""
        seen = len(samples())
        await _until(lambda: len(samples()) >= seen + 2 * n)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(job.run)
            node.memory = _reading(5 * GiB, {0: 300 * MiB, 1: 2 * GiB})
            node.start_ranks(0, {0: 100, 1: 101})
            await settle()
            assert memory_alerts() == []
            node.memory = _reading(int(9.3 * GiB), {0: 300 * MiB, 1: 3 * GiB})
            await settle()
            node.memory = _reading(int(9.5 * GiB), {0: 300 * MiB, 1: 3 * GiB})  # still near
            await settle()
            assert len(memory_alerts()) == 1
            node.memory = _reading(int(8.6 * GiB), {0: 300 * MiB, 1: 3 * GiB})  # not below 85%
            await settle()
            node.memory = _reading(int(9.2 * GiB), {0: 300 * MiB, 1: 3 * GiB})
            await settle()
            assert len(memory_alerts()) == 1
            node.memory = _reading(8 * GiB, {0: 300 * MiB, 1: 3 * GiB})  # below 85%: armed
            await settle()
            node.memory = _reading(int(9.1 * GiB), {0: 300 * MiB, 1: int(3.5 * GiB)})
            await settle()
            assert len(memory_alerts()) == 2
            node.memory = _reading(
                8 * GiB, {0: 300 * MiB, 1: int(3.5 * GiB)}, gpu_used=int(74.4 * GiB)
            )
            await settle()
            assert len(memory_alerts()) == 3
            node.kills = 1
            node.rank_dies(0, 1, -signal.SIGKILL)
            await _until(lambda: job.summary is not None)

    anyio.run(main)
    first, second, gpu = memory_alerts()
    # The rank holding the most (no growth over 3 s of samples yet), its share, the limit.
    assert first["rank"] == 1 and first["severity"] == "warning"
    assert first["title"] == (
        "rank 1: 93% of the host memory its ranks may use (9.3 GiB of 10.0 GiB: its cgroup's "
        "memory.max (/job)); rank 1 holds 3.0 GiB"
    )
    assert second["title"].startswith("rank 1: 91% of the host memory")
    assert gpu["rank"] == 0 and gpu["title"] == "rank 0: 93% of GPU 3 (74.4 GiB of 80.0 GiB)"
    ranks = {s["rank"] for s in samples()}
    assert ranks == {0, 1}
    s0 = next(s for s in samples() if s["rank"] == 0)
    assert s0["rss"] == 300 * MiB and s0["cuda"] == _cuda(12 * GiB) and s0["gpu"]["index"] == 3
    assert next(s for s in samples() if s["rank"] == 1)["cuda"] is None  # it answered none
    end = next(m for m in sent if m["kind"] == protocol.END)["summary"]
    assert end["cause"] == "host_oom" and end["failure"]["rank"] == 1
    assert end["failure"]["summary"] == (
        "killed by SIGKILL from the kernel's OOM killer (host memory; it peaked at 3.5 GiB "
        "resident)"
    )
    assert end["memory"] == {
        "0": {"rss": 300 * MiB, "cuda": 12 * GiB, "gpu": int(74.4 * GiB), "gpu_index": 3},
        "1": {"rss": int(3.5 * GiB), "cuda": None, "gpu": None, "gpu_index": None},
    }
    assert report.peaks_line(end) == (
        "[elastic_nb] peak memory: rank 0 300 MiB host, 74.4 GiB on GPU 3 (12.0 GiB allocated "
        "by torch) · rank 1 3.5 GiB host"
    )


@pytest.mark.unit
def test_no_gpus_no_questions_to_the_ranks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where the node has no GPUs, the ranks are never asked (a CPU rank pays nothing)."""
    monkeypatch.setattr(rank_group, "SAMPLE_S", 0.01)
    job, node, sent = _job(tmp_path)
    asked: list[str] = []
    probe = node.probe

    async def counting_probe(r: Any, what: str, wait_s: float) -> Any:
        asked.append(what)
        return await probe(r, what, wait_s)

    node.probe = counting_probe  # type: ignore[method-assign]
    node.memory = MemoryReading({0: 100 * MiB, 1: 100 * MiB}, {}, None, gpus=False)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(job.run)
            node.start_ranks(0, {0: 100, 1: 101})
            await _until(
                lambda: sum(len(m.get("memory", ())) for m in sent if m["kind"] == "update") >= 10
            )
            node.rank_dies(0, 0, 0)
            node.rank_dies(0, 1, 0)
            await _until(lambda: job.summary is not None)

    anyio.run(main)
    assert protocol.PROBE_MEMORY not in asked


async def _until(predicate: Any, timeout: float = 10) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.005)


# ---- the dashboard's side --------------------------------------------------------------------


def _sample(attempt: int, rank: int, t: float, rss: int) -> dict[str, Any]:
    return {"attempt": attempt, "rank": rank, "t": t, "rss": rss, "cuda": None, "gpu": None}


@pytest.mark.unit
def test_the_dashboard_keeps_each_ranks_last_minutes_and_starts_afresh_on_a_restart(
    tmp_path: Path,
) -> None:
    dash = DashboardState("cafe0001", str(tmp_path), job_spec({"nproc": 2, "max_restarts": 1}))
    dash.apply({"state": "running", "attempt": 0})
    for i in range(FIVE_MINUTES_OF_SAMPLES + 10):
        dash.apply({"memory": [_sample(0, 0, i, i * MiB), _sample(0, 1, i, 5 * MiB)]})
    delta = dash.take_delta()
    assert delta is not None
    series = dash.snapshot()["memory"]["0"]["series"]
    assert len(series) == FIVE_MINUTES_OF_SAMPLES and series[-1] == [
        FIVE_MINUTES_OF_SAMPLES + 9,
        (FIVE_MINUTES_OF_SAMPLES + 9) * MiB,
        None,
    ]
    assert delta["memory"]["1"]["last"]["rss"] == 5 * MiB
    # A sample of the attempt being replaced arrives with the new attempt: dropped.
    dash.apply({"memory": [_sample(0, 0, 1000, 7 * MiB)]})
    dash.apply({"attempt": 1, "memory": [_sample(0, 1, 1001, 7 * MiB), _sample(1, 0, 1002, MiB)]})
    delta = dash.take_delta()
    assert delta is not None and delta["header"]["attempt"] == 1
    assert delta["memory"] == {
        "0": {"samples": [[1002, MiB, None]], "last": _sample(1, 0, 1002, MiB)}
    }
    assert dash.snapshot()["memory"] == {
        "0": {"series": [[1002, MiB, None]], "last": _sample(1, 0, 1002, MiB)}
    }


# ---- the report's words --------------------------------------------------------------------------


def _frame(filename: str, line: int, name: str = "<module>") -> dict[str, Any]:
    return {"filename": filename, "line": line, "name": name}


def _block(size: int, frames: list[dict[str, Any]], state: str = "active_allocated") -> dict:
    return {"size": size + 512, "requested_size": size, "state": state, "frames": frames}


@pytest.mark.unit
def test_what_filled_the_gpu_is_grouped_by_the_innermost_cell_line(tmp_path: Path) -> None:
    """A snapshot in torch's format (torch/cuda/memory.py, _snapshot: segments of blocks, each
    block's frames innermost first): live blocks are grouped by the innermost frame in a cell
    (this cell, or an earlier cell of its session, named by its job), else by the innermost
    frame; freed and cached blocks do not count."""
    session = tmp_path / "sess"
    cell, earlier = session / "c0ffee01" / "cell.py", session / "beef0002" / "cell.py"
    for path, text in (
        (cell, "import torch\nmodel = build()\nfor x in data:\n    out = model(x)\n"),
        (earlier, "opt = make()\nopt.step()\n"),
    ):
        path.parent.mkdir(parents=True)
        path.write_text(text)
    torch_frame = _frame("/site-packages/torch/nn/modules/linear.py", 125, "forward")
    snapshot = {
        "segments": [
            {
                "blocks": [
                    _block(30 * GiB, [torch_frame, _frame(str(cell), 4)]),
                    _block(11 * GiB, [torch_frame, _frame(str(cell), 4)]),
                    _block(
                        20 * GiB,
                        [
                            _frame("/torch/optim/adam.py", 90, "_init_group"),
                            _frame(str(earlier), 2),
                        ],
                    ),
                    _block(3 * GiB, [_frame("/lib/helper.py", 7, "make_buffer")]),
                    _block(GiB, []),
                    _block(50 * GiB, [_frame(str(cell), 2)], state="inactive"),
                    _block(50 * GiB, [_frame(str(cell), 2)], state="active_awaiting_free"),
                ]
            }
        ],
        "device_traces": [],
    }
    groups = largest(snapshot, cell)
    assert [(g["bytes"], g["blocks"], g["job"], g["line"], g["what"]) for g in groups] == [
        (41 * GiB, 2, None, 4, "out = model(x)"),
        (20 * GiB, 1, "beef0002", 2, "opt.step()"),
        (3 * GiB, 1, None, None, "helper.py:7 in make_buffer"),
        (GiB, 1, None, None, "no stack recorded (allocated before --memory-history was on)"),
    ]
    assert groups[0]["stack"] == ["linear.py:125 in forward", "cell.py:4 in <module>"]
    memory = {
        "device": 2,
        "history": {"snapshot": "/run/attempt-0/rank-1.memory.pickle", "largest": groups},
    }
    assert report.oom_lines(memory) == [
        "what filled GPU 2 (live allocations by the cell line that made them):",
        "  41.0 GiB  cell line 4: out = model(x)  (2 blocks)",
        "  20.0 GiB  cell of job beef0002, line 2: opt.step()  (1 block)",
        "   3.0 GiB  helper.py:7 in make_buffer  (1 block)",
        "   1.0 GiB  no stack recorded (allocated before --memory-history was on)  (1 block)",
        "torch's memory snapshot: /run/attempt-0/rank-1.memory.pickle (drop it on "
        "https://pytorch.org/memory_viz)",
    ]
    # Without --memory-history, the report says how to see this next time.
    (hint,) = report.oom_lines({"device": 2, "requested": "2.00 GiB"})
    assert "--memory-history" in hint and "%elastic config --memory-history" in hint


@pytest.mark.unit
def test_the_figures_read_as_a_person_reads_them() -> None:
    assert [report.size(n) for n in (512, 300 * MiB, int(74.14 * GiB))] == [
        "0 KiB",
        "300 MiB",
        "74.1 GiB",
    ]
    assert report.rate(1.2 * GiB) == "+1.2 GiB per minute"
    assert report.rate(-600 * MiB) == "-600 MiB per minute"
    assert report.rate(0.5 * MiB) is None


# ---- real ranks ----------------------------------------------------------------------------------

GROW = """%%elastic --nproc 2 --bg --log-dir {log_dir}
import os, pathlib, time
here = pathlib.Path({markers!r})
held = []
if os.environ["RANK"] == "1":
    for step in range(1, 6):
        while not (here / f"step-{{step}}").exists():
            time.sleep(0.02)
        held.append(b"\\x01" * (100 * 2**20))  # written: resident
        (here / f"held-{{step}}").touch()
while not (here / "done").exists():
    time.sleep(0.02)
"""


def _host(status: dict[str, Any], job: str, rank: int) -> int | None:
    ranks = status.get("memory", {}).get(job, {})
    return ranks[str(rank)]["sample"]["rss"] if str(rank) in ranks else None


@pytest.mark.e2e
def test_a_rank_that_grows_in_steps_shows_in_the_samples_and_in_status(
    kernel: Kernel, tmp_path: Path
) -> None:
    """Rank 1 takes 100 MiB five times, a step whenever the test asks; after each, the
    supervisor's latest sample shows it. The dashboard's samples (the updates the job sent)
    climb through every step; %elastic status prints the latest figures, the peak and the
    growth."""
    markers = tmp_path / "markers"
    markers.mkdir()
    ex = kernel.ok(GROW.format(log_dir=tmp_path / "runs", markers=str(markers)))
    job = ex.job_id
    sock = supervisor_socket(kernel)

    def status() -> dict[str, Any]:
        return ask_supervisor(sock, {"kind": "status", "req": 1})["data"]

    assert wait_for(lambda: _host(status(), job, 1) is not None, timeout=60)
    base = _host(status(), job, 1)
    assert base is not None
    for step in range(1, 6):
        (markers / f"step-{step}").touch()
        assert wait_for((markers / f"held-{step}").exists, timeout=30)
        want = base + step * 100 * MiB - 20 * MiB
        assert wait_for(lambda w=want: (_host(status(), job, 1) or 0) >= w, timeout=10), step

    shown = kernel.ok("%elastic status").stdout
    line = next(x for x in shown.splitlines() if x.strip().startswith("rank 1:"))
    m = re.match(
        r"\s+rank 1: (\d+) MiB host; host peak (\d+) MiB, \+[\d.]+ [MG]iB per minute", line
    )
    assert m, shown
    assert int(m[1]) * MiB >= base + 480 * MiB and int(m[2]) >= int(m[1])
    assert f"memory of {job}'s ranks" in shown

    (markers / "done").touch()
    kernel.ok("_.wait()")
    reply = ask_supervisor(sock, {"kind": "events", "req": 2, "job": job, "since": 0})["data"]
    ones = sorted(
        (s["t"], s["rss"]) for e in reply["events"] for s in e.get("memory", ()) if s["rank"] == 1
    )
    levels = {round((rss - base) / (100 * MiB)) for _, rss in ones}
    assert {0, 1, 2, 3, 4, 5} <= levels, levels  # every step was sampled on its way up
    assert all(b[1] >= a[1] - 20 * MiB for a, b in itertools.pairwise(ones))  # it never fell back
    assert len(ones) <= (ones[-1][0] - ones[0][0]) / 1.0 + 2  # at most one a second
    assert_job_gone(job)


LIMITED = """%%elastic --nproc 2 --log-dir {log_dir}
import json, os, pathlib, time
cgroup = pathlib.Path({cgroup!r})
def used():
    stat = dict(line.split() for line in (cgroup / "memory.stat").read_text().splitlines())
    return int((cgroup / {usage!r}).read_text()) - int(stat.get({inactive!r}, 0))
events = pathlib.Path(os.environ["ELASTIC_NB_RUN_DIR"]) / "events.jsonl"
def alerted():
    return any(
        e.get("event") == "alert" and e.get("kind") == "memory"
        for e in map(json.loads, events.read_text().splitlines())
    )
if os.environ["RANK"] == "1":
    limit = used() + 700 * 2**20
    (cgroup / {limit_file!r}).write_text(str(limit))
    {swap}
    held = []
    while used() < 0.93 * limit:
        held.append(b"\\x01" * (10 * 2**20))
    deadline = time.monotonic() + 30
    while not alerted() and time.monotonic() < deadline:
        time.sleep(0.02)
    print("alerted" if alerted() else "no alert", flush=True)
    while True:
        held.append(b"\\x01" * (10 * 2**20))
time.sleep(300)
"""


@pytest.mark.e2e
def test_near_the_cgroups_limit_an_alert_then_the_oom_kill_names_the_rank_and_its_peak(
    tmp_path: Path, cache_home: Path
) -> None:
    """The kernel, its supervisor and the ranks run in a memory cgroup of the test's own; rank
    1 limits it to what it uses now plus 700 MiB, grows to 93% of that, waits for the alert in
    the job's events, then grows until the OOM killer ends it. One alert, before the kill, naming
    rank 1; the failure says host_oom with rank 1's peak; nothing of the job is left."""
    why = cgroups.unusable()
    if why:
        pytest.skip(why)
    with cgroups.memory_cgroup() as cg:
        k = Kernel(str(tmp_path), env={"XDG_CACHE_HOME": str(cache_home)}, cmd_prefix=cg.prefix)
        try:
            k.ok("%load_ext elastic_nb")
            ex = k.run(
                LIMITED.format(
                    log_dir=tmp_path / "runs",
                    cgroup=str(cg.path),
                    usage=cg.usage_file,
                    inactive=cg.inactive_key,
                    limit_file=cg.limit_file,
                    swap=cg.no_swap_line("limit"),
                ),
                timeout=180,
            )
            assert ex.ename == "JobFailed", ex.stdout + ex.traceback
            assert "[rank 1] alerted" in ex.stdout
            job = ex.job_id
            events = run_events(cache_home, job, log_dir=tmp_path / "runs")
            alerts = [e for e in events if e["event"] == "alert" and e["kind"] == "memory"]
            assert len(alerts) == 1, alerts
            assert alerts[0]["rank"] == 1
            assert re.match(
                r"rank 1: 9\d% of the host memory its ranks may use \(.* of .*: its cgroup's "
                rf"{re.escape(cg.limit_file)} \(/{re.escape(cg.path.name)}\)\)",
                alerts[0]["title"],
            ), alerts[0]["title"]
            exit_ = next(e for e in events if e["event"] == "rank.exit" and e["rank"] == 1)
            assert alerts[0]["t"] < exit_["t"]
            summary = run_summary(cache_home, job, log_dir=tmp_path / "runs")
            assert summary["cause"] == "host_oom" and summary["failure"]["rank"] == 1
            m = re.search(
                r"killed by SIGKILL from the kernel's OOM killer \(host memory; it peaked at "
                r"([\d.]+) (MiB|GiB) resident\)",
                summary["failure"]["summary"],
            )
            assert m, summary["failure"]["summary"]
            assert float(m[1]) * (MiB if m[2] == "MiB" else GiB) >= 500 * MiB
            assert "rank 1 failed first: killed by SIGKILL from the kernel's OOM killer" in (
                ex.error["evalue"] + ex.traceback
            )
            assert_job_gone(job)
            assert k.ok("21 * 2").result == "42"
        finally:
            k.shutdown()


TORCH_LOADED = """%%elastic --nproc 2 --bg
import os, pathlib, time, torch
x = torch.ones(3)
here = pathlib.Path({markers!r})
(here / f"loaded-{{os.environ['RANK']}}").touch()
while not (here / "done").exists():
    time.sleep(0.02)
"""


@pytest.mark.e2e
def test_neither_the_kernel_nor_the_supervisor_loads_torch(kernel: Kernel, tmp_path: Path) -> None:
    """Whatever a job does, the kernel and the supervisor never load torch (so never CUDA: a
    context there would pin GPU memory for their lives): memory is read from /proc and NVML.
    The ranks hold torch until the supervisor has sampled each of them since it loaded it (the
    check would hold without any sample), then end; it is checked then and after the job."""
    markers = tmp_path / "markers"
    markers.mkdir()
    ex = kernel.ok(TORCH_LOADED.format(markers=str(markers)))
    job, sock = ex.job_id, supervisor_socket(kernel)
    loaded = [markers / f"loaded-{rank}" for rank in (0, 1)]
    assert wait_for(lambda: all(p.exists() for p in loaded), timeout=60)
    since = max(p.stat().st_mtime for p in loaded)

    def sampled() -> bool:
        status = ask_supervisor(sock, {"kind": "status", "req": 1})["data"]
        ranks = status.get("memory", {}).get(job, {})
        return all(str(r) in ranks and ranks[str(r)]["sample"]["t"] > since for r in (0, 1))

    assert wait_for(sampled, timeout=30)  # once a second, the README says
    supervisor = kernel.supervisor().pid

    def neither_loads_torch() -> None:
        for pid in (kernel.pid, supervisor):
            maps = Path(f"/proc/{pid}/maps").read_text()
            assert "libtorch" not in maps and "libcuda" not in maps, pid

    neither_loads_torch()
    (markers / "done").touch()
    kernel.ok("_.wait()")
    assert_job_gone(job)
    neither_loads_torch()
    assert kernel.ok("import sys; 'torch' in sys.modules").result == "False"
