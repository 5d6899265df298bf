"""Run one job's `elastic_launch` and narrate what the agent does to the supervisor.

The launcher's stdout is the protocol pipe to the supervisor; it is moved to a private fd before
torch loads so that nothing torch or C++ prints can corrupt it, and fd 1 joins fd 2: a log
beside the supervisor's while the launcher waits warm for a job, the run directory's
``launcher.log`` from the moment it has one.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import logging
import math
import os
import signal
import sys
import threading
import time
from typing import Any

from elastic_nb import loopback, procs, protocol
from elastic_nb.rundir import RunDir
from elastic_nb.spec import TEARS_DOWN, JobSpec

_PR_SET_PDEATHSIG = 1


class Channel:
    """Frames to the supervisor. Written from the agent's thread and from logging handlers."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._lock = threading.Lock()
        self._last_tick = 0.0

    def send(self, kind: str, **fields: Any) -> None:
        data = protocol.encode(kind, **fields)
        with self._lock:
            try:
                while data:
                    data = data[os.write(self._fd, data) :]
            except BrokenPipeError:
                pass  # the supervisor is gone; our parent-death signal ends us

    def tick(self) -> None:
        now = time.monotonic()
        if now - self._last_tick >= protocol.TICK_EVERY_S:
            self._last_tick = now
            self.send(protocol.TICK, t=time.time())


def main() -> None:
    channel = Channel(os.dup(1))
    os.dup2(2, 1)
    _die_with_parent()
    sys.stdout = sys.stderr

    # Warm: everything up to READY happens before there is a job; the supervisor hands us one
    # when a cell asks. The fork server imports torch while this process does (two cores).
    warm_env = dict(os.environ)  # the fork server's, and so every forked rank's, to start with
    _start_fork_server()

    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from elastic_nb.session_worker import serve
    from elastic_nb.worker import bootstrap

    _observe_agent(channel)
    _quicken_rendezvous()
    _wait_fork_server()
    channel.send(protocol.READY, pid=os.getpid())
    line = sys.stdin.readline()
    if not line:
        return  # the supervisor let us go without a job
    assignment = json.loads(line)
    job_id, rd = assignment["job"], RunDir(assignment["run_dir"])
    procs.mark_process(job_id)
    _log_to(rd.launcher_log)
    spec = JobSpec.from_json(rd.spec.read_text())
    os.environ.clear()
    os.environ.update(assignment["env"])
    _apply_environment(spec, job_id, rd)
    job_env = dict(os.environ)
    # Spawned ranks start from this process's environment; forked ones from the fork server's.
    start_env = warm_env if spec.start_method == "forkserver" else job_env
    code = 0
    try:
        # The rendezvous store serves on a socket of ours on 127.0.0.1 (loopback.py), held for
        # the job's life; torch's c10d or static backend finds it at the endpoint it is given.
        rdzv_server = loopback.rendezvous_server(_endpoint_port(spec.rdzv_endpoint))
        config = _launch_config(spec, rd, job_id, f"{loopback.HOST}:{rdzv_server.port}")
        # A session's ranks run cells until the supervisor says bye; a job's run its one cell.
        entrypoint = serve if spec.session else bootstrap
        elastic_launch(config, entrypoint)(str(rd.path), job_env, start_env)
        channel.send(protocol.RESULT, ok=True)
    except ChildFailedError as e:
        failures = {
            str(rank): {"exitcode": f.exitcode, "pid": f.pid, "message": f.message}
            for rank, f in e.failures.items()
        }
        channel.send(protocol.RESULT, ok=False, error="ranks failed", failures=failures)
        code = 1
    except SignalException as e:
        channel.send(protocol.RESULT, ok=False, error=f"launcher received {e.sigval.name}")
        code = 128 + int(e.sigval)
    except BaseException as e:
        logging.getLogger(__name__).exception("elastic_launch raised")
        channel.send(protocol.RESULT, ok=False, error=f"{type(e).__name__}: {e}")
        code = 1
    # Nothing is left to do once the ranks are joined and the result is sent, and finalizing an
    # interpreter that loaded torch takes about 0.4 s that the notebook would wait for.
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)


