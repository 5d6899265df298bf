"""scripts/gpu_check.sh, the GPU check in one command, stays runnable where no GPU is: its wheel
list is the whole closure of what the GPU machine lacks (scripts/gpu_wheels_check.py; the
wheels themselves only where .whl/ has them: the suite never downloads), its scripts parse, and
its CPU rehearsal runs every step end to end and says which need CUDA."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPTS = ROOT / "scripts"


def _load(name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, SCRIPTS / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.unit
def test_every_pin_is_one_version_of_one_package() -> None:
    pinned = _load("gpu_wheels_check").pins()  # name==version lines, no name twice, or SystemExit
    for needed in ("ipykernel", "jupyter-client", "ipython", "ipywidgets", "anywidget", "pyzmq"):
        assert needed in pinned, needed


@pytest.mark.unit
def test_the_downloaded_wheels_are_the_whole_closure() -> None:
    wheels = ROOT / ".whl"
    if not any(wheels.glob("*.whl")):
        pytest.skip("no .whl/ here (bash scripts/gpu_wheels.sh downloads it)")
    problems, notes = _load("gpu_wheels_check").check_wheels(wheels)
    assert not problems, "\n".join(problems + notes)


def _wheel(directory: Path, name: str, version: str, *requires: str) -> None:
    with zipfile.ZipFile(directory / f"{name}-{version}-py3-none-any.whl", "w") as z:
        meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\nRequires-Python: >=3.10\n"
        meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
        z.writestr(f"{name}-{version}.dist-info/METADATA", meta)


@pytest.mark.unit
def test_the_wheel_check_finds_what_is_missing_or_too_old(tmp_path: Path) -> None:
    check = _load("gpu_wheels_check")
    _wheel(
        tmp_path,
        "alpha",
        "1.0",
        "beta>=2",  # the wheel is 1.0: too old
        "gamma",  # neither a wheel nor on the GPU machine
        "delta; sys_platform == 'win32'",  # not for Linux: not needed
        "epsilon; extra == 'docs'",  # an extra: not needed
        "torch>=2.11",  # the GPU machine's own
    )
    _wheel(tmp_path, "beta", "1.0")
    _wheel(tmp_path, "zeta", "3.0")  # not pinned
    pinned = {"alpha": ("alpha", "1.0"), "beta": ("beta", "1.0"), "eta": ("eta", "1.0")}
    problems, notes = check.check_wheels(tmp_path, pinned)
    assert sorted(problems) == sorted(
        [
            "alpha needs beta>=2; the wheel is 1.0",
            "alpha needs gamma: neither a wheel nor on the GPU machine",
            "zeta-3.0-py3-none-any.whl: not pinned in gpu_wheels.sh",
            f"eta==1.0: no wheel in {tmp_path}",
        ]
    )
    assert any("torch>=2.11" in n for n in notes), notes


@pytest.mark.unit
def test_the_scripts_parse() -> None:
    for script in ("gpu_check.sh", "gpu_wheels.sh"):
        r = subprocess.run(["bash", "-n", str(SCRIPTS / script)], capture_output=True, text=True)
        assert r.returncode == 0, r.stderr
    r = subprocess.run(
        ["bash", str(SCRIPTS / "gpu_check.sh"), "--help"], capture_output=True, text=True
    )
    assert r.returncode == 0 and "GPU_CHECK_QUICK" in r.stdout, r.stdout + r.stderr


def _statuses(summary: str) -> dict[str, str]:
    """step -> status, from the summary's table of steps."""
    rows: dict[str, str] = {}
    table = summary.split("| step | issue item |", 1)[1].split("\n\n", 1)[0]
    for line in table.splitlines()[2:]:
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = cells[3]
    return rows


