"""Checkpoints as the notebook shows them: a job whose rank fails after a save restarts and
resumes from it, saying what the failure cost; a failure with no restart left names the last
checkpoint; a session's replay restores the latest checkpoint (its journal's cell that loads it),
and `%elastic session` shows it. Real kernels, real ranks (gloo), the real elastic_nb.checkpoint
(tests/test_checkpoint.py covers the library itself)."""

from __future__ import annotations

import json
import os
import re
import signal
from pathlib import Path

import psutil
import pytest

from tests.kernel import Kernel, assert_job_gone, run_dir, run_summary, wait_for

pytestmark = pytest.mark.e2e

TRAIN = """%%elastic --nproc 2 --max-restarts {restarts} --env ELASTIC_NB_CHECKPOINT_DIR={ckpt}
import os, torch, torch.distributed as dist
from elastic_nb import checkpoint
dist.init_process_group()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
start = checkpoint.load(model, opt)
print("first step", 0 if start is None else start + 1, flush=True)
attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
for step in range(0 if start is None else start + 1, 10):
    opt.zero_grad()
    model(torch.ones(8, 4)).sum().backward()
    opt.step()
    if step == {save_at}:
        checkpoint.save(step, model, opt)
    if attempt == 0 and step == {fail_at} and dist.get_rank() == 1:
        raise RuntimeError("rank 1 broke at step {fail_at}")
    dist.barrier()
"""


def _records(cache_home: Path, job: str) -> list[dict]:
    path = run_dir(cache_home, job) / "checkpoints.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_a_rank_fails_after_a_save_the_next_attempt_resumes_there(
    kernel: Kernel, cache_home: Path, tmp_path: Path
) -> None:
    """--max-restarts 1, a save at step 5, rank 1 fails at step 7: attempt 1 starts at step 6,
    not 0; the restart says what the failure cost, the resume that it was redone; the summary
    keeps the last checkpoint."""
    ex = kernel.ok(TRAIN.format(restarts=1, ckpt=tmp_path / "ckpt", save_at=5, fail_at=7))
    out = ex.stdout + ex.stderr
    assert "[rank 0] first step 0" in out and "[rank 0] first step 6" in out, out
    assert re.search(r"\[elastic_nb\] checkpoint saved: step 5 \([\d.]+ KiB, written in", out), out
    restart = re.search(
        r"attempt 0 failed: rank 1 RuntimeError: rank 1 broke at step 7 \(cell line 18\); "
        r"restarting as attempt 1 \(restart 1/1\); the last checkpoint is step 5, saved "
        r"([\d.]+) s before rank 1 failed \(about \1 s of work to redo\)",
        out,
    )
    assert restart, out
    resumed = re.search(
        r"resumed from step 5, saved ([\d.]+) s before rank 1 failed: about \1 s of work "
        r"redone \(loaded in [\d.]+ s\)",
        out,
    )
    assert resumed, out
    # Text mode's timeline at the end: each attempt's span on the job's clock, the first's end
    # told as it happened (the restart line above), not a second time.
    timeline = re.search(
        r"\[elastic_nb\] timeline:\n"
        r"\[elastic_nb\]   attempt 0 · 0\.0 s to ([\d.]+) s \([^)]+\) · ended: restarted \(said above\)\n"
        r"\[elastic_nb\]   attempt 1 · ([\d.]+) s to ([\d.]+) s \([^)]+\)\n",
        ex.stdout,
    )
    assert timeline and timeline[1] == timeline[2], ex.stdout
    assert float(timeline[2]) < float(timeline[3]), ex.stdout
    records = _records(cache_home, ex.job_id)
    assert [(r["event"], r["step"]) for r in records] == [
        ("loaded", None),
        ("saved", 5),
        ("loaded", 5),
    ]
    summary = run_summary(cache_home, ex.job_id)
    assert summary["outcome"] == "succeeded" and summary["restarts"] == 1
    assert summary["checkpoint"]["step"] == 5
    assert summary["checkpoint"]["words"].startswith("the last checkpoint is step 5 (")
    assert_job_gone(ex.job_id)


