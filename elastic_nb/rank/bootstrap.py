"""The worker bootstrap: what every rank runs.

torchelastic calls `bootstrap(run_dir, env, start_env)` in each rank process (spawn/forkserver pickle it by
reference, so it lives at the top level of an importable module). It prepares the process,
patches the process-group default timeouts, restores the objects the kernel shipped, runs the
cell in a fresh ``__main__`` with the cell's own line numbers, and leaves its outcome in the run
directory: a failure record stamped with our own sub-second clock, or a done record, the value of
the cell's last expression (rank 0) and the ``--pull`` objects.

This module is imported in every rank before torch: keep its top level light.
"""

from __future__ import annotations

import ast
import bdb
import builtins
import contextlib
import faulthandler
import functools
import importlib
import io
import json
import os
import pickle
import resource
import socket
import sys
import time
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from elastic_nb.common import loopback, modules, procs
from elastic_nb.common.rundir import ATTEMPT_BASE_ENV, RunDir, attempt_of, write_json
from elastic_nb.common.spec import MANAGED_ENV, JobSpec
from elastic_nb.protocol.rank_probes import STACK_SIGNAL, STACKS_END_MARK
from elastic_nb.rank import memory, notebook_input, recorder
from elastic_nb.rank.outcomes import dump, dump_result, record_failure

__all__ = ["Rank", "bootstrap", "prepare", "refuse_a_bad_fork", "run_cell"]


def bootstrap(run_dir: str, env: dict[str, str], start_env: dict[str, str]) -> bool:
    """Run the job's cell in this rank. Returns True; raises what the cell raised.

    `env` is the job's environment and `start_env` the one this process started with (the
    launcher's fork server's, for a forked rank): what torchelastic added on top of the latter
    is this rank's own (RANK, MASTER_PORT, ...).
    """
    me = prepare(run_dir, env, start_env)
    meta = json.loads(me.rd.cell_meta.read_text())
    error = run_cell(
        me.rd, meta, me.spec, me.attempt, me.rank, me.namespace, _checked_fork(), final=True
    )
    if error is not None:
        recorder.hold_for_evidence(error)
        raise error
    return True


@dataclass
class Rank:
    """This process as a rank of its job (or session), prepared."""

    rd: RunDir
    rank: int
    attempt: int
    spec: JobSpec
    namespace: dict[str, Any]  # the cell's __main__


def prepare(run_dir: str, env: dict[str, str], start_env: dict[str, str]) -> Rank:
    """Become a rank of the job: its environment and marker, its working directory, sys.path
    and timeouts, the forensics (stack dumps, flight-recorder probes), a fresh __main__."""
    _adopt_environment(env, start_env)
    rd = RunDir(run_dir)
    rank = int(os.environ["RANK"])
    attempt = attempt_of(os.environ)
    # The cell sees the job's attempt where torch puts its restart count: across machines each
    # round is an elastic_launch of its own, whose count starts again at 0.
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(attempt)
    os.environ.pop(ATTEMPT_BASE_ENV, None)
    spec = JobSpec.from_json(rd.spec.read_text())
    _prepare_process(spec, rd)
    if spec.collective_timeout is not None:
        _note_the_first_process_group(rd.process_group(attempt, rank))
    _arm_forensics(rd, attempt, rank)
    return Rank(rd, rank, attempt, spec, _fresh_main().__dict__)


