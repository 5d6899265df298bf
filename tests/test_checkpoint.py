"""elastic_nb.checkpoint in real ranks: elastic_launch (c10d rendezvous, gloo, CPU) runs a script
each test writes, in phases of 4, 3 or 2 ranks, and the ranks leave what they saw in JSON files the
test reads. No part of torch is mocked. Where a test needs a rank stopped in the middle of a save,
the script wraps one of DCP's own writing functions so that the rank says where it is and then
waits (to be SIGKILLed there, or until the training thread opens a gate): nothing depends on
timing."""

from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastic_nb import checkpoint
from tests.kernel import pid_ended, wait_for

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parent.parent

# What every script starts with: a process group, and emit() to leave a value for the test.
PRELUDE = """
import json, os, random, sys, threading, time
import numpy as np
import torch, torch.distributed as dist, torch.nn as nn
from elastic_nb import checkpoint

dist.init_process_group("gloo")
RANK, WORLD = dist.get_rank(), dist.get_world_size()
OUT = os.environ["OUT"]

def emit(name, value):
    with open(os.path.join(OUT, f"{name}-{RANK}.json"), "w") as f:
        json.dump(value, f)

def flat(model):
    # every parameter as a list: whole (FSDP's shards gathered), under names without DDP's prefix
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict
    sd = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True))
    return {k: v.reshape(-1).tolist() for k, v in sd.items()}

def listing(directory):
    # every entry of a checkpoint directory, with the files inside step directories
    out = {}
    for name in sorted(os.listdir(directory)) if os.path.isdir(directory) else []:
        path = os.path.join(directory, name)
        out[name] = sorted(os.listdir(path)) if os.path.isdir(path) else None
    return out
"""

# The launcher the tests share: for each request on stdin (a script and its phases), it runs
# elastic_launch for each phase in turn, every rank forked from a fork server that imported torch
# once (4 fresh interpreters importing torch cost about 6 s on 2 cores; a phase costs a fraction
# of a second this way), and answers with one line.
LAUNCHER = """
import json, multiprocessing, multiprocessing.forkserver, os, sys, traceback

def rank_main(script, env):
    os.environ.update(env)
    with open(script) as f:
        code = compile(f.read(), script, "exec")
    exec(code, {"__name__": "__rank__"})

if __name__ == "__main__":
    multiprocessing.set_forkserver_preload(
        ["torch", "torch.distributed.checkpoint", "torch.distributed.fsdp", "numpy",
         "elastic_nb.checkpoint"]
    )
    # The fork server imports torch while this process does (two cores, half the wait).
    multiprocessing.forkserver.ensure_running()
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    for n, line in enumerate(sys.stdin):
        request = json.loads(line)
        error = None
        try:
            for i, phase in enumerate(request["phases"]):
                config = LaunchConfig(
                    min_nodes=1, max_nodes=1, nproc_per_node=phase["nproc"],
                    run_id=f"request{n}-phase{i}", rdzv_backend="c10d",
                    rdzv_endpoint="localhost:0", max_restarts=phase.get("restarts", 0),
                    monitor_interval=0.1, start_method="forkserver",
                )
                env = {**request["env"], "PHASE": str(i), **phase.get("env", {})}
                elastic_launch(config, rank_main)(request["script"], env)
        except Exception:
            error = traceback.format_exc()
        print("@@done " + json.dumps(error), flush=True)
"""


