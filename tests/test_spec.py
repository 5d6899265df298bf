"""JobSpec: parsing and validation, below the kernel."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from elastic_nb.common.spec import JobSpec
from elastic_nb.kernel import gpus
from elastic_nb.kernel.flags import SpecError, job_spec, preflight

pytestmark = pytest.mark.unit


def spec(**options: object) -> JobSpec:
    return job_spec(options, cwd="/tmp", sys_path=["/x"])


def test_defaults() -> None:
    s = spec()
    assert (s.nproc, s.max_restarts, s.start_method, s.rdzv_backend, s.rdzv_endpoint) == (
        1,
        0,
        "forkserver",
        "c10d",
        "localhost:0",
    )
    assert s.timeout is None and s.collective_timeout == 120 and s.widgets
    assert (s.heartbeat_timeout, s.async_error_handling, s.hang_after) == (480, 1, 120)
    assert s.worst_case_s == 180  # the collective timeout, then NCCL's 60 s wait for its dump


@pytest.mark.parametrize(
    ("mode", "worst"),
    [(0, None), (1, 2 * (30 + 60)), (2, 2 * 30), (3, 2 * (30 + 60))],
)
def test_the_worst_case_follows_what_nccl_does_on_a_timeout(mode: int, worst: float) -> None:
    # 1 and 3 end the rank after the flight recorder's dump (60 s); 2 hands the error to the
    # cell at once; 0 ends nothing, so nothing bounds the wait.
    s = spec(collective_timeout="30", max_restarts="1", async_error_handling=str(mode))
    assert s.worst_case_s == worst
    assert s.log_dir.endswith("elastic_nb/runs") and s.sys_path == ("/x",)
    assert s.warm and s.preload == ()


def test_values_are_parsed() -> None:
    s = spec(
        nproc="4",
        max_restarts="2",
        monitor_interval="0.5",
        env=["A=1", "B=x=y"],
        rdzv_conf=["join_timeout=5,last_call_timeout=1"],
        push=["a,b", "c"],
        pull=["z"],
        pull_rank="3",
        timeout="7.5",
        collective_timeout="30",
        log_dir="runs",
    )
    assert (s.nproc, s.max_restarts, s.monitor_interval, s.pull_rank) == (4, 2, 0.5, 3)
    assert s.env == {"A": "1", "B": "x=y"}
    assert s.rdzv_conf == {"join_timeout": "5", "last_call_timeout": "1"}
    assert s.push == ("a", "b", "c") and s.pull == ("z",)
    assert (s.timeout, s.collective_timeout) == (7.5, 30.0)
    assert s.log_dir == "/tmp/runs"  # relative to the notebook's directory


def test_json_round_trip() -> None:
    s = spec(nproc="2", env=["K=V"], push=["a"])
    assert JobSpec.from_json(s.to_json()) == s


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"nproc": "0"}, "--nproc 0: must be at least 1"),
        ({"nproc": "x"}, "--nproc 'x': expected a whole number"),
        ({"nnodes": "3:2"}, "MIN (3) is larger than MAX (2)"),
        ({"nnodes": "a:b"}, "whole numbers"),
        ({"nnodes": "0:2"}, "at least one node"),
        ({"nnodes": "1:2:3"}, "expected N or MIN:MAX"),
        (
            {"nnodes": "2", "rdzv_backend": "static", "rdzv_endpoint": "localhost:29500"},
            "a job across machines rendezvous with c10d",
        ),
        ({"rdzv_conf": ["timeout=60"]}, "use join_timeout=S"),
        ({"rdzv_conf": ["join_timeot=60"]}, "not a setting of the c10d rendezvous"),
        ({"rdzv_conf": ["join_timeout=1.5"]}, "--rdzv-conf join_timeout '1.5'"),
        ({"nnodes": "2", "pull_rank": "2"}, "--pull-rank 2: the job has ranks 0..1"),
        ({"max_restarts": "-1"}, "--max-restarts -1: must be at least 0"),
        ({"monitor_interval": "0"}, "must be a positive number"),
        ({"monitor_interval": "60"}, "above 10 s"),
        ({"timeout": "-3"}, "--timeout -3: must be a positive"),
        ({"collective_timeout": "soon"}, "expected a number of seconds"),
        ({"start_method": "fork"}, "use spawn or forkserver"),
        ({"start_method": "thread"}, "choose one of spawn, forkserver"),
        ({"rdzv_backend": "etcd"}, "c10d or static"),
        ({"rdzv_endpoint": "nohost"}, "expected HOST:PORT"),
        ({"rdzv_endpoint": "localhost:99999"}, "out of range"),
        ({"rdzv_endpoint": "example.com:29500"}, "is not this machine"),
        ({"rdzv_backend": "static"}, "needs a fixed port"),
        ({"env": ["NOVALUE"]}, "expected KEY=VALUE"),
        ({"env": ["1BAD=x"]}, "not a valid environment variable name"),
        ({"env": ["WORLD_SIZE=3"]}, "cannot be overridden"),
        ({"env": ["ELASTIC_NB_JOB=x"]}, "cannot be overridden"),
        ({"push": ["a-b"]}, "not a Python name"),
        ({"nproc": "2", "pull_rank": "2"}, "--pull-rank 2: the job has ranks 0..1"),
        ({"rdzv_id": "a b"}, "--rdzv-id"),
    ],
)
def test_bad_values_name_the_flag(options: dict[str, object], message: str) -> None:
    with pytest.raises(SpecError, match=None) as info:
        spec(**options)
    assert message in str(info.value)


def test_gpu_count_is_what_cuda_would_see_with_the_jobs_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # This machine has no NVIDIA driver: the variable alone names no GPU.
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,3")
    with pytest.raises(
        SpecError, match="no NVIDIA GPU is visible with CUDA_VISIBLE_DEVICES='0,1,3'"
    ):
        spec(nproc="gpu")
    assert spec(nproc="auto").nproc == os.cpu_count()  # falls back to the CPU count
    # Four GPUs as NVML would list them (tests/test_gpus.py checks the rules against torch's).
    found = [gpus.Gpu(f"GPU-{i}000", mig=False) for i in range(4)]
    monkeypatch.setattr(gpus, "nvml_gpus", lambda: found)
    assert spec(nproc="gpu").nproc == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,-1,2")  # CUDA stops at the first invalid
    assert spec(nproc="gpu").nproc == 2
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert spec(nproc="auto").nproc == 4
    assert spec(nproc="gpu", env=["CUDA_VISIBLE_DEVICES=2"]).nproc == 1  # what the ranks get


def test_preflight_refuses_a_busy_port(tmp_path: Path) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(SpecError, match=f"port {port} is already in use"):
            preflight(spec(rdzv_endpoint=f"localhost:{port}", log_dir=str(tmp_path)))
    preflight(spec(rdzv_endpoint=f"localhost:{port}", log_dir=str(tmp_path)))  # free again


def test_preflight_refuses_an_unwritable_log_dir(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    with pytest.raises(SpecError, match="cannot write there"):
        preflight(spec(log_dir=str(tmp_path / "file" / "runs")))


def test_a_local_endpoint_never_waits_on_a_reverse_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_dns() -> str:
        raise AssertionError("getfqdn() called for a loopback endpoint")

    monkeypatch.setattr(socket, "getfqdn", no_dns)
    for endpoint in ("localhost:0", "127.0.0.1:29500", "[::1]:0", f"{socket.gethostname()}:0"):
        assert spec(rdzv_endpoint=endpoint).rdzv_endpoint == endpoint