def test_a_failure_with_no_restart_left_names_the_last_checkpoint(
    kernel: Kernel, tmp_path: Path
) -> None:
    ex = kernel.run(TRAIN.format(restarts=0, ckpt=tmp_path / "ckpt", save_at=3, fail_at=6))
    assert ex.ename == "JobFailed"
    report = ex.error["evalue"] + "\n" + ex.traceback
    m = re.search(
        r"checkpoint: the last checkpoint is step 3, saved ([\d.]+) s before rank 1 failed "
        r"\(about \1 s of work to redo\) \((\S+)\)",
        report,
    )
    assert m, report
    assert Path(m[2]).parent == tmp_path / "ckpt" and (Path(m[2]) / "COMMITTED").exists()
    assert_job_gone(ex.job_id)


IN_FLIGHT = """%%elastic --nproc 2 --max-restarts 1 --env ELASTIC_NB_CHECKPOINT_DIR={ckpt}
import os, signal, torch, torch.distributed as dist
from multiprocessing import util
from elastic_nb import checkpoint
dist.init_process_group()
torch.manual_seed(0)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ckpt = checkpoint.Checkpoints()
start = ckpt.load(model, opt)
print("first step", 0 if start is None else start + 1, flush=True)
if os.environ["TORCHELASTIC_RESTART_COUNT"] == "0":
    for step in range(6):
        opt.zero_grad()
        model(torch.ones(8, 4)).sum().backward()
        opt.step()
        if step == 2:
            ckpt.save(step, model, opt, async_save=True)
            ckpt.wait()
    if dist.get_rank() == 1:
        # rank 1's writer waits for rank 1 to exit: step 5 is in flight when rank 1 fails
        os.kill(ckpt.writer_pid, signal.SIGSTOP)
        util.Finalize(None, os.kill, args=(ckpt.writer_pid, signal.SIGCONT), exitpriority=100)
    ckpt.save(5, model, opt, async_save=True)
    if dist.get_rank() == 1:
        raise RuntimeError("rank 1 broke with step 5 in flight")
    ckpt.wait()
    dist.barrier()
"""


def test_a_save_in_flight_when_a_rank_fails_is_the_one_resumed(
    kernel: Kernel, cache_home: Path, tmp_path: Path
) -> None:
    """Rank 1 raises while its async save of step 5 is being written: it finishes the save as
    it exits, so step 5 is committed after the failure. The restart names step 5 (the step the
    next attempt resumes from), not step 2 or none."""
    ex = kernel.ok(IN_FLIGHT.format(ckpt=tmp_path / "ckpt"), timeout=180)
    out = ex.stdout + ex.stderr
    assert "[rank 0] first step 0" in out and "[rank 0] first step 6" in out, out
    restart = re.search(
        r"attempt 0 failed: rank 1 RuntimeError: rank 1 broke with step 5 in flight \(cell line "
        r"\d+\); restarting as attempt 1 \(restart 1/1\); the last checkpoint is step 5, in "
        r"flight when rank 1 failed and committed as it exited \(about [\d.]+ s of work to "
        r"redo\)",
        out,
    )
    assert restart, out
    assert re.search(r"resumed from step 5, saved [\d.]+ s earlier \(loaded in [\d.]+ s\)", out)
    records = _records(cache_home, ex.job_id)
    assert [(r["event"], r["step"]) for r in records] == [
        ("loaded", None),
        ("saved", 2),
        ("saved", 5),
        ("loaded", 5),
    ]
    assert_job_gone(ex.job_id)


PER_RANK_DISK = """%%elastic --nproc {nproc}
import os, torch, torch.distributed as dist
from elastic_nb import checkpoint
dist.init_process_group()
rank = dist.get_rank()
torch.manual_seed(rank)
model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.1)
# a disk of its own for each rank, as ranks on nodes that share no storage
directory = os.path.join({base!r}, {disks}[rank])
start = checkpoint.load(model, opt, directory=directory)
if start is None:
    opt.zero_grad()
    model(torch.ones(8, 4)).sum().backward()
    opt.step()
    checkpoint.save(5, model, opt, async_save=True, directory=directory)
    checkpoint.wait()
print("step", start, "weight", round(model.module.weight.sum().item(), 6), flush=True)
"""


