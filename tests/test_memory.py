"""Memory per rank: sampled each second, alerts before a limit, the peaks a job leaves, what
filled the GPU at a CUDA OOM, the words of a host OOM.

The supervisor's side is played on a fake site (the test sets what each reading finds); the host
side runs real ranks: one that grows in steps (seen in the dashboard's samples and in
`%elastic status`), and one that grows in a memory cgroup the test limits, until the OOM killer
ends it (root only). What needs a GPU (the allocator's figures, the snapshot) is in
test_cuda.py.
"""

from __future__ import annotations

import contextlib
import itertools
import re
import signal
from pathlib import Path
from typing import Any

import anyio
import pytest

from elastic_nb import protocol
from elastic_nb.common import procs, report
from elastic_nb.common.host_memory import MemoryLimit
from elastic_nb.common.rundir import RunDir
from elastic_nb.common.submission import Submission
from elastic_nb.kernel.dashboard.model import DashboardState
from elastic_nb.kernel.flags import job_spec
from elastic_nb.rank.memory import largest
from elastic_nb.supervisor.processes.site import MemoryReading
from elastic_nb.supervisor.ranks.memory_watch import MemoryWatch
from elastic_nb.supervisor.runs import rank_group
from elastic_nb.supervisor.runs.job import Job
from tests import cgroups
from tests.fake_site import FakeSite
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
# docs/howto/dashboard.md: each rank's sparkline is "its last five minutes", of samples taken once a second.
FIVE_MINUTES_OF_SAMPLES = 5 * 60
_META = {"display": True, "modules": {}, "objects": [], "pull": []}


# ---- the supervisor's side, on a fake site -------------------------------------------------------


def _job(tmp_path: Path) -> tuple[Job, FakeSite, list[dict[str, Any]]]:
    spec = job_spec({"nproc": "2", "log_dir": str(tmp_path)}, cwd=str(tmp_path))
    sent: list[dict[str, Any]] = []

    async def send(msg: Any) -> None:
        sent.append(dict(msg))

    site = FakeSite(RunDir.of(spec.log_dir, "cafe0001"))
    job = Job(Submission("cafe0001", spec, "x = 1\n", _META, None), {}, site, send)
    job.prepare()
    return job, site, sent


def _reading(used: int, rss: dict[int, int], gpu_used: int = 10 * GiB) -> MemoryReading:
    share = protocol.records.GpuShare(index=3, process=gpu_used, used=gpu_used, total=80 * GiB)
    return MemoryReading(
        rss, {0: share}, MemoryLimit(used, 10 * GiB, "its cgroup's memory.max (/job)"), gpus=True
    )


def _cuda(reserved: int) -> protocol.records.CudaMemory:
    return protocol.records.CudaMemory(
        device=0, allocated=reserved // 2, reserved=reserved, peak=reserved, total=80 * GiB
    )