def run_cell(
    rd: RunDir,
    meta: dict[str, Any],
    spec: JobSpec,
    attempt: int,
    rank: int,
    namespace: dict[str, Any],
    around: contextlib.AbstractContextManager[Any],
    final: bool,
) -> BaseException | None:
    """Run the cell of `rd` in `namespace` and leave its outcome there: a done record (and rank
    0's result, the --pull objects), or a failure record, whose exception is returned.

    `around` wraps restoring and running the cell (a session's interruptible window); `final`:
    the rank leaves the cell for good (a job's), so it leaves its collectives' history too.
    """
    phase = "restore"
    exit_note = None
    try:
        with around:
            memory.record_history(spec.memory_history)
            _restore(rd, meta, namespace)
            phase = "cell"
            try:
                value = _run_cell(rd, meta, namespace)
                _synchronize()
            except SystemExit as e:
                if e.code not in (0, None):
                    raise
                value, exit_note = None, "sys.exit(0)"  # a script may end early; so may a cell
        phase = "pull"
        if spec.pull and rank == spec.pull_rank:
            dump(rd.pulled(attempt, rank), _pulled(spec.pull, namespace, rank))
        if rank == 0 and meta["display"] and value is not None:
            dump_result(rd.result(attempt), value)
    except BaseException as e:
        if final:
            recorder.write_final(rd.collectives(attempt, rank), str(rd.cell))
        elif phase == "cell":
            notebook_input.failed(e)  # a session's rank lives on: %elastic debug opens it
        raised_at = time.time()
        if spec.pdb and phase == "cell" and not isinstance(e, _NOT_DEBUGGED):
            # Before the failure is recorded: the supervisor acts on a record (a rank that has
            # raised ends the attempt), and the rank is not done yet. It is recorded at the
            # time it was raised: who failed first does not change while it is debugged.
            notebook_input.post_mortem(e)
        record_failure(rd, attempt, rank, e, phase, meta, at=raised_at)
        return e
    # Before the done record: a rank seen as done has its history on disk (the desync watch
    # compares it with the ranks still in a collective). A session's rank lives on and answers
    # the watch's probes instead.
    if final:
        recorder.write_final(rd.collectives(attempt, rank), str(rd.cell))
    write_json(
        rd.done(attempt, rank),
        {
            "rank": rank,
            "attempt": attempt,
            "pid": os.getpid(),
            "host": socket.gethostname(),  # the pid is of its machine's
            "time": time.time(),
            "note": exit_note,
        },
    )
    return None


@contextlib.contextmanager
def _checked_fork() -> Iterator[None]:
    refuse_a_bad_fork()  # a failure of the cell's, recorded as one
    yield


# ---- process preparation --------------------------------------------------------------------


def _adopt_environment(env: dict[str, str], start_env: dict[str, str]) -> None:
    """Become a process of this job: its environment (not the one a warm fork server started
    with, before the job existed), torchelastic's rank variables on top, and the job's marker
    in the environment block that /proc shows (what finds every process of a job)."""
    ours = {k: v for k, v in os.environ.items() if k in MANAGED_ENV or start_env.get(k) != v}
    os.environ.clear()
    os.environ.update(env)
    os.environ.update(ours)
    _mark(os.environ[procs.MARKER])
    warmup = sys.modules.get(modules.WARMUP)
    if warmup is not None and os.getpid() != warmup.PID:  # forked from a launcher's server
        _settle_forked_rank(warmup.FAILED)


def _mark(job_id: str) -> None:
    """The job's marker where /proc shows it. Without it the rank still goes with its job (the
    teardown ends the launcher's whole process group), only a sweep by marker misses it: a
    warning, not a failure of every rank."""
    try:
        procs.mark_process(job_id)
    except Exception as e:
        sys.stderr.write(
            f"elastic_nb: could not write the job marker into this rank's environment ({e}); "
            "it is ended with its launcher's process group instead\n"
        )


def _prepare_process(spec: JobSpec, rd: RunDir) -> None:
    # A rank that aborts (NCCL's watchdog does) with gigabytes of GPU-mapped memory would write
    # a core of that size: the stacks in the .err log are the post-mortem here.
    _, hard = resource.getrlimit(resource.RLIMIT_CORE)
    resource.setrlimit(resource.RLIMIT_CORE, (0, hard))
    os.chdir(spec.cwd)
    # The notebook's sys.path first (so `sys.path.append("../src")` in the notebook works), then
    # whatever this interpreter added.
    sys.path[:] = list(spec.sys_path) + [p for p in sys.path if p not in spec.sys_path]
    sys.argv = [str(rd.cell)]
    if spec.collective_timeout is not None:
        _patch_default_timeouts(spec.collective_timeout)
    # Rank 0's process-group store listens on 127.0.0.1 only, not on every interface.
    loopback.patch_process_group_store()