def test_a_job_of_another_size_resumes_from_the_rank_that_has_the_step(
    kernel: Kernel, cache_home: Path, tmp_path: Path
) -> None:
    """2 ranks save step 5 (async), each on a disk of its own; 3 ranks of a later job resume,
    and only rank 2 finds a copy on its disk: every rank gets its weights, and the resume says
    where they came from and that the world changed."""
    first = kernel.ok(PER_RANK_DISK.format(nproc=2, base=str(tmp_path), disks=["a", "b"]))
    (weight,) = set(re.findall(r"\[rank \d\] step None weight (\S+)", first.stdout))
    second = kernel.ok(PER_RANK_DISK.format(nproc=3, base=str(tmp_path), disks=["c", "d", "b"]))
    out = second.stdout + second.stderr
    for rank in range(3):
        assert f"[rank {rank}] step 5 weight {weight}" in second.stdout, out
    assert re.search(
        r"resumed from step 5, saved [\d.]+ s earlier \(loaded in [\d.]+ s, from rank 2's "
        r"copy; saved by 2 ranks, loaded by 3\)",
        out,
    ), out
    loaded = _records(cache_home, second.job_id)
    assert [(r["event"], r["step"], r["from"]) for r in loaded] == [("loaded", 5, "rank 2")]
    # the writer processes of the first job's async save ended with its ranks
    for ex in (first, second):
        assert "left running" not in ex.stdout + ex.stderr
        assert_job_gone(ex.job_id)


SESSION_CELLS = (
    "import torch, torch.distributed as dist\n"
    "from elastic_nb import checkpoint\n"
    "dist.init_process_group()\n"
    "torch.manual_seed(0)\n"
    "model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))\n"
    "opt = torch.optim.SGD(model.parameters(), lr=0.1)\n",
    "step = checkpoint.load(model, opt)\nprint('loaded', step, flush=True)\n",
)
TRAIN_IN_SESSION = """%%elastic --no-replay
for step in range(0 if step is None else step + 1, 5):
    opt.zero_grad()
    model(torch.ones(8, 4)).sum().backward()
    opt.step()
    checkpoint.save(step, model, opt)
weight = model.module.weight.sum().item()
weight
"""


def test_a_sessions_replay_restores_the_latest_checkpoint(
    fresh_kernel: Kernel, tmp_path: Path
) -> None:
    """A session: the model (replayed), the load (replayed), training that saves each step
    (--no-replay). Rank 1 SIGKILLed: the session restarts, replays the model and the load, and
    the state is the last save's, not the first cell's; %elastic session names that step."""
    k = fresh_kernel
    k.ok(f"%elastic up --nproc 2 --env ELASTIC_NB_CHECKPOINT_DIR={tmp_path / 'ckpt'}", timeout=180)
    try:
        for cell in SESSION_CELLS:
            k.ok(f"%%elastic\n{cell}")
        trained = k.ok(TRAIN_IN_SESSION).result
        assert trained is not None
        shown = k.ok("%elastic session").stdout
        assert re.search(r"latest checkpoint: step 4 \(.*\), saved [\d.]+ s ago, in ", shown), shown
        out = k.ok("%%elastic --no-replay\nimport os\nprint('pid', os.getpid())\n").stdout
        (pid,) = [int(p) for p in re.findall(r"\[rank 1\] pid (\d+)", out)]
        os.kill(pid, signal.SIGKILL)
        assert wait_for(lambda: not psutil.pid_exists(pid), timeout=10)
        ex = k.ok("%%elastic\nstep, model.module.weight.sum().item()\n", timeout=180)
        assert ex.result == f"(4, {trained})", (ex.result, ex.stdout)
        assert "the last checkpoint is step 4" in ex.stdout + ex.stderr
        assert re.search(
            r"resumed from step 4, saved ([\d.]+) s before rank 1 failed: about \1 s of work "
            r"redone \(loaded in [\d.]+ s\)",
            ex.stdout + ex.stderr,
        ), ex.stdout + ex.stderr
        assert "replayed 2 cells" in ex.stdout
        assert "[rank 0] loaded 4" in ex.stdout and "[rank 1] loaded 4" in ex.stdout
    finally:
        k.ok("%elastic down")