class Launcher:
    """The shared launcher process; its output (and the ranks') is read by a thread."""

    def __init__(self, directory: Path) -> None:
        path = directory / "launch.py"
        path.write_text(LAUNCHER)
        env = {
            **os.environ,
            "PYTHONPATH": f"{ROOT}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
            "OMP_NUM_THREADS": "1",
            # A restarted attempt can read the previous attempt's keys from a shared agent store
            # and hang in init_process_group (TORCH_FACTS.md, the class of pytorch#135712).
            "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1",
        }
        self.proc = subprocess.Popen(
            [sys.executable, str(path)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            start_new_session=True,  # so that killpg ends it, its fork server and any rank
        )
        self.lines: queue.Queue[str | None] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put(None)

    def start(self, tmp_path: Path, body: str, phases: list[dict[str, Any]]) -> Run:
        """Run PRELUDE + body in the phases ({"nproc": N, "env": {...}, "restarts": K})."""
        script = tmp_path / "script.py"
        script.write_text(PRELUDE + body)
        for name in ("out", "run"):
            (tmp_path / name).mkdir(exist_ok=True)
        env = {"OUT": str(tmp_path / "out"), "ELASTIC_NB_RUN_DIR": str(tmp_path / "run")}
        request = {"script": str(script), "env": env, "phases": phases}
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        return Run(self)

    def close(self) -> None:
        with_input = self.proc.stdin
        if with_input is not None and not with_input.closed:
            with_input.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


class Run:
    """One request in flight on the launcher."""

    def __init__(self, launcher: Launcher) -> None:
        self.launcher = launcher
        self.output: list[str] = []
        self.done = False

    def _take(self, deadline: float) -> None:
        try:
            line = self.launcher.lines.get(timeout=max(0.0, deadline - time.monotonic()))
        except queue.Empty:
            return
        if line is None:
            pytest.fail("the launcher exited:\n" + "".join(self.output)[-6000:])
        if line.startswith("@@done "):
            self.done = True
            error = json.loads(line[len("@@done ") :])
            assert error is None, "".join(self.output)[-6000:] + error
        else:
            self.output.append(line)

    def wait(self, timeout: float = 60) -> str:
        deadline = time.monotonic() + timeout
        while not self.done and time.monotonic() < deadline:
            self._take(deadline)
        if not self.done:
            os.killpg(self.launcher.proc.pid, signal.SIGKILL)  # the fixture starts another
            pytest.fail(f"ran past {timeout} s:\n" + "".join(self.output)[-6000:])
        return "".join(self.output)

    def wait_file(self, path: Path, timeout: float = 60) -> str:
        """The line a rank wrote to `path` (it then waits where it is to be killed)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if path.exists() and path.read_text().endswith("\n"):
                return path.read_text()
            if self.done:
                pytest.fail(f"the run ended before {path.name}:\n" + "".join(self.output)[-6000:])
            self._take(min(deadline, time.monotonic() + 0.02))
        os.killpg(self.launcher.proc.pid, signal.SIGKILL)
        pytest.fail(f"no {path.name} after {timeout} s:\n" + "".join(self.output)[-6000:])


_LAUNCHER: list[Launcher] = []


@pytest.fixture(scope="module")
def launchers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[Launcher]]:
    yield _LAUNCHER
    for launcher in _LAUNCHER:
        launcher.close()


@pytest.fixture
def launcher(launchers: list[Launcher], tmp_path_factory: pytest.TempPathFactory) -> Launcher:
    """The module's launcher, started at first use (again if a test had to kill it)."""
    if not launchers or launchers[-1].proc.poll() is not None:
        launchers.append(Launcher(tmp_path_factory.mktemp("launcher")))
    return launchers[-1]


def emitted(tmp_path: Path, name: str, nproc: int) -> list[Any]:
    return [json.loads((tmp_path / "out" / f"{name}-{r}.json").read_text()) for r in range(nproc)]


def records(tmp_path: Path) -> list[dict[str, Any]]:
    path = tmp_path / "run" / checkpoint.RECORD_FILE
    return [json.loads(line) for line in path.read_text().splitlines()]


ROUND_TRIP = """
def build(seed):
    torch.manual_seed(seed)
    model = nn.parallel.DistributedDataParallel(nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2)))
    return model, torch.optim.Adam(model.parameters(), lr=0.01)

def draws():
    return [torch.rand(3).tolist(), random.random(), np.random.rand(2).tolist()]

def optim_state(opt):
    return {str(k): {n: t.reshape(-1).tolist() for n, t in s.items()} for k, s in opt.state_dict()["state"].items()}

DIRECTORY = os.environ["CKPT"]
model, opt = build(0)
torch.manual_seed(100 + RANK); random.seed(200 + RANK); np.random.seed(300 + RANK)
for _ in range(3):
    loss = model(torch.randn(4, 6)).square().mean()
    opt.zero_grad(); loss.backward(); opt.step()
extra = {"epoch": 2, "sampler": {"index": 96, "seed": 7}}
checkpoint.save(3, model, opt, extra=extra, directory=DIRECTORY)
rng = (torch.get_rng_state(), random.getstate(), np.random.get_state())
emit("saved", {"params": flat(model), "optim": optim_state(opt), "draws": draws()})

# Another model and optimizer, other RNG states: a load must bring back all of the above.
model, opt = build(1)
torch.manual_seed(0); random.seed(0); np.random.seed(0)
got = {"epoch": 0}
step = checkpoint.load(model, opt, extra=got, directory=DIRECTORY)
emit("loaded", {"step": step, "extra": got, "params": flat(model), "optim": optim_state(opt), "draws": draws()})

# The same through an fsspec URL (file://), which DCP writes with its FsspecWriter.
url = "file://" + os.environ["CKPT_URL_DIR"]
torch.set_rng_state(rng[0]); random.setstate(rng[1]); np.random.set_state(rng[2])
checkpoint.save(3, model, opt, extra=extra, directory=url)
model, opt = build(2)
step = checkpoint.load(model, opt, directory=url)
emit("url", {"step": step, "params": flat(model), "draws": draws()})

# keep=2 keeps the two newest steps; a step before the newest is refused (it would never load).
for step in (4, 5, 6):
    checkpoint.save(step, model, opt, keep=2, directory=DIRECTORY)
try:
    checkpoint.save(5, model, opt, directory=DIRECTORY)
    refused = None
except ValueError as e:
    refused = str(e)
emit("kept", {"steps": checkpoint.Checkpoints(DIRECTORY).steps(), "listing": listing(DIRECTORY), "refused": refused})

# fsync=True (every file on disk before the step counts), saved and async: each loads the same.
FSYNC = os.environ["CKPT_FSYNC"]
for step, how in ((7, False), (8, True)):
    checkpoint.save(step, model, opt, fsync=True, async_save=how, directory=FSYNC)
    checkpoint.wait(FSYNC)
    model, opt = build(step)
    got = checkpoint.load(model, opt, directory=FSYNC)
    emit(f"fsync{step}", {"step": got, "params": flat(model), "optim": optim_state(opt)})
"""


def test_round_trip_brings_back_model_optimizer_step_rng_and_extras(
    launcher: Launcher, tmp_path: Path
) -> None:
    ckpt, url_dir = tmp_path / "ckpt", tmp_path / "url"
    env = {"CKPT": str(ckpt), "CKPT_URL_DIR": str(url_dir), "CKPT_FSYNC": str(tmp_path / "fsync")}
    launcher.start(tmp_path, ROUND_TRIP, [{"nproc": 2, "env": env}]).wait()
    saved, loaded, url = (emitted(tmp_path, n, 2) for n in ("saved", "loaded", "url"))
    for rank in range(2):
        assert loaded[rank]["step"] == 3
        assert loaded[rank]["extra"] == {"epoch": 2, "sampler": {"index": 96, "seed": 7}}
        assert loaded[rank]["params"] == saved[rank]["params"]
        assert loaded[rank]["optim"] == saved[rank]["optim"]
        assert loaded[rank]["draws"] == saved[rank]["draws"], f"rank {rank}'s RNG states"
        assert url[rank]["step"] == 3
        assert url[rank]["params"] == saved[rank]["params"]
        assert url[rank]["draws"] == saved[rank]["draws"]
    # each rank got its own RNG states back, not rank 0's
    assert loaded[0]["draws"] != loaded[1]["draws"]
    assert saved[0]["optim"], "Adam's state was saved"
    for step in (7, 8):
        for rank, seen in enumerate(emitted(tmp_path, f"fsync{step}", 2)):
            assert seen["step"] == step, (step, rank)
            assert seen["params"] == saved[rank]["params"], (step, rank)
            assert seen["optim"] == saved[rank]["optim"], (step, rank)
    kept = emitted(tmp_path, "kept", 2)
    for rank in range(2):
        assert kept[rank]["steps"] == [5, 6]
        assert [n.split("-")[1] for n in kept[rank]["listing"]] == ["000000000005", "000000000006"]
        assert "step 5 is before the newest step" in kept[rank]["refused"]
    step_dir = Path(records(tmp_path)[0]["path"])
    assert step_dir.parent == ckpt and step_dir.name.startswith("step-000000000003-")
    (url_step,) = url_dir.iterdir()
    assert url_step.name.startswith("step-000000000003-") and (url_step / "COMMITTED").exists()

    saved_line, loaded_line = records(tmp_path)[:2]
    assert saved_line["event"] == "saved" and saved_line["step"] == 3
    assert saved_line["path"] == str(step_dir) and saved_line["bytes"] > 0
    assert saved_line["async"] is False and saved_line["overlapped_s"] is None
    assert saved_line["world_size"] == 2 and saved_line["shared"] is True
    assert loaded_line["event"] == "loaded" and loaded_line["step"] == 3
    assert loaded_line["path"] == str(step_dir) and loaded_line["from"] == "shared"
    assert loaded_line["saved_time"] == saved_line["time"]
    assert loaded_line["time"] >= saved_line["time"] and loaded_line["seconds"] > 0


def test_default_directory_is_one_per_notebook(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(checkpoint.DIRECTORY_ENV, raising=False)
    monkeypatch.delenv("JPY_SESSION_NAME", raising=False)
    assert checkpoint.default_directory() == str(tmp_path / ".elastic_nb_checkpoints" / "default")
    # Jupyter's path is relative to its root, and the kernel runs in the notebook's directory
    monkeypatch.setenv("JPY_SESSION_NAME", "experiments/train.ipynb")
    assert checkpoint.default_directory() == str(tmp_path / ".elastic_nb_checkpoints" / "train")
    monkeypatch.setenv("JPY_SESSION_NAME", "/data/nbs/eval.ipynb")
    assert checkpoint.default_directory() == "/data/nbs/.elastic_nb_checkpoints/eval"
    monkeypatch.setenv(checkpoint.DIRECTORY_ENV, "/scratch/ckpt")
    assert checkpoint.default_directory() == "/scratch/ckpt"


KILLED = """
import torch.distributed.checkpoint.filesystem as dcp_files

ATTEMPT = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
DIRECTORY = os.environ["CKPT"]

def stop_here(where):
    # Say so (with this rank's pid), then wait to be SIGKILLed by the test.
    with open(os.path.join(OUT, f"{where}.pid"), "w") as f:
        f.write(f"{os.getpid()}\\n")
    threading.Event().wait()

torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Sequential(*[nn.Linear(16, 16) for _ in range(4)]))
opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
ckpt = checkpoint.Checkpoints(DIRECTORY)

def train(n):
    for _ in range(n):
        loss = model(torch.randn(4, 16)).square().mean()
        opt.zero_grad(); loss.backward(); opt.step()

if ATTEMPT == 0:
    train(2)
    ckpt.save(1, model, opt)
    emit("step1", flat(model))
    train(2)
    if RANK == 0:
        # Rank 0 dies once DCP's .metadata is written (a checkpoint DCP alone would load) but
        # before the step is committed.
        finish = dcp_files._FileSystemWriter.finish
        def finish_then_stop(self, *args, **kwargs):
            finish(self, *args, **kwargs)
            stop_here("after-metadata")
        dcp_files._FileSystemWriter.finish = finish_then_stop
    ckpt.save(2, model, opt)
else:
    before = listing(DIRECTORY)
    step = ckpt.load(model, opt)
    emit(f"attempt{ATTEMPT}", {"before": before, "step": step, "params": flat(model), "after": listing(DIRECTORY)})
    if ATTEMPT == 1:
        train(2)
        if RANK == 1:
            # Rank 1 dies in the middle of its data file: one item written, the rest not.
            write_item = dcp_files._write_item
            def write_then_stop(transforms, stream, *args, **kwargs):
                result = write_item(transforms, stream, *args, **kwargs)
                stream.flush()
                stop_here("mid-write")
            dcp_files._write_item = write_then_stop
        ckpt.save(2, model, opt)
"""


def test_a_rank_killed_mid_save_leaves_the_previous_step_loadable(
    launcher: Launcher, tmp_path: Path
) -> None:
    phases = [{"nproc": 2, "env": {"CKPT": str(tmp_path / "ckpt")}, "restarts": 2}]
    run = launcher.start(tmp_path, KILLED, phases)
    out = tmp_path / "out"
    os.kill(int(run.wait_file(out / "after-metadata.pid")), signal.SIGKILL)
    os.kill(int(run.wait_file(out / "mid-write.pid")), signal.SIGKILL)
    run.wait()
    step1 = emitted(tmp_path, "step1", 2)
    for attempt in (1, 2):
        seen = emitted(tmp_path, f"attempt{attempt}", 2)
        for rank in range(2):
            assert seen[rank]["step"] == 1, (attempt, rank)
            assert seen[rank]["params"] == step1[rank], (attempt, rank)
            after = seen[rank]["after"]
            assert [n for n in after if n.startswith("step-")] == [
                n for n in after if n.startswith("step-000000000001-")
            ], f"the half-written step 2 is left behind (attempt {attempt}): {after}"
    # and when the run is over, nothing of either step 2 is left, nor anything being removed
    (step1,) = [n for n in emitted(tmp_path, "attempt2", 2)[0]["after"] if n.startswith("step-")]
    assert os.listdir(tmp_path / "ckpt") == [step1]
    # The step-2 directory rank 0's death left had everything DCP needs to load it, but no
    # COMMITTED: only the marker kept it from being loaded.
    before = emitted(tmp_path, "attempt1", 2)[0]["before"]
    (partial,) = [n for n in before if n.startswith("step-000000000002-")]
    assert ".metadata" in before[partial] and "COMMITTED" not in before[partial], before
    loads = [r for r in records(tmp_path) if r["event"] == "loaded"]
    assert [r["step"] for r in loads] == [1, 1]
    assert all(r["event"] == "loaded" or r["step"] == 1 for r in records(tmp_path))


RESHARD = """
from torch.distributed.fsdp import fully_shard

SAVE_AT, LAST = int(os.environ["SAVE_AT"]), int(os.environ["LAST"])
BATCH = 12  # the same global batch on 4, 2 and 3 ranks: the losses do not depend on the world size

def batch(step):
    g = torch.Generator().manual_seed(1000 + step)
    x = torch.randn(BATCH, 8, generator=g)
    y = torch.sin(x.sum(1, keepdim=True))
    n = BATCH // WORLD
    return x[RANK * n:(RANK + 1) * n], y[RANK * n:(RANK + 1) * n]

def build(kind):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 32), nn.Tanh(), nn.Linear(32, 32), nn.Tanh(), nn.Linear(32, 1))
    if kind == "ddp":
        model = nn.parallel.DistributedDataParallel(model)
    else:
        for layer in (model[0], model[2], model[4]):
            fully_shard(layer)
        fully_shard(model)
    return model, torch.optim.Adam(model.parameters(), lr=0.02)

for kind in ("ddp", "fsdp"):
    model, opt = build(kind)
    ckpt = checkpoint.Checkpoints(os.path.join(os.environ["CKPT"], kind))
    start = ckpt.load(model, opt)
    losses = {}
    for step in range(0 if start is None else start + 1, LAST + 1):
        x, y = batch(step)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad(); loss.backward(); opt.step()
        total = loss.detach().clone()
        dist.all_reduce(total)
        losses[step] = total.item() / WORLD
        if step == SAVE_AT:
            ckpt.save(step, model, opt)
    emit(kind + os.environ["PHASE"], {"start": start, "losses": losses})
"""


def test_ddp_and_fsdp2_resume_after_the_world_shrinks_and_grows(
    launcher: Launcher, tmp_path: Path
) -> None:
    env = {"CKPT": str(tmp_path / "ckpt")}
    # 4 ranks save at step 5 and go on to step 7; 2 ranks resume at 6, save at 9 and go on to
    # 11; 3 ranks resume at 10. Each resumed step's loss is the one the earlier world computed.
    phases = [(4, 5, 7), (2, 9, 11), (3, -1, 12)]
    plan = [
        {"nproc": n, "env": {**env, "SAVE_AT": str(at), "LAST": str(last)}}
        for n, at, last in phases
    ]
    launcher.start(tmp_path, RESHARD, plan).wait()
    seen = [
        {kind: emitted(tmp_path, f"{kind}{i}", n)[0] for kind in ("ddp", "fsdp")}
        for i, (n, _, _) in enumerate(phases)
    ]
    for kind in ("ddp", "fsdp"):
        first, second, third = (s[kind] for s in seen)
        assert (first["start"], second["start"], third["start"]) == (None, 5, 9), kind
        for earlier, later, steps in ((first, second, ("6", "7")), (second, third, ("10", "11"))):
            for step in steps:
                assert later["losses"][step] == pytest.approx(earlier["losses"][step], rel=1e-5), (
                    kind,
                    step,
                    earlier["losses"],
                    later["losses"],
                )
    # the loss moved between those steps (the comparison is not between constants)
    assert seen[0]["ddp"]["losses"]["6"] != seen[0]["ddp"]["losses"]["7"]
    # the sharded state of 4 ranks was written as 4 ranks' files, and read by 2
    fsdp = tmp_path / "ckpt" / "fsdp"
    assert {p.name.split("-")[1] for p in fsdp.iterdir()} == {"000000000005", "000000000009"}
    (five,) = fsdp.glob("step-000000000005-*")
    assert {p.name for p in five.glob("__*_0.distcp")} == {f"__{r}_0.distcp" for r in range(4)}
    loads = [
        (r["world_size"], r["saved_world_size"])
        for r in records(tmp_path)
        if r["event"] == "loaded" and r["step"] is not None
    ]
    assert loads == [(2, 4), (2, 4), (3, 2), (3, 2)]


PER_NODE = """
# A directory per rank stands in for a node's own disk: no rank sees another's files.
DIRECTORY = os.environ["DIRS"].split(",")[RANK]
PHASE = int(os.environ["PHASE"])
torch.manual_seed(RANK + 10 * PHASE)  # a node that just joined starts from weights of its own
model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.Adam(model.parameters(), lr=0.05)
model = nn.parallel.DistributedDataParallel(model, broadcast_buffers=False, init_sync=False)
ckpt = checkpoint.Checkpoints(DIRECTORY)
got = {}
step = ckpt.load(model, opt, extra=got)
emit(f"loaded{PHASE}", {"step": step, "extra": got, "params": flat(model), "shared": ckpt.shared})
for _ in range(2):
    loss = model(torch.randn(4, 6)).square().mean()
    opt.zero_grad(); loss.backward(); opt.step()
if PHASE < 2:
    ckpt.save(3 + PHASE, model, opt, extra={"phase": PHASE})
    emit(f"saved{PHASE}", {"params": flat(model), "steps": ckpt.steps()})
else:
    from torch.distributed.fsdp import fully_shard
    sharded = nn.Linear(6, 6)
    fully_shard(sharded)
    try:
        ckpt.save(5, sharded)
        emit("refused", None)
    except RuntimeError as e:
        emit("refused", str(e))
    # The same state is refused on load too: no node's copy holds every shard of it.
    try:
        ckpt.load(sharded)
        emit("refused_load", None)
    except RuntimeError as e:
        emit("refused_load", str(e))
"""


def test_without_shared_storage_a_node_with_no_checkpoint_gets_the_newest(
    launcher: Launcher, tmp_path: Path
) -> None:
    a, b, c, d = (str(tmp_path / n) for n in "abcd")
    phases = [
        {"nproc": 2, "env": {"DIRS": f"{a},{b}"}},  # step 3 into a and b
        {"nproc": 2, "env": {"DIRS": f"{a},{d}"}},  # d is new: step 3 comes from rank 0; step 4
        {"nproc": 3, "env": {"DIRS": f"{b},{c},{a}"}},  # b has only 3, c nothing, a has 4
    ]
    launcher.start(tmp_path, PER_NODE, phases).wait()
    saved = [emitted(tmp_path, f"saved{p}", 2) for p in (0, 1)]
    loaded = [emitted(tmp_path, f"loaded{p}", n) for p, n in ((0, 2), (1, 2), (2, 3))]
    assert [r["step"] for r in loaded[0]] == [None, None]
    assert [r["shared"] for r in loaded[0]] == [False, False], "a directory per rank is not shared"
    for p in (1, 2):
        for rank, seen in enumerate(loaded[p]):
            assert seen["step"] == 2 + p and seen["extra"] == {"phase": p - 1}, (p, rank)
            # every rank has the weights saved, the node with no checkpoint included
            assert seen["params"] == saved[p - 1][0]["params"], (p, rank)
    # each node kept its own copy
    assert [s["steps"] for s in saved[0]] == [[3], [3]]
    assert [s["steps"] for s in saved[1]] == [[3, 4], [4]]
    sources = [r["from"] for r in records(tmp_path) if r["event"] == "loaded" and r["step"]]
    assert sources == ["rank 0", "rank 2"]
    refused = emitted(tmp_path, "refused", 3) + emitted(tmp_path, "refused_load", 3)
    for message in refused:
        assert message and "not shared by every rank" in message and "sharded" in message
        assert "storage every node mounts" in message and "DDP" in message
    # the refusal wrote nothing
    assert not any(
        p.name.startswith("step-000000000005") for n in (a, b, c) for p in Path(n).iterdir()
    )


MIXED = """
# Two ranks on one node share its disk, the third has a disk of its own (a node of one rank).
DIRECTORY = os.environ["DIRS"].split(",")[RANK]
PHASE = int(os.environ["PHASE"])
torch.manual_seed(RANK + 10 * PHASE)
model = nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 1))
opt = torch.optim.Adam(model.parameters(), lr=0.05)
model = nn.parallel.DistributedDataParallel(model, broadcast_buffers=False, init_sync=False)
ckpt = checkpoint.Checkpoints(DIRECTORY)
step = ckpt.load(model, opt)
emit(f"loaded{PHASE}", {"step": step, "params": flat(model), "shared": ckpt.shared})
loss = model(torch.randn(4, 6)).square().mean()
opt.zero_grad(); loss.backward(); opt.step()
ckpt.save(3 + PHASE, model, opt, async_save=PHASE == 1)
ckpt.wait()
emit(f"saved{PHASE}", {"params": flat(model), "steps": ckpt.steps(), "listing": listing(DIRECTORY)})
"""


def test_two_ranks_sharing_a_disk_and_one_with_its_own(launcher: Launcher, tmp_path: Path) -> None:
    """As two ranks on one node and one on another, each node with a disk of its own: each
    node's lowest rank writes the node's whole copy, the other rank of the pair writes nothing,
    and a node that has no checkpoint gets the newest from the other."""
    a, b, c = (str(tmp_path / n) for n in "abc")
    phases = [
        {"nproc": 3, "env": {"DIRS": f"{a},{a},{b}"}},  # step 3 into a (by rank 0), b (rank 2)
        {"nproc": 3, "env": {"DIRS": f"{b},{c},{c}"}},  # c is new: step 3 comes from rank 0
    ]
    launcher.start(tmp_path, MIXED, phases).wait(120)
    first, second = (emitted(tmp_path, f"loaded{p}", 3) for p in (0, 1))
    assert [(r["step"], r["shared"]) for r in first] == [(None, False)] * 3
    assert [(r["step"], r["shared"]) for r in second] == [(3, False)] * 3
    saved = emitted(tmp_path, "saved0", 3)
    for rank, seen in enumerate(second):
        # b's copy, written by rank 2 (init_sync=False: each rank's weights are its own)
        assert seen["params"] == saved[2]["params"], rank
    # One whole copy per node, written by its lowest rank alone (DCP's files of one writer): a
    # by rank 0 (rank 1 beside it wrote nothing), b by rank 2.
    for rank in (0, 2):
        ((step, files),) = saved[rank]["listing"].items()
        assert step.startswith("step-000000000003-"), saved[rank]["listing"]
        assert files == [".metadata", "COMMITTED", "__0_0.distcp"], (rank, files)
    assert saved[1]["listing"] == saved[0]["listing"]
    # the async save of phase 1: each node keeps its steps (c's first is 4)
    assert [r["steps"] for r in emitted(tmp_path, "saved1", 3)] == [[3, 4], [4], [4]]
    sources = [r["from"] for r in records(tmp_path) if r["event"] == "loaded" and r["step"]]
    assert sources == ["rank 0"]


def test_the_probe_refuses_storage_ranks_see_differently() -> None:
    """What each rank saw of the others' probe files must split them into groups that see
    exactly each other: rank 0 seeing rank 1's file while rank 1 does not see rank 0's (a
    network filesystem's stale cache, a mount on one side only) is refused, whoever asks."""
    from elastic_nb.checkpoint.directory import Layout, layout

    assert layout([[0, 1], [0, 1], [2]], 1, "/ckpt") == Layout(False, 0, ((0, 1), (2,)))
    assert layout([[0, 1], [0, 1], [2]], 2, "/ckpt") == Layout(False, 2, ((0, 1), (2,)))
    assert layout([[0, 1]] * 2, 1, "/ckpt") == Layout(True, 0, ((0, 1),))
    for views in ([[0, 1], [1]], [[0, 1], [0, 1], [1, 2]], [[1], [1]]):
        for rank in range(len(views)):
            with pytest.raises(RuntimeError, match="the ranks disagree about who shares /ckpt"):
                layout(views, rank, "/ckpt")


# One process, no process group: an async save, then the exit a forked rank makes (bootstrap runs
# the atexit handlers, multiprocessing then calls os._exit). Says whether this process had
# reaped its writer by then.
EXITS_AFTER_A_SAVE = """
import atexit, os, sys, torch
from elastic_nb.checkpoint.checkpoints import Checkpoints
c = Checkpoints(sys.argv[1])
c.save(1, torch.nn.Linear(4, 1), async_save=True)
c.wait()
writer = c.writer_pid
atexit._run_exitfuncs()
try:
    os.waitpid(writer, os.WNOHANG)
    print("writer still ours", flush=True)
except ChildProcessError:
    print("writer reaped", flush=True)
os._exit(0)
"""


def test_a_rank_ends_its_writer_before_it_exits(tmp_path: Path) -> None:
    """A writer used to end only when its rank's death closed its pipe: niced 19 on a busy
    machine it then ran on for over a second, and the job's end named it as left running by
    the cell. The rank's exit now ends and reaps it first."""
    done = subprocess.run(
        [sys.executable, "-c", EXITS_AFTER_A_SAVE, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "writer reaped", done.stdout + done.stderr


ASYNC = """
import signal, statistics
from multiprocessing import util
import psutil

def build():
    torch.manual_seed(0)
    # About 300 MB to write: 25M parameters and Adam's two moments, in float32, over 2 ranks.
    model = nn.parallel.DistributedDataParallel(nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(24)]))
    return model, torch.optim.Adam(model.parameters(), lr=1e-4)

def same(a, b):
    sa, sb = a.module.state_dict(), b.module.state_dict()
    return all(torch.equal(sa[k], sb[k]) for k in sa)

model, opt = build()
ckpt = checkpoint.Checkpoints(os.environ["CKPT"])

def step():
    t = time.perf_counter()
    loss = model(torch.randn(8, 1024)).square().mean()
    opt.zero_grad(); loss.backward(); opt.step()
    return time.perf_counter() - t

def saving():
    # Whether any rank's save is in flight: every rank steps as long as one is (DDP needs the
    # same number of steps on every rank).
    flag = torch.tensor([int(ckpt.in_flight)])
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())

step()
# The first async save starts this rank's writer process.
ckpt.save(0, model, opt, async_save=True)
ckpt.wait()
writer = ckpt.writer_pid
emit("writer", {"pid": writer, "parent": psutil.Process(writer).ppid(), "rank_pid": os.getpid(),
                "nice": psutil.Process(writer).nice()})

# The writer is stopped until training has done 3 more steps: a save that kept training waiting
# until it was written would never return.
os.kill(writer, signal.SIGSTOP)
ckpt.save(1, model, opt, async_save=True)
snapshot, _ = build()
snapshot.module.load_state_dict(model.module.state_dict())
for _ in range(3):
    step()
opened = [ckpt.in_flight]  # not written yet, after 3 steps
os.kill(writer, signal.SIGCONT)
ckpt.wait()

# What step 1 holds is the model as it was at save(1), not what the 3 steps made of it.
fresh, fresh_opt = build()
loaded = ckpt.load(fresh, fresh_opt)
emit("gated", {"opened": opened, "loaded": loaded, "is_snapshot": same(fresh, snapshot),
               "moved": not same(model, snapshot)})

# The next save waits for the one in flight: when save(3) returns, step 2 is committed.
ckpt.save(2, model, opt, async_save=True)
ckpt.save(3, model, opt, async_save=True)
two = [n for n in os.listdir(os.environ["CKPT"]) if n.startswith("step-000000000002-")]
emit("next", {"two_committed": bool(two) and os.path.exists(os.path.join(os.environ["CKPT"], two[0], "COMMITTED"))})

# Ungated: the steps training does while step 3 is written (20 at most: a niced writer on a
# machine other processes keep busy may take long), against steps with no save.
during = []
while len(during) < 20 and saving():
    during.append(step())
ckpt.wait()
alone = [step() for _ in range(5)]
emit("free", {"steps": len(during), "during": statistics.median(during) if during else None,
              "alone": statistics.median(alone)})

# The script ends with a save in flight, its writer stopped until the process is exiting (a
# multiprocessing finalizer, as a forked rank runs them before os._exit): it is finished first.
os.kill(writer, signal.SIGSTOP)
ckpt.save(4, model, opt, async_save=True)
util.Finalize(None, os.kill, args=(writer, signal.SIGCONT), exitpriority=100)
"""


# Alone: it compares training's pace during a write with its pace without one, which the other
# workers' load moves (it failed so once beside them: 0.76 s against 2 x 0.38 s).
@pytest.mark.alone
def test_async_save_lets_training_go_on_while_it_writes(launcher: Launcher, tmp_path: Path) -> None:
    env = {"CKPT": str(tmp_path / "ckpt")}
    launcher.start(tmp_path, ASYNC, [{"nproc": 2, "env": env}]).wait(180)
    # Each rank's saves are written by a process of its own, niced again once the save its rank
    # waited for is written, that ends with the rank.
    writers = emitted(tmp_path, "writer", 2)
    for rank, w in enumerate(writers):
        assert w["parent"] == w["rank_pid"] and w["pid"] != w["rank_pid"], (rank, w)
        assert w["nice"] == checkpoint.writer.NICE, (rank, w)
        assert wait_for(lambda w=w: pid_ended(w["pid"]), timeout=10), (
            f"rank {rank}'s writer lived on"
        )
    for rank, seen in enumerate(emitted(tmp_path, "gated", 2)):
        assert seen["opened"] == [True], f"rank {rank} wrote only after training stopped"
        assert seen["loaded"] == 1 and seen["moved"], rank
        assert seen["is_snapshot"], f"rank {rank}: step 1 holds a later state than save(1)'s"
    saves = [r for r in records(tmp_path) if r["event"] == "saved"]
    assert [(r["step"], r["async"]) for r in saves] == [(s, True) for s in (0, 1, 2, 3, 4)]
    assert [seen["two_committed"] for seen in emitted(tmp_path, "next", 2)] == [True, True]
    for r in saves:
        assert r["overlapped_s"] > 0 and r["blocked_s"] + r["overlapped_s"] == pytest.approx(
            r["seconds"]
        )
        assert r["bytes"] > 250e6
    # Training went on beside the write of step 3, at about its pace with no save: a loose
    # bound (P14 measures the slowdown), which a writer holding training's GIL, or one as
    # urgent as training itself, would break.
    free = emitted(tmp_path, "free", 2)
    assert free[0]["steps"] == free[1]["steps"] >= 1, free
    for rank, f in enumerate(free):
        assert f["during"] <= 2 * f["alone"], (rank, f)
    print(
        f"async save of {saves[3]['bytes'] / 1e6:.0f} MB: {saves[3]['blocked_s']:.2f} s blocked, "
        f"{saves[3]['overlapped_s']:.2f} s beside training, {free[0]['steps']} steps meanwhile "
        f"({free[0]['during']:.3f} s each, {free[0]['alone']:.3f} s with no save)"
    )
