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
import secrets
import signal
import sys
from typing import Any

from elastic_nb import protocol
from elastic_nb.common import loopback, modules, procs
from elastic_nb.common.rundir import ATTEMPT_BASE_ENV, RUN_DIR_ENV, RunDir
from elastic_nb.common.spec import TEARS_DOWN, JobSpec
from elastic_nb.launcher import rendezvous
from elastic_nb.launcher.observe import observe_agent
from elastic_nb.launcher.pipe import Channel

_PR_SET_PDEATHSIG = 1


def main() -> None:
    channel = Channel(os.dup(1))
    os.dup2(2, 1)
    die_with_parent()
    sys.stdout = sys.stderr

    # Warm: everything up to READY happens before there is a job; the supervisor hands us one
    # when a cell asks. A fork of the zygote (zygote.py): torch is imported already.
    warm_env = dict(os.environ)  # the fork server's, and so every forked rank's, to start with
    _start_fork_server()

    from torch.distributed.elastic.multiprocessing import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import elastic_launch

    from elastic_nb.rank.bootstrap import bootstrap
    from elastic_nb.rank.session_loop import serve

    observe_agent(channel)
    rendezvous.quicken()
    rendezvous.reserve_master_port()
    _wait_fork_server()
    channel.send(protocol.launcher.Ready(kind=protocol.launcher.READY, pid=os.getpid()))
    line = sys.stdin.readline()
    if not line:
        return  # the supervisor let us go without a job
    assignment = protocol.launcher.assignment(json.loads(line))
    job_id, rd, plan = assignment["job"], RunDir(assignment["run_dir"]), assignment["round"]
    procs.mark_process(job_id)
    _log_to(rd.launcher_log)
    spec = JobSpec.from_json(rd.spec.read_text())
    os.environ.clear()
    os.environ.update(assignment["env"])
    _apply_environment(spec, job_id, rd, plan)
    job_env = dict(os.environ)
    # Spawned ranks start from this process's environment; forked ones from the fork server's.
    start_env = warm_env if spec.start_method == "forkserver" else job_env
    code = 0
    try:
        if plan is None:
            # The rendezvous store serves on a socket of ours on 127.0.0.1 (loopback.py), held
            # for the job's life; torch's c10d or static backend finds it at that endpoint.
            rdzv_server = loopback.rendezvous_server(_endpoint_port(spec.rdzv_endpoint))
            endpoint = f"{loopback.HOST}:{rdzv_server.port}"
            rendezvous.sign(secrets.token_bytes(32))  # this launcher is its store's one client
        else:
            endpoint = plan["endpoint"]  # the group's store, on the notebook's machine
            rendezvous.sign(bytes.fromhex(plan["key"]))
        config = _launch_config(spec, rd, job_id, endpoint, plan)
        # A session's ranks run cells until the supervisor says bye; a job's run its one cell.
        entrypoint = serve if spec.session else bootstrap
        elastic_launch(config, entrypoint)(str(rd.path), job_env, start_env)
        channel.send(protocol.launcher.Result(kind=protocol.launcher.RESULT, ok=True))
    except ChildFailedError as e:
        failures = {
            str(rank): {"exitcode": f.exitcode, "pid": f.pid, "message": f.message}
            for rank, f in e.failures.items()
        }
        channel.send(
            protocol.launcher.Result(
                kind=protocol.launcher.RESULT, ok=False, error="ranks failed", failures=failures
            )
        )
        code = 1
    except SignalException as e:
        error = f"launcher received {e.sigval.name}"
        channel.send(protocol.launcher.Result(kind=protocol.launcher.RESULT, ok=False, error=error))
        code = 128 + int(e.sigval)
    except BaseException as e:
        logging.getLogger(__name__).exception("elastic_launch raised")
        error = f"{type(e).__name__}: {e}"
        channel.send(protocol.launcher.Result(kind=protocol.launcher.RESULT, ok=False, error=error))
        code = 1
    # Nothing is left to do once the ranks are joined and the result is sent, and finalizing an
    # interpreter that loaded torch takes about 0.4 s that the notebook would wait for.
    logging.shutdown()
    sys.stderr.flush()
    os._exit(code)


def _start_fork_server() -> None:
    """Start multiprocessing's fork server now, a fork of this launcher (torch imported in the
    zygote) that imports elastic_nb.launcher.warmup (the --preload modules), so that forking a rank costs
    milliseconds when the job comes. torch's start_processes(start_method="forkserver") uses this
    same server (multiprocessing.forkserver's module-level instance), for every attempt."""
    from elastic_nb.launcher import fork_server

    fork_server.start([modules.WARMUP])


def _wait_fork_server() -> None:
    """ensure_running() returns once the server process exists, not once it has imported what
    it preloads: fork one child through it, so that READY means a rank forks in milliseconds
    (the first job's forks otherwise waited about 0.4 s each on the server's imports)."""
    import multiprocessing

    child = multiprocessing.get_context("forkserver").Process(target=os.getpid)
    child.start()
    child.join()


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


def die_with_parent() -> None:
    """If the supervisor dies, SIGTERM reaches us; torch's handler then stops the ranks."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGTERM), 0, 0, 0)
    expected = os.environ.get("ELASTIC_NB_SUPERVISOR_PID")
    if expected and os.getppid() != int(expected):
        sys.exit(1)  # the supervisor died before the signal was armed


def _apply_environment(
    spec: JobSpec, job_id: str, rd: RunDir, plan: protocol.launcher.LaunchRound | None
) -> None:
    """Ranks inherit this process's environment (torchelastic only adds its rank variables)."""
    env = os.environ
    # gloo's and NCCL's own listening sockets on loopback (loopback.py), or, across machines,
    # on the interface of the node's address: over the kernel's environment, under --env.
    env.update(loopback.interface_env(plan["ifname"] if plan else None))
    if plan is not None:
        env[ATTEMPT_BASE_ENV] = str(plan["attempt"])
        env[loopback.NODE_ADDR_ENV] = plan["addr"]
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
    env[RUN_DIR_ENV] = str(rd.path)
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


def _launch_config(
    spec: JobSpec,
    rd: RunDir,
    job_id: str,
    rdzv_endpoint: str,
    plan: protocol.launcher.LaunchRound | None,
) -> Any:
    from torch.distributed.launcher.api import LaunchConfig

    from elastic_nb.launcher.run_logs import RunDirLogsSpecs

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
    local_addr = loopback.HOST
    if plan is not None:
        # A round of a multi-node job: exactly its nodes, every launcher a client of the group's
        # store (no launcher is its host: it lives with the notebook's supervisor), and no
        # restarts of torch's own: a failure or a change of nodes is the next round, the
        # supervisor's (the restart budget is the job's, not each agent's: pytorch#108158).
        kwargs.update(
            min_nodes=plan["nnodes"],
            max_nodes=plan["nnodes"],
            run_id=plan["run_id"],
            max_restarts=0,
        )
        rdzv_configs["is_host"] = False
        local_addr = plan["addr"]
    # MASTER_ADDR, the address rank 0's process-group store is reached at (and, in the ranks,
    # bound to: loopback.patch_process_group_store); torch's default is this machine's FQDN.
    if "local_addr" in LaunchConfig.__dataclass_fields__:
        kwargs["local_addr"] = local_addr
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