def _settle_forked_rank(failed_preloads: dict[str, str]) -> None:
    """What a spawned rank gets from starting in the job's environment, and a rank forked from
    a server that started before the job did not:

    - PYTHONUNBUFFERED is read when the interpreter starts: the server's stdout and stderr are
      block-buffered files, and a print() without flush=True would reach the log (and the
      notebook) only kilobytes later;
    - OMP_NUM_THREADS is read when torch loads: the server's torch took every core, and N
      ranks each running that many threads on N cores ran a DDP step 3x slower (measured);
    - a forked rank ends with os._exit (multiprocessing/popen_fork.py, _launch), which skips
      the atexit handlers a cell registers (a logger's flush, wandb.finish): run them where
      multiprocessing runs its own finalizers;
    - a --preload module the server could not import (multiprocessing swallows the error) is
      imported by each rank itself: rank 0 says why.
    """
    import atexit
    from multiprocessing import util

    if os.environ.get("PYTHONUNBUFFERED"):
        for name, fd in (("stdout", 1), ("stderr", 2)):
            old = getattr(sys, name)
            old.flush()
            stream = io.TextIOWrapper(
                open(fd, "wb", buffering=0, closefd=False),  # noqa: SIM115 - it is sys.std*
                encoding=old.encoding,
                errors=old.errors,
                write_through=True,
            )
            setattr(sys, name, stream)
    threads = os.environ.get("OMP_NUM_THREADS", "")
    torch = sys.modules.get("torch")
    if threads.isdigit() and int(threads) > 0 and torch is not None:
        torch.set_num_threads(int(threads))
    util.Finalize(None, atexit._run_exitfuncs, exitpriority=-100)
    if os.environ.get("RANK") == "0":
        for module, error in failed_preloads.items():
            sys.stderr.write(
                f"elastic_nb: --preload {module} failed in the fork server ({error}); "
                "each rank imports it itself\n"
            )


def refuse_a_bad_fork() -> None:
    """A rank forked from a process that had initialised CUDA cannot use it ("Cannot
    re-initialize CUDA in forked subprocess", at its first CUDA call, deep in the cell): say
    why, and what to do, before the cell runs."""
    warmup = sys.modules.get(modules.WARMUP)
    cuda_by = warmup.CUDA_BY if warmup is not None and os.getpid() != warmup.PID else None
    torch = sys.modules.get("torch")
    bad = torch is not None and torch.cuda._is_in_bad_fork()
    if cuda_by is None and not bad:
        return
    by = f" (by --preload {cuda_by})" if cuda_by else ""
    raise RuntimeError(
        f"CUDA was initialised in the process this rank was forked from{by}, so this rank "
        "cannot use CUDA: "
        + (f"drop {cuda_by} from --preload, or " if cuda_by else "")
        + "run the cell with --start-method spawn"
    )


# Not a failure to debug: an interrupt, an exit, a quit from the debugger itself.
_NOT_DEBUGGED = (KeyboardInterrupt, SystemExit, bdb.BdbQuit)