def _start_fork_server() -> None:
    """Start multiprocessing's fork server now, with torch (and --preload) imported in it by
    elastic_nb.warmup, so that forking a rank costs milliseconds when the job comes. torch's
    start_processes(start_method="forkserver") uses this same server (multiprocessing.forkserver's
    module-level instance), for every attempt of the job."""
    import multiprocessing.forkserver

    multiprocessing.set_forkserver_preload(["elastic_nb.warmup"])
    multiprocessing.forkserver.ensure_running()


def _wait_fork_server() -> None:
    """ensure_running() returns once the server process exists, not once it has imported what
    it preloads: fork one child through it, so that READY means a rank forks in milliseconds
    (the first job's forks otherwise waited about 0.4 s each on the server's imports)."""
    import multiprocessing

    child = multiprocessing.get_context("forkserver").Process(target=os.getpid)
    child.start()
    child.join()


def _quicken_rendezvous() -> None:
    """Two costs of torch's dynamic rendezvous that buy a single-node job nothing
    (elastic/rendezvous/dynamic_rendezvous.py, torch 2.13):

    - next_rendezvous() sleeps a random 0-0.3 s in round 0 "to skew the rendezvous attempts
      across the nodes"; there is one node (the spec refuses more);
    - every recorded event names its method with inspect.stack(), twice, which builds the
      source context of every frame (about 40 ms per launch); the frame's code has the name.
    """
    import torch.distributed.elastic.rendezvous.dynamic_rendezvous as dynamic

    original_delay = dynamic._delay

    def _delay(seconds: Any) -> None:
        if not isinstance(seconds, tuple):  # a fixed wait (the SYNC poll) is kept
            original_delay(seconds)

    def get_method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name
        except ValueError:
            return "no_method_name"

    dynamic._delay = _delay
    dynamic.get_method_name = get_method_name


def _log_to(path: Any) -> None:
    """From the warm log the supervisor gave us to the job's launcher.log (fds 1 and 2)."""
    warm_log = os.environ.get("ELASTIC_NB_LAUNCHER_LOG")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o600)
    if warm_log:
        with contextlib.suppress(OSError), open(warm_log, "rb") as f:
            os.write(fd, f.read())
        with contextlib.suppress(OSError):
            os.unlink(warm_log)
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)


def _die_with_parent() -> None:
    """If the supervisor dies, SIGTERM reaches us; torch's handler then stops the ranks."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    expected = os.environ.get("ELASTIC_NB_SUPERVISOR_PID")
    if expected and os.getppid() != int(expected):
        sys.exit(1)  # the supervisor died before the signal was armed


def _apply_environment(spec: JobSpec, job_id: str, rd: RunDir) -> None:
    """Ranks inherit this process's environment (torchelastic only adds its rank variables)."""
    env = os.environ
    # gloo's and NCCL's own listening sockets on loopback too (loopback.py): over the kernel's
    # environment, under --env.
    env.update(loopback.interface_env())
    env.update(spec.env)
    # Failure forensics for NCCL (inert on gloo). --env and the kernel's environment win.
    for name, value in {
        # torchelastic forces 1 unless set; set it ourselves so the flag decides. 1 aborts the
        # communicators and tears the rank down *after* the watchdog has dumped the flight
        # recorder (DUMP_ON_TIMEOUT waits for the dump), so the dump survives the abort.
        "TORCH_NCCL_ASYNC_ERROR_HANDLING": str(spec.async_error_handling),
        "TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC": str(max(1, math.ceil(spec.heartbeat_timeout))),
        # The monitor kills a rank after a timeout's dump whatever the mode: off for the modes
        # that promise to keep the rank (spec.ASYNC_ERROR_HANDLING).
        "TORCH_NCCL_ENABLE_MONITORING": "1" if spec.async_error_handling in TEARS_DOWN else "0",
        "TORCH_NCCL_DUMP_ON_TIMEOUT": "1",
        "TORCH_FR_BUFFER_SIZE": "2000",
    }.items():
        env.setdefault(name, value)
    env["ELASTIC_NB_JOB"] = job_id
    env["ELASTIC_NB_RUN_DIR"] = str(rd.path)
    env.setdefault("PYTHONUNBUFFERED", "1")  # rank logs are files: no block buffering
    if spec.nproc > 1:
        # torchrun's rule: N ranks each spinning up all cores' OpenMP threads thrash the machine.
        env.setdefault("OMP_NUM_THREADS", "1")
    # With the shared agent store a restarted attempt can read the previous attempt's keys and
    # hang in process-group init (class of pytorch#135712); a store of its own fixed it 10/10.
    env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    os.chdir(spec.cwd)