@pytest.mark.e2e
@pytest.mark.timeout(480)  # about 45 s alone here; a loaded machine (the suite's own) takes more
def test_the_check_rehearses_every_step_on_the_cpu(tmp_path: Path) -> None:
    """The whole check in its quick mode, as the GPU machine runs it but where torch sees no
    CUDA device: the GPU benchmarks run their CPU stand-ins, the cuda tests skip, and the summary
    lists every step without calling any of those a pass."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("on a CUDA device this would be the real check (minutes): run it by hand")
    check = _load("gpu_check")
    out = tmp_path / "out"
    scratch = tempfile.mkdtemp(prefix="gc-")  # the benchmarks' temporary files; short paths
    env = {**os.environ, "PYTHON": sys.executable, "TMPDIR": scratch}
    env.pop("OUT", None)
    env.pop("GPU_CHECK_ONLY", None)
    try:
        r = subprocess.run(
            ["bash", str(SCRIPTS / "gpu_check.sh"), "--quick", str(out)],
            cwd=ROOT,
            env=env,
            capture_output=True,
            text=True,
            timeout=420,
        )
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    summary = (out / "summary.md").read_text()
    assert r.returncode == 0, f"{summary}\n{r.stdout[-4000:]}\n{r.stderr[-2000:]}"
    statuses = _statuses(summary)
    assert list(statuses) == list(check.STEPS), statuses
    for name, status in statuses.items():
        if name in ("nccl-timeout", "cuda-tests"):
            assert status == "SKIPPED (needs CUDA)", (name, summary)
        elif name in check.NEEDS_CUDA:
            assert status == "STAND-IN OK", (name, summary)
        else:
            assert status == "PASS", (name, summary)
    assert "CPU rehearsal: torch sees no CUDA device" in summary
    assert "these steps need CUDA and were not checked here: oom-hang, nccl-timeout" in summary
    # Each stand-in's table is in the summary, and every log in the archive.
    assert "rank 1 catches the OOM, skips backward()" in summary
    assert "| P2 failure detection" in summary and "| P6 training throughput" in summary
    assert "| P1 warm launch" in summary
    assert "test_nccls_own_collective_timeout_in_each_async_error_handling_mode[0] | skipped" in (
        summary
    )
    with tarfile.open(out / "logs.tar.gz") as tar:
        names = set(tar.getnames())
    assert {f"logs/{s}.log" for s in check.STEPS} <= names, names
    # What the device tool brings back: at most 8 files, no folder.
    assert all(p.is_file() for p in out.iterdir()) and len(list(out.iterdir())) <= 8


def _junit(path: Path, **outcomes: str) -> None:
    cases = []
    for name, outcome in outcomes.items():
        inner = {
            "passed": "",
            "failed": '<failure message="boom"/>',
            "skipped": '<skipped message="why"/>',
        }
        cases.append(
            f'<testcase classname="tests.test_cuda" name="{name}" time="1.5">{inner[outcome]}</testcase>'
        )
    path.write_text(f"<testsuites><testsuite>{''.join(cases)}</testsuite></testsuites>")


@pytest.mark.unit
def test_on_a_gpu_only_a_whole_pass_is_a_pass(tmp_path: Path) -> None:
    """The summary's statuses where torch sees a CUDA device: a step passes only when all of it
    ran and passed; skipped tests, a time limit, the budget spent each say so."""
    check = _load("gpu_check")
    work, out = tmp_path / "work", tmp_path / "out"
    (work / "logs").mkdir(parents=True)
    out.mkdir()
    (work / "machine.json").write_text('{"cuda_devices": 1, "line": "an H100"}')
    _junit(work / "logs" / "nccl-timeout.xml", a="passed", b="skipped")
    _junit(work / "logs" / "cuda-tests.xml", a="passed", b="failed")
    rows = [
        ("machine", "plain", "0"),
        ("env", "plain", "0"),
        ("oom-hang", "gpu", "0"),
        ("nccl-timeout", "pytest", "0"),
        ("cuda-tests", "pytest", "1"),
        ("p2-failure", "bench", "0"),
        ("p6-throughput", "bench", "124"),
        ("p1-launch", "bench", "notrun"),
    ]
    (work / "steps.tsv").write_text(
        "".join(f"{n}\t{k}\t{rc}\t1.0\t90\t0\t\tout of time\n" for n, k, rc in rows)
    )
    assert check.report(work, out) == 1
    summary = (out / "summary.md").read_text()
    assert _statuses(summary) == {
        "machine": "PASS",
        "env": "PASS",
        "oom-hang": "PASS",
        "nccl-timeout": "PARTIAL",
        "cuda-tests": "FAIL",
        "p2-failure": "DONE",
        "p6-throughput": "TIMEOUT",
        "p1-launch": "NOT RUN",
    }
    assert "Machine: an H100" in summary and "Mode: CUDA" in summary
    assert "did not pass: nccl-timeout, cuda-tests, p6-throughput, p1-launch" in summary
    assert "| test_cuda::b | failed | 1.5 | boom |" in summary


@pytest.mark.unit
def test_the_benchmarks_cuda_bodies_compile() -> None:
    """Their cuda side runs only on a GPU: here at least each body compiles, and the flags the
    check passes are there."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        import failure
        import launch
        import throughput
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    for body in (launch.CUDA_BODY, failure.CUDA_BODY, throughput.body("cuda", 10)):
        compile(body, "cell", "exec")
        assert "dist.init_process_group('nccl', device_id=device)" in body
    for script, flags in (
        ("launch.py", ("--device", "--warm-only")),
        ("failure.py", ("--device",)),
        ("throughput.py", ("--device", "--steps")),
        ("gpu_oom_hang.py", ("--device", "--runs")),
    ):
        r = subprocess.run(
            [sys.executable, str(ROOT / "benchmarks" / script), "--help"],
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0 and all(f in r.stdout for f in flags), (script, r.stdout, r.stderr)