@pytest.mark.unit
def test_samples_alerts_once_per_crossing_and_a_host_ooms_peak(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Samples reach the kernel in the updates (host from the site, CUDA from the ranks where
    its machine has GPUs); the host limit's alert fires once at 90%, again only after falling below
    85%; a GPU's alert names the rank and its GPU; a rank the OOM killer ends is reported with
    its sampled peak; the summary keeps every rank's peaks."""
    monkeypatch.setattr(rank_group, "SAMPLE_S", 0.01)
    job, site, sent = _job(tmp_path)
    site.kills = 0
    site.cuda = {0: _cuda(12 * GiB)}

    def samples() -> list[protocol.records.MemorySample]:
        return [s for m in sent if m["kind"] == protocol.kernel.UPDATE for s in m.get("memory", ())]

    def memory_alerts() -> list[protocol.records.Alert]:
        return [
            a
            for m in sent
            if m["kind"] == protocol.kernel.UPDATE
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
            site.memory = _reading(5 * GiB, {0: 300 * MiB, 1: 2 * GiB})
            site.start_ranks(0, {0: 100, 1: 101})
            await settle()
            assert memory_alerts() == []
            site.memory = _reading(int(9.3 * GiB), {0: 300 * MiB, 1: 3 * GiB})
            await settle()
            site.memory = _reading(int(9.5 * GiB), {0: 300 * MiB, 1: 3 * GiB})  # still near
            await settle()
            assert len(memory_alerts()) == 1
            site.memory = _reading(int(8.6 * GiB), {0: 300 * MiB, 1: 3 * GiB})  # not below 85%
            await settle()
            site.memory = _reading(int(9.2 * GiB), {0: 300 * MiB, 1: 3 * GiB})
            await settle()
            assert len(memory_alerts()) == 1
            site.memory = _reading(8 * GiB, {0: 300 * MiB, 1: 3 * GiB})  # below 85%: armed
            await settle()
            site.memory = _reading(int(9.1 * GiB), {0: 300 * MiB, 1: int(3.5 * GiB)})
            await settle()
            assert len(memory_alerts()) == 2
            site.memory = _reading(
                8 * GiB, {0: 300 * MiB, 1: int(3.5 * GiB)}, gpu_used=int(74.4 * GiB)
            )
            await settle()
            assert len(memory_alerts()) == 3
            site.kills = 1
            site.rank_dies(0, 1, -signal.SIGKILL)
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
    end = next(m for m in sent if m["kind"] == protocol.kernel.END)["summary"]
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
    """Where the site's machine has no GPUs, the ranks are never asked (a CPU rank pays nothing)."""
    monkeypatch.setattr(rank_group, "SAMPLE_S", 0.01)
    job, site, sent = _job(tmp_path)
    asked: list[str] = []
    probe = site.probe

    async def counting_probe(r: Any, what: str, wait_s: float) -> Any:
        asked.append(what)
        return await probe(r, what, wait_s)

    site.probe = counting_probe  # type: ignore[method-assign]
    site.memory = MemoryReading({0: 100 * MiB, 1: 100 * MiB}, {}, None, gpus=False)

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            tg.start_soon(job.run)
            site.start_ranks(0, {0: 100, 1: 101})
            await _until(
                lambda: sum(len(m.get("memory", ())) for m in sent if m["kind"] == "update") >= 10
            )
            site.rank_dies(0, 0, 0)
            site.rank_dies(0, 1, 0)
            await _until(lambda: job.summary is not None)

    anyio.run(main)
    assert protocol.rank_probes.PROBE_MEMORY not in asked


def _gpu_sample(rank: int, t: float, process: int, used: int) -> protocol.records.MemorySample:
    share = protocol.records.GpuShare(index=3, process=process, used=used, total=80 * GiB)
    return protocol.records.MemorySample(
        attempt=0, rank=rank, t=t, rss=GiB, cuda=None, gpu=share, limit=None
    )


@pytest.mark.unit
def test_ranks_sharing_a_gpu_get_one_alert_naming_the_one_that_grows() -> None:
    """Two ranks on GPU 3 cross 90% of it together: one alert for the GPU (not one per rank),
    naming rank 1, whose share grows, over rank 0, which holds more; with the growth per minute.
    Again only once the GPU fell below 85%."""
    watch = MemoryWatch()
    alerts: list[tuple[int, str]] = []
    for i in range(11):  # ten seconds: rank 1 takes 1 GiB more each second
        used = int(62 * GiB) + i * GiB  # every process on the GPU, as NVML counts them
        watch.add(_gpu_sample(0, 100.0 + i, 40 * GiB, used))
        watch.add(_gpu_sample(1, 100.0 + i, 20 * GiB + i * GiB, used))
        alerts += watch.alerts(0, None)
    assert alerts == [
        (
            1,
            "rank 1: 90% of GPU 3 (72.0 GiB of 80.0 GiB), +60.0 GiB per minute; ranks 0, 1 "
            "share GPU 3, rank 1 holds 30.0 GiB",
        )
    ]
    for t, used in ((111.0, 70 * GiB), (112.0, 73 * GiB), (113.0, 67 * GiB), (114.0, 73 * GiB)):
        watch.add(_gpu_sample(0, t, 40 * GiB, used))
        watch.add(_gpu_sample(1, t, 30 * GiB, used))
        alerts += watch.alerts(0, None)
    assert len(alerts) == 2  # 73 GiB after 67 (84%): a second crossing, said once
    assert alerts[1][0] == 1 and alerts[1][1].startswith("rank 1: 91% of GPU 3 (73.0 GiB of ")


@pytest.mark.unit
def test_the_host_alert_says_how_fast_the_rank_grows() -> None:
    """Over three seconds and more of samples the alert gives the rank's growth per minute
    (over the last minute): '+X per minute', from its resident memory."""
    watch = MemoryWatch()
    limit = MemoryLimit(int(9.3 * GiB), 10 * GiB, "its cgroup's memory.max (/job)")
    for i in range(5):
        watch.add(_sample(0, 0, 200.0 + i, 300 * MiB))
        watch.add(_sample(0, 1, 200.0 + i, 2 * GiB + i * 50 * MiB))
    assert watch.growth(0, 1, "rss") == pytest.approx(3000 * MiB)
    ((rank, title),) = watch.alerts(0, limit)
    assert rank == 1
    assert title == (
        "rank 1: 93% of the host memory its ranks may use (9.3 GiB of 10.0 GiB: its cgroup's "
        "memory.max (/job)), +2.9 GiB per minute; rank 1 holds 2.2 GiB"
    )
    shrinking = MemoryWatch()
    for i in range(5):
        shrinking.add(_sample(0, 0, 200.0 + i, 3 * GiB - i * 100 * MiB))
    ((_, title),) = shrinking.alerts(0, limit)
    assert ", -5.9 GiB per minute; rank 0 holds 2.6 GiB" in title


async def _until(predicate: Any, timeout: float = 10) -> None:
    with anyio.fail_after(timeout):
        while not predicate():
            await anyio.sleep(0.005)


# ---- the dashboard's side --------------------------------------------------------------------


def _sample(attempt: int, rank: int, t: float, rss: int) -> dict[str, Any]:
    return {
        "attempt": attempt,
        "rank": rank,
        "t": t,
        "rss": rss,
        "cuda": None,
        "gpu": None,
        "limit": None,
    }


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
    # Each group's stack (its largest block's), in call order from the cell's line down to the
    # allocation; a stack of one frame is the group's own line, not repeated.
    assert report.oom_lines(memory) == [
        "what filled GPU 2 (live allocations by the cell line that made them):",
        "  41.0 GiB  cell line 4: out = model(x)  (2 blocks)",
        "            its largest block: cell line 4 → linear.py:125 in forward",
        "  20.0 GiB  cell of job beef0002, line 2: opt.step()  (1 block)",
        "            its largest block: cell of job beef0002, line 2 → adam.py:90 in _init_group",
        "   3.0 GiB  helper.py:7 in make_buffer  (1 block)",
        "   1.0 GiB  no stack recorded (allocated before --memory-history was on)  (1 block)",
        "torch's memory snapshot: /run/attempt-0/rank-1.memory.pickle (drop it on "
        "https://pytorch.org/memory_viz)",
    ]
    # Without --memory-history, the report says how to see this next time.
    (hint,) = report.oom_lines({"device": 2, "requested": "2.00 GiB"})
    assert "--memory-history" in hint and "%elastic config --memory-history" in hint


@pytest.mark.unit
def test_a_deep_stack_is_shown_bounded_with_the_cells_first(tmp_path: Path) -> None:
    """An allocation 12 frames below the cell, reached through a function an earlier cell of
    the session defined: the report's stack starts at the cell's line (elastic_nb's frames
    above it left out), keeps the cells' frames, then the innermost, and says what it left out
    between; at most STACK_FRAMES frames."""
    from elastic_nb.rank.memory import STACK_FRAMES, calls_of

    session = tmp_path / "sess"
    cell, earlier = session / "c0ffee01" / "cell.py", session / "beef0002" / "cell.py"
    deep = [_frame(f"/torch/lib{i}.py", 100 + i, f"fn{i}") for i in range(12)]
    frames = [
        *deep,  # innermost first, as torch lists them
        _frame(str(earlier), 3, "train_step"),
        _frame(str(cell), 7),
        _frame("/site-packages/elastic_nb/rank/bootstrap.py", 300, "_run_cell"),
        _frame("/site-packages/elastic_nb/rank/bootstrap.py", 120, "run_cell"),
    ]
    calls = calls_of(frames, cell)
    assert len([c for c in calls if "skipped" not in c]) == STACK_FRAMES
    assert calls == [
        {"job": None, "line": 7},
        {"job": "beef0002", "line": 3},
        {"skipped": 6},
        *({"where": f"lib{i}.py:{100 + i} in fn{i}"} for i in range(5, -1, -1)),
    ]
    (group,) = largest({"segments": [{"blocks": [_block(5 * GiB, frames)]}]}, cell)
    assert group["calls"] == calls and (group["job"], group["line"]) == ("beef0002", 3)
    lines = report.oom_lines({"device": 0, "history": {"snapshot": None, "largest": [group]}})
    assert lines[2] == (
        "            its largest block: cell line 7 → cell of job beef0002, line 3 → (6 frames) "
        "→ lib5.py:105 in fn5 → lib4.py:104 in fn4 → lib3.py:103 in fn3 → lib2.py:102 in fn2 "
        "→ lib1.py:101 in fn1 → lib0.py:100 in fn0"
    )
    # No cell in the stack (a thread of a library): its innermost frames, the rest counted.
    assert calls_of(deep, cell)[:2] == [{"skipped": 4}, {"where": "lib7.py:107 in fn7"}]


def _fake_cuda(monkeypatch: pytest.MonkeyPatch, snapshot: Any, taken: list[int]) -> None:
    """torch's CUDA as a rank at an OOM sees it, on a machine without CUDA: initialised, and
    its snapshot what `snapshot` says (an exception is raised). `taken` counts the snapshots."""
    import torch

    from elastic_nb.rank import memory

    def take() -> Any:
        taken.append(1)
        if isinstance(snapshot, BaseException):
            raise snapshot
        return snapshot

    def twice(*args: Any, **kwargs: Any) -> None:
        raise AssertionError("_dump_snapshot takes a second snapshot")

    monkeypatch.setattr(torch.cuda, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.cuda.memory, "_snapshot", take)
    monkeypatch.setattr(torch.cuda.memory, "_dump_snapshot", twice)
    monkeypatch.setattr(memory, "_recording", True)
    monkeypatch.setattr(memory, "_start_failed", None)


@pytest.mark.unit
def test_at_an_oom_the_snapshot_is_taken_once_and_written_as_torch_writes_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import pickle

    from elastic_nb.rank.memory import snapshot_at_oom

    cell = tmp_path / "c0ffee01" / "cell.py"
    cell.parent.mkdir()
    cell.write_text("import torch\nx = torch.empty(1 << 30, device='cuda')\n")
    snapshot = {"segments": [{"blocks": [_block(GiB, [_frame(str(cell), 2)])]}]}
    taken: list[int] = []
    _fake_cuda(monkeypatch, snapshot, taken)
    path = tmp_path / "rank-0.memory.pickle"
    history = snapshot_at_oom(path, cell)
    assert taken == [1]
    assert history is not None and history["snapshot"] == str(path) and "failed" not in history
    assert pickle.loads(path.read_bytes()) == snapshot  # what torch's _dump_snapshot writes
    assert history["largest"][0]["what"] == "x = torch.empty(1 << 30, device='cuda')"


@pytest.mark.unit
def test_with_the_flag_on_a_failed_snapshot_is_said_not_the_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--memory-history was on: a report that said "run again with --memory-history" would
    send the user round in a circle. It says what failed instead: the snapshot, writing it,
    or the recording's start."""
    from elastic_nb.rank import memory

    cell = tmp_path / "cell.py"
    cell.write_text("x = 1\n")
    taken: list[int] = []
    _fake_cuda(monkeypatch, RuntimeError("CUDA error: an illegal memory access"), taken)
    history = memory.snapshot_at_oom(tmp_path / "rank-0.memory.pickle", cell)
    assert taken == [1]
    lines = report.oom_lines({"device": 1, "history": history})
    assert lines == [
        "what filled GPU 1: --memory-history was on, but torch.cuda.memory._snapshot() raised "
        "RuntimeError('CUDA error: an illegal memory access')"
    ]
    # The snapshot read, its file not written: the groups, and why there is no file.
    _fake_cuda(monkeypatch, {"segments": [{"blocks": [_block(GiB, [_frame(str(cell), 1)])]}]}, [])
    history = memory.snapshot_at_oom(tmp_path / "gone" / "rank-0.memory.pickle", cell)
    lines = report.oom_lines({"device": 1, "history": history})
    assert lines[:2] == [
        "what filled GPU 1 (live allocations by the cell line that made them):",
        "   1.0 GiB  cell line 1: x = 1  (1 block)",
    ]
    assert lines[2].startswith(
        f"what filled GPU 1: --memory-history was on, but writing the snapshot to "
        f"{tmp_path / 'gone' / 'rank-0.memory.pickle'} failed: FileNotFoundError("
    )
    assert len(lines) == 3  # no snapshot named
    # The recording never started (torch refused it when CUDA came up).
    monkeypatch.setattr(
        memory, "_start_failed", "torch.cuda.memory._record_memory_history raised X"
    )
    history = memory.snapshot_at_oom(tmp_path / "rank-0.memory.pickle", cell)
    assert report.oom_lines({"device": None, "history": history}) == [
        "what filled the GPU: --memory-history was on, but "
        "torch.cuda.memory._record_memory_history raised X"
    ]
    for text in (lines, report.oom_lines({"device": 1, "history": history})):
        assert not any("run the cell again" in line for line in text)


@pytest.mark.unit
def test_the_oom_alert_shows_what_filled_the_gpu_with_the_stacks(tmp_path: Path) -> None:
    """The alert a CUDA OOM raises while the ranks still run (a job's, a session cell's) says
    what the report says: the groups, each one's stack, the snapshot; or what failed."""
    from elastic_nb.common.rank_state import RankState
    from elastic_nb.supervisor.runs.diagnosis import oom_alert

    cell = tmp_path / "c0ffee01" / "cell.py"
    cell.parent.mkdir()
    cell.write_text("import torch\nout = model(x)\n")
    frames = [_frame("/torch/nn/modules/linear.py", 125, "forward"), _frame(str(cell), 2)]
    groups = largest({"segments": [{"blocks": [_block(3 * GiB, frames)]}]}, cell)
    memory: dict[str, Any] = {
        "requested": "2.00 GiB",
        "device": 0,
        "allocated": 3 * GiB,
        "reserved": 3 * GiB,
        "history": {"snapshot": "/run/attempt-0/rank-1.memory.pickle", "largest": groups},
    }
    r = RankState(0, 1, failure={"cell_line": 2, "memory": memory, "time": 1.0})
    title, text = oom_alert(r)
    assert title == (
        "rank 1 ran out of CUDA memory on GPU 0 at cell line 2 (requested 2.00 GiB, allocated "
        "3.00 GiB, reserved 3.00 GiB)"
    )
    assert text.splitlines()[:4] == [
        "what filled GPU 0 (live allocations by the cell line that made them):",
        "   3.0 GiB  cell line 2: out = model(x)  (1 block)",
        "            its largest block: cell line 2 → linear.py:125 in forward",
        "torch's memory snapshot: /run/attempt-0/rank-1.memory.pickle (drop it on "
        "https://pytorch.org/memory_viz)",
    ]
    memory["history"] = {"snapshot": None, "largest": None, "failed": "torch said no"}
    _, text = oom_alert(r)
    assert text.splitlines()[0] == "what filled GPU 0: --memory-history was on, but torch said no"
    assert "run the cell again" not in text


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


_SIZE = r"[\d.]+ [KMG]iB"


def _bytes(text: str, most: bool = False) -> float:
    """'412 MiB', '1.2 GiB' (report.size) back to bytes; `most`: the most it can stand for
    (report.size rounds to a MiB below a GiB, to a tenth of a GiB above)."""
    number, unit = text.split()
    scale = {"KiB": 2**10, "MiB": MiB, "GiB": GiB}[unit]
    rounding = 0.05 * GiB if unit == "GiB" else 0.5 * scale
    return float(number) * scale + (rounding if most else 0)


@pytest.mark.unit
def test_sizes_read_back_above_and_below_a_gib() -> None:
    for n in (300 * MiB, 1023 * MiB, int(1.5 * GiB), 40 * GiB):
        assert re.fullmatch(_SIZE, report.size(n))
        assert abs(_bytes(report.size(n)) - n) <= 0.05 * GiB


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
    # Sizes as report.size writes them: MiB below a GiB, GiB with a decimal above.
    m = re.match(
        rf"\s+rank 1: ({_SIZE}) host; host peak ({_SIZE}), \+[\d.]+ [MG]iB per minute", line
    )
    assert m, shown
    assert _bytes(m[1], most=True) >= base + 480 * MiB and _bytes(m[2]) >= _bytes(m[1])
    assert f"memory of {job}'s ranks" in shown

    (markers / "done").touch()
    kernel.ok("_.wait()")
    reply = ask_supervisor(sock, {"kind": "events", "req": 2, "job": job, "since": 0})["data"]
    ones = sorted(  # a sample without a figure is of a rank on its way out (procs.rss)
        (s["t"], s["rss"])
        for e in reply["events"]
        for s in e.get("memory", ())
        if s["rank"] == 1 and s["rss"] is not None
    )
    levels = {round((rss - base) / (100 * MiB)) for _, rss in ones}
    assert {0, 1, 2, 3, 4, 5} <= levels, levels  # every step was sampled on its way up
    assert all(b[1] >= a[1] - 20 * MiB for a, b in itertools.pairwise(ones))  # it never fell back
    assert len(ones) <= (ones[-1][0] - ones[0][0]) / 1.0 + 2  # at most one a second
    assert_job_gone(job)


STEPS_IN_TEXT = """%%elastic --nproc 2 --log-dir {log_dir}
import os, pathlib, time
here = pathlib.Path({markers!r})
held = []
if os.environ["RANK"] == "1":
    for step in range(1, 4):
        while not (here / f"step-{{step}}").exists():
            time.sleep(0.02)
        held.append(b"\\x01" * (200 * 2**20))
        (here / f"held-{{step}}").touch()
while not (here / "done").exists():
    time.sleep(0.02)
"""
_MEMORY_LINE = re.compile(rf"\[elastic_nb\] memory: rank 0 ({_SIZE}) host · rank 1 ({_SIZE}) host")


# What report.size's rounding can hide above a GiB (a tenth of a GiB, rounded).
_ROUNDING = 0.05 * GiB


def _memory_lines(ex: Any) -> list[tuple[float, float, float]]:
    """Each memory line the cell printed: (when the kernel sent it, rank 0's, rank 1's bytes,
    as shown)."""
    found = []
    for m in ex.messages:
        if m["msg_type"] == "stream" and m["content"]["name"] == "stdout":
            date = m["header"]["date"]
            sent = float(date.timestamp() if hasattr(date, "timestamp") else date)
            for line in m["content"]["text"].splitlines():
                if line.startswith("[elastic_nb] memory:"):
                    hit = _MEMORY_LINE.fullmatch(line)
                    assert hit, line
                    found.append((sent, _bytes(hit[1]), _bytes(hit[2])))
    return found


def _quiet_for(kernel: Kernel, msg_id: str, ex: Any, seconds: float) -> None:
    """Take in what the cell prints for `seconds` (it is still running)."""
    with contextlib.suppress(TimeoutError):
        kernel.collect(msg_id, ex, timeout=seconds, until=lambda _: False)


@pytest.mark.e2e
def test_text_mode_prints_the_ranks_memory_while_the_job_runs_bounded(
    kernel: Kernel, tmp_path: Path
) -> None:
    """Text mode (no widgets: nbconvert, a terminal): a memory line once the job has run the
    interval (a second here: the renderer's MEMORY_EVERY_S, set in the kernel), then only when
    a figure moved by a tenth since the last line, at most once per interval: one per step of
    rank 1's growth, none while it holds steady; the peak line still closes the cell."""
    markers = tmp_path / "markers"
    markers.mkdir()
    every = float(
        kernel.ok("import elastic_nb.kernel.render_text as _rt\n_rt.MEMORY_EVERY_S").result
    )
    kernel.ok("_rt.MEMORY_EVERY_S = 1.0")
    try:
        msg_id, ex = kernel.start(
            STEPS_IN_TEXT.format(log_dir=tmp_path / "runs", markers=str(markers))
        )
        kernel.collect(msg_id, ex, timeout=60, until=lambda e: _memory_lines(e))
        ((_, zero, base),) = _memory_lines(ex)
        for step in range(1, 4):
            (markers / f"step-{step}").touch()
            want = base + step * 200 * MiB - 20 * MiB
            kernel.collect(
                msg_id,
                ex,
                timeout=30,
                until=lambda e, w=want: _memory_lines(e)[-1][2] + _ROUNDING >= w,
            )
        assert (markers / "held-3").exists()
        shown = len(_memory_lines(ex))
        _quiet_for(kernel, msg_id, ex, 3.0)  # three intervals, nothing moved
        assert len(_memory_lines(ex)) == shown, ex.stdout
        (markers / "done").touch()
        kernel.collect(msg_id, ex, timeout=60)
    finally:
        kernel.ok(f"_rt.MEMORY_EVERY_S = {every!r}")
    assert ex.error is None, ex.traceback
    lines = _memory_lines(ex)
    assert 4 <= len(lines) <= 3 * 2 + 1, ex.stdout  # a first, one or two per step (mid-fill)
    for (t0, *before), (t1, *after) in itertools.pairwise(lines):
        assert t1 - t0 >= 0.7, lines  # once a second at most (IOPub flushes every 0.2 s)
        # A tenth, as the renderer saw the figures (the line shows them rounded).
        assert any(abs(b - a) >= 0.09 * a for a, b in zip(before, after, strict=True)), lines
    assert lines[-1][2] + 2 * _ROUNDING >= base + 580 * MiB
    assert abs(lines[-1][1] - zero) < 0.1 * zero
    out = ex.stdout.splitlines()
    last_memory = max(i for i, x in enumerate(out) if x.startswith("[elastic_nb] memory:"))
    peak = next(i for i, x in enumerate(out) if x.startswith("[elastic_nb] peak memory:"))
    assert last_memory < peak < len(out) - 1 and out[-1].startswith(f"[elastic_nb] job {ex.job_id}")


@pytest.mark.e2e
def test_a_sessions_memory_in_status_and_in_its_cells_updates(
    kernel: Kernel, tmp_path: Path
) -> None:
    """A session's ranks are sampled between cells and during them: a cell's updates (what its
    dashboard draws) carry its ranks' samples, rank 1's 300 MiB included, and %elastic status
    prints them under the session. On a session whose ranks see no GPU, %elastic config
    --memory-history is refused at once (not at the next cell), and sets nothing."""
    markers = tmp_path / "markers"
    markers.mkdir()
    up = kernel.ok("%elastic up --nproc 2 --env CUDA_VISIBLE_DEVICES=")
    session = re.search(r"session ([0-9a-f]{8}): 2 ranks up", up.stdout)[1]  # type: ignore[index]
    try:
        refused = kernel.run("%elastic config --memory-history")
        assert refused.ename == "UsageError", refused.stdout
        assert (
            f"session {session}: --memory-history records CUDA allocations, and no NVIDIA GPU "
            "is visible to the ranks" in refused.error["evalue"]  # type: ignore[index]
        )
        assert "--memory-history" not in kernel.ok("%elastic config").stdout
        sock = supervisor_socket(kernel)

        def status() -> dict[str, Any]:
            return ask_supervisor(sock, {"kind": "status", "req": 1})["data"]

        assert wait_for(lambda: _host(status(), session, 1) is not None, timeout=30)
        base = _host(status(), session, 1)
        assert base is not None
        msg_id, ex = kernel.start(
            "%%elastic\n"
            "import os, pathlib, time\n"
            f"here = pathlib.Path({str(markers)!r})\n"
            "held = b'\\x01' * (300 * 2**20) if os.environ['RANK'] == '1' else b''\n"
            "(here / f\"held-{os.environ['RANK']}\").touch()\n"
            "while not (here / 'done').exists():\n"
            "    time.sleep(0.02)\n"
        )
        assert wait_for(lambda: (markers / "held-1").exists(), timeout=30)
        grown = base + 280 * MiB
        assert wait_for(lambda: (_host(status(), session, 1) or 0) >= grown, timeout=10)
        (markers / "done").touch()
        kernel.collect(msg_id, ex, timeout=60)
        assert ex.error is None, ex.traceback
        cell = ex.job_id
        reply = ask_supervisor(sock, {"kind": "events", "req": 2, "job": cell, "since": 0})
        samples = [s for e in reply["data"]["events"] for s in e.get("memory", ())]
        assert {s["rank"] for s in samples} == {0, 1}
        assert max(s["rss"] for s in samples if s["rank"] == 1) >= grown

        shown = kernel.ok("%elastic status").stdout
        assert f"memory of {session}'s ranks (sampled each second):" in shown, shown
        line = next(x for x in shown.splitlines() if x.strip().startswith("rank 1:"))
        m = re.match(rf"\s+rank 1: ({_SIZE}) host; host peak ({_SIZE})", line)
        assert m, shown
        assert _bytes(m[1], most=True) >= grown and _bytes(m[2], most=True) >= grown
    finally:
        kernel.ok("%elastic down")
    assert wait_for(lambda: not procs.job_processes([session]), timeout=30)


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

    assert wait_for(sampled, timeout=30)  # once a second, docs/howto/memory.md says
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