def _endpoint_port(endpoint: str) -> int:
    """The port of HOST:PORT. The host names this machine (flags.parse_endpoint refuses any
    other): whichever name it is, the store listens on 127.0.0.1 only."""
    return int(endpoint.rsplit(":", 1)[1])


def _launch_config(spec: JobSpec, rd: RunDir, job_id: str, rdzv_endpoint: str) -> Any:
    from torch.distributed.launcher.api import LaunchConfig

    from elastic_nb.launcher.logs import RunDirLogsSpecs

    rdzv_configs: dict[str, Any] = dict(spec.rdzv_conf)
    if spec.rdzv_backend == "static":
        rdzv_configs.setdefault("rank", 0)  # the one node is node 0 (as torchrun sets it)
    kwargs: dict[str, Any] = {
        "min_nodes": 1,
        "max_nodes": 1,
        "nproc_per_node": spec.nproc,
        "run_id": spec.rdzv_id or job_id,
        "rdzv_backend": spec.rdzv_backend,
        "rdzv_endpoint": rdzv_endpoint,
        "rdzv_configs": rdzv_configs,
        "max_restarts": spec.max_restarts,
        "monitor_interval": spec.monitor_interval,
        "start_method": spec.start_method,
        "logs_specs": RunDirLogsSpecs(rd),
    }
    # MASTER_ADDR, the address rank 0's process-group store is reached at (and, in the ranks,
    # bound to: loopback.patch_process_group_store); torch's default is this machine's FQDN.
    if "local_addr" in LaunchConfig.__dataclass_fields__:
        kwargs["local_addr"] = loopback.HOST
    # Not in every torch (absent from 2.11's LaunchConfig); where it is, 30 s by default.
    if "shutdown_timeout" in LaunchConfig.__dataclass_fields__:
        kwargs["shutdown_timeout"] = max(1, round(spec.stop_grace))
    # LaunchConfig asks torch.cuda about devices (for NUMA binding). Ask NVML rather than the
    # CUDA runtime, so this process never initialises CUDA or holds GPU memory.
    previous = os.environ.get("PYTORCH_NVML_BASED_CUDA_CHECK")
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"
    try:
        return LaunchConfig(**kwargs)
    finally:
        if previous is None:
            del os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"]
        else:
            os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = previous


class _EventHandler(logging.Handler):
    """torchelastic records agent events as JSON on the logger ``torchelastic-events-null``."""

    def __init__(self, channel: Channel) -> None:
        super().__init__(logging.INFO)
        self._channel = channel

    def emit(self, record: logging.LogRecord) -> None:
        try:
            event = json.loads(record.getMessage())
            md = event["metadata"]
            attempt = int(md.get("agent_restarts") or 0)
            state = md.get("state")
            if state == "START" and md.get("global_rank") is not None:
                self._channel.send(
                    protocol.START,
                    attempt=attempt,
                    rank=int(md["global_rank"]),
                    pid=int(md["worker_id"]),
                )
            elif state == "RENDEZVOUS":
                self._channel.send(
                    protocol.RENDEZVOUS,
                    attempt=attempt,
                    seconds=(md.get("duration_ms") or 0) / 1000,
                )
        except Exception:
            self.handleError(record)