def _synchronize() -> None:
    """CUDA reports a kernel's failure at the next synchronisation: have it before the rank
    calls the cell done, so that an asynchronous error is the cell's, with its rank."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _arm_forensics(rd: RunDir, attempt: int, rank: int) -> None:
    """What the supervisor reads when something goes wrong: stacks on request, stacks on a
    fatal signal (NCCL's watchdog aborts with SIGABRT), the flight recorder on request (the
    desync watch's probes), and NCCL's flight-recorder dumps."""
    os.environ.setdefault("TORCH_FR_DUMP_TEMP_FILE", str(rd.flight_recorder_prefix(attempt)))
    faulthandler.enable(file=sys.stderr, all_threads=True)
    # The supervisor signals only ranks whose .stacks file exists: create it under another name
    # and rename it once the handler is armed (the signal's default action would kill the rank).
    final = rd.stacks(attempt, rank)
    tmp = final.with_name(f".{final.name}.tmp")
    stacks = open(tmp, "a", buffering=1)  # noqa: SIM115 - held for the process's life
    end = _last_line_of_a_dump()
    if end is not None:
        stacks.write(f"{STACKS_END_MARK}{end}\n")
    faulthandler.register(STACK_SIGNAL, file=stacks, all_threads=True, chain=False)
    if recorder.serve_probes(
        rd.probe(attempt, rank), rd.probe_answer(attempt, rank), str(rd.cell), stacks
    ):
        # input() and pdb's prompt ask the notebook: their answers come as probes.
        notebook_input.install(rd.input_asked(attempt, rank), rank)
    os.replace(tmp, final)


def _last_line_of_a_dump() -> str | None:
    """What faulthandler writes last in a dump of every thread: the main thread's outermost
    frame (called here, in the main thread; that frame runs until the process ends)."""
    frame = sys._getframe()
    while frame.f_back is not None:
        frame = frame.f_back
    code = frame.f_code
    line = f'  File "{code.co_filename}", line {frame.f_lineno} in {code.co_name}'
    # faulthandler escapes what is not ASCII and cuts long names: no exact line to expect then
    return line if line.isascii() and len(line) < 400 else None


def _patch_default_timeouts(seconds: float) -> None:
    """Make --collective-timeout the default of every process group the cell creates.

    init_process_group/new_group take `timeout or _get_default_timeout(backend)`, which reads
    these two module globals of distributed_c10d (torch.distributed.constants is only copied
    from; patching it has no effect). An explicit timeout= in the cell still wins.
    """
    from datetime import timedelta

    import torch.distributed.distributed_c10d as c10d

    td = timedelta(seconds=seconds)
    c10d.default_pg_timeout = td
    # None on CPU-only builds, a timedelta where NCCL is compiled in.
    c10d.default_pg_nccl_timeout = td


def _note_the_first_process_group(path: Path) -> None:
    """Leave `path` when the rank makes its first process group (init_process_group, new_group
    and DeviceMesh all make theirs in c10d's `_new_process_group_helper`): from then on a
    collective can time out, and the dashboard says what --collective-timeout will do."""
    import torch.distributed.distributed_c10d as c10d

    make = c10d._new_process_group_helper

    @functools.wraps(make)
    def noted(*args: Any, **kwargs: Any) -> Any:
        made = make(*args, **kwargs)
        c10d._new_process_group_helper = make  # once is enough
        with contextlib.suppress(OSError):
            write_json(path, {"time": time.time()})
        return made

    c10d._new_process_group_helper = noted


def _fresh_main() -> types.ModuleType:
    """A clean ``__main__`` for the cell, so classes it defines pickle as ``__main__.X``.

    No ``__file__``: a spawn-started grandchild (a DataLoader worker, say) must not re-run the
    cell the way it re-runs a script's main module.
    """
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = builtins
    sys.modules["__main__"] = main
    return main


# ---- shipped objects ------------------------------------------------------------------------


def _restore(rd: RunDir, meta: dict[str, Any], namespace: dict[str, Any]) -> None:
    for name, module in meta["modules"].items():
        try:
            namespace[name] = importlib.import_module(module)
        except ImportError as e:
            raise ImportError(
                f"the notebook's module {module!r} (name {name!r}) cannot be imported in the "
                f"rank: {e}"
            ) from e
    if meta["objects"]:
        namespace.update(pickle.loads(rd.read_private(rd.payload)))


def _pulled(names: tuple[str, ...], namespace: dict[str, Any], rank: int) -> dict[str, Any]:
    missing = [n for n in names if n not in namespace]
    if missing:
        raise NameError(
            f"--pull {', '.join(missing)}: the cell did not define "
            f"{'it' if len(missing) == 1 else 'them'} on rank {rank}"
        )
    return {n: namespace[n] for n in names}


# ---- running the cell -----------------------------------------------------------------------


def _run_cell(rd: RunDir, meta: dict[str, Any], namespace: dict[str, Any]) -> Any:
    """Exec the cell; evaluate a trailing expression separately so rank 0 can return it."""
    filename = str(rd.cell)
    notebook_input.cell_is(filename)
    tree = ast.parse(rd.cell.read_text(), filename=filename)
    last = None
    if meta["display"] and tree.body and isinstance(tail := tree.body[-1], ast.Expr):
        tree.body.pop()
        last = ast.Expression(tail.value)
    exec(compile(tree, filename, "exec"), namespace)
    if last is None:
        return None
    return eval(compile(last, filename, "eval"), namespace)