class _StripTraceback(logging.Filter):
    """MultiprocessContext._poll reports a failed rank with logger.exception; formatting that
    traceback imports torch._dynamo (about 1.2-1.8 s, measured 1.36 s -> 0.49 s from raise to
    ChildFailedError without it). The rank's traceback is in the run directory already."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info = None
        record.exc_text = None
        return True


def _observe_agent(channel: Channel) -> None:
    from torch.distributed.elastic import events, metrics
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_StripTraceback())

    # Create the events logger the way torch does (it caches it), then make sure INFO passes
    # whatever LOGLEVEL the user gave the ranks.
    events_logger = events._get_or_create_logger("null")
    events_logger.setLevel(logging.INFO)
    events_logger.addHandler(_EventHandler(channel))

    class _Ticks(metrics.MetricHandler):
        # The agent's monitor loop puts metrics on every pass: a tick that stops means a stuck agent.
        def emit(self, metric_data: Any) -> None:
            channel.tick()

    metrics.configure(_Ticks(), group="torchelastic")

    # Every attempt ends in MultiprocessContext.close(), after torch has joined the ranks: the
    # one place where all exit codes are known (a ChildFailedError lists only one rank).
    original_close = MultiprocessContext._close

    def _close(self: Any, death_sig: signal.Signals, timeout: int = 30) -> None:
        original_close(self, death_sig, timeout)
        if self._pc is None or getattr(self, "_elastic_nb_reported", False):
            return
        self._elastic_nb_reported = True
        codes = {}
        for local_rank, proc in enumerate(self._pc.processes):
            env = self.envs[local_rank]
            codes[env["RANK"]] = proc.exitcode
        attempt = int(self.envs[0]["TORCHELASTIC_RESTART_COUNT"])
        channel.send(protocol.EXITS, attempt=attempt, codes=codes)

    MultiprocessContext._close = _close  # type: ignore[method-assign]
    _report_forked_exits(channel, MultiprocessContext)

    hold = os.environ.get("ELASTIC_NB_TEST_HOLD_BEFORE_SET")
    if hold:
        # Tests only: widen the window of torch's agent deadlock, between reading every rank's
        # return value and Event.set() in MultiprocessContext._poll (TORCH_FACTS.md), and say
        # when it opens (a file in the run directory) so that a test's ranks can die inside it.
        original_is_done = MultiprocessContext._is_done

        def _is_done(self: Any) -> bool:
            done = original_is_done(self)
            if done:
                run_dir = os.environ["ELASTIC_NB_RUN_DIR"]
                open(os.path.join(run_dir, "test-agent-read-results"), "w").close()
                time.sleep(float(hold))
            return done

        MultiprocessContext._is_done = _is_done  # type: ignore[method-assign]


def _report_forked_exits(channel: Channel, context: Any) -> None:
    """Say how each forked rank ended, as soon as it has.

    A rank forked by the fork server is that server's child: the server reaps it at once and
    writes its status to a socket this process reads (multiprocessing/popen_forkserver.py,
    Popen.poll), once. The supervisor, which reads a dead child's status from /proc while it is
    a zombie, never sees it. A thread per attempt waits on the ranks' sentinels and reads each
    status the moment it is there; torch's own polls take it from the Popen afterwards. One lock
    per Popen keeps the two from reading the socket at the same time.
    """
    import multiprocessing.popen_forkserver as popen_forkserver
    from multiprocessing.connection import wait

    original_poll = popen_forkserver.Popen.poll
    making = threading.Lock()

    def poll(self: Any, flag: int = os.WNOHANG) -> Any:
        lock = self.__dict__.get("_elastic_nb_lock")
        if lock is None:
            with making:
                lock = self.__dict__.setdefault("_elastic_nb_lock", threading.Lock())
        with lock:
            return original_poll(self, flag)

    popen_forkserver.Popen.poll = poll  # type: ignore[method-assign]

    def watch(attempt: int, ranks: dict[int, Any]) -> None:
        pending = {p.sentinel: (rank, p) for rank, p in ranks.items()}
        while pending:
            try:
                ready = wait(list(pending), timeout=5)
            except (OSError, ValueError):
                return  # the attempt was closed, and its sentinels with it
            for sentinel in ready:
                rank, p = pending.pop(sentinel)
                channel.send(protocol.EXIT, attempt=attempt, rank=rank, pid=p.pid, code=p.exitcode)

    original_start = context._start

    def _start(self: Any) -> None:
        original_start(self)
        if self.start_method != "forkserver":
            return  # spawned ranks are this process's children: the supervisor sees them die
        attempt = int(self.envs[0]["TORCHELASTIC_RESTART_COUNT"])
        ranks = {int(self.envs[i]["RANK"]): p for i, p in enumerate(self._pc.processes)}
        threading.Thread(target=watch, args=(attempt, ranks), daemon=True).start()

    context._start = _start
