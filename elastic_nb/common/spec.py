"""The one description of a job: every launch knob, parsed and validated before anything starts.

`JobSpec.from_options` turns the raw flag values of `%%elastic` (merged with the session's
`%elastic config` defaults) into a frozen `JobSpec`, raising `SpecError` with a sentence a user
can act on. `preflight` checks what only the machine can answer (a writable log directory, a
free rendezvous port). Nothing here imports torch or IPython: the spec travels as JSON to the
supervisor, the launcher and every rank.
"""

from __future__ import annotations

import errno
import importlib.util
import json
import os
import re
import socket
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass
from typing import Any

from elastic_nb.kernel.flags import (
    MANAGED_ENV,
    SpecError,
    check_single_node,
    parse_async_error_handling,
    parse_endpoint,
    parse_env,
    parse_int,
    parse_names,
    parse_nproc,
    parse_optional_seconds,
    parse_pairs,
    parse_seconds,
)
from elastic_nb.kernel.options import DEFAULTS

__all__ = ["MANAGED_ENV", "JobSpec", "SpecError", "default_log_dir", "preflight"]


START_METHODS = ("spawn", "forkserver")
RDZV_BACKENDS = ("c10d", "static")

# Modes that end a rank once its collective timed out (ProcessGroupNCCL.hpp, SHOULD_TEAR_DOWN).
TEARS_DOWN = (1, 3)
# After a timeout, NCCL's watchdog waits 4 x TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC (15 s) for the
# flight recorder's dump before it ends the rank: the longest a torn-down rank takes to go.
NCCL_DUMP_WAIT_S = 60.0


def default_log_dir() -> str:
    """Run directories live under the user's cache directory unless --log-dir says otherwise."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "elastic_nb", "runs")


@dataclass(frozen=True)
class JobSpec:
    """Everything the supervisor, the launcher and the ranks need to run one cell.

    Built by `from_options` (from flags: options.OPTIONS declares each one, its default and
    help) or `from_json` (in a rank); the fields are the parsed values."""

    nproc: int
    max_restarts: int
    monitor_interval: float
    start_method: str
    rdzv_backend: str
    rdzv_endpoint: str
    rdzv_id: str | None
    rdzv_conf: dict[str, str]
    env: dict[str, str]
    timeout: float | None
    collective_timeout: float | None
    heartbeat_timeout: float
    async_error_handling: int
    hang_after: float | None
    push: tuple[str, ...]
    pull: tuple[str, ...]
    pull_rank: int
    widgets: bool
    background: bool
    log_dir: str
    warm: bool
    preload: tuple[str, ...]
    replay: bool  # a session cell: replayed after a restart
    one_off: bool  # a cell beside a session, as a job of its own
    cwd: str
    sys_path: tuple[str, ...]
    # SIGTERM -> SIGKILL grace when a job is stopped: the supervisor's for the process group,
    # torchelastic's (shutdown_timeout, 30 s by default) for the ranks. A notebook waits on it.
    stop_grace: float = 2.0
    session: bool = False  # the ranks of a session (%elastic up): they run cells until down

    @property
    def worst_case_s(self) -> float | None:
        """The longest a stuck collective can hold the cell: every attempt may wait out the
        collective timeout, then NCCL's wait for the flight recorder's dump before it ends the
        rank (elastic_nb acts on the watchdog's first line, but bounds what it cannot see).
        With --async-error-handling 0 nothing ends the rank: no bound."""
        if self.collective_timeout is None or self.async_error_handling == 0:
            return None
        wait = NCCL_DUMP_WAIT_S if self.async_error_handling in TEARS_DOWN else 0.0
        return (self.max_restarts + 1) * (self.collective_timeout + wait)

    @property
    def world_size(self) -> int:
        # Single node only: --nnodes other than 1 is refused in from_options.
        return self.nproc

    # ---- construction -------------------------------------------------------------------

    @classmethod
    def from_options(
        cls,
        options: Mapping[str, Any],
        *,
        cwd: str | None = None,
        sys_path: Iterable[str] = (),
    ) -> JobSpec:
        """Build a spec from raw option values (strings or lists of strings, as argparse gives).

        Unknown keys are a programming error; missing keys take `DEFAULTS`.
        """
        unknown = set(options) - set(DEFAULTS)
        if unknown:
            raise TypeError(f"unknown job options: {sorted(unknown)}")
        o = {**DEFAULTS, **options}
        cwd = os.path.abspath(cwd or os.getcwd())

        env = parse_env(o["env"])
        nproc = parse_nproc(o["nproc"], {**os.environ, **env})
        check_single_node(str(o["nnodes"]), str(o["rdzv_endpoint"]))
        max_restarts = parse_int("--max-restarts", o["max_restarts"], minimum=0)
        monitor_interval = parse_seconds("--monitor-interval", o["monitor_interval"])
        if monitor_interval > 10:
            raise SpecError(
                f"--monitor-interval {monitor_interval:g}: the agent checks its ranks this often; "
                "above 10 s failures go unnoticed for too long"
            )
        start_method = str(o["start_method"])
        if start_method == "fork":
            raise SpecError(
                "--start-method fork is not offered: the launcher process has asked torch about "
                "CUDA, and forking after that breaks CUDA in the ranks; use spawn or forkserver"
            )
        if start_method not in START_METHODS:
            raise SpecError(
                f"--start-method {start_method}: choose one of {', '.join(START_METHODS)}"
            )
        rdzv_backend = str(o["rdzv_backend"])
        if rdzv_backend not in RDZV_BACKENDS:
            raise SpecError(
                f"--rdzv-backend {rdzv_backend}: single-node jobs rendezvous with "
                f"{' or '.join(RDZV_BACKENDS)}"
            )
        rdzv_endpoint = parse_endpoint(str(o["rdzv_endpoint"]))
        if rdzv_backend == "static" and rdzv_endpoint.rsplit(":", 1)[1] == "0":
            raise SpecError(
                "--rdzv-backend static needs a fixed port: --rdzv-endpoint localhost:PORT"
            )
        rdzv_id = o["rdzv_id"]
        if rdzv_id is not None and not re.fullmatch(r"[A-Za-z0-9_.\-]+", str(rdzv_id)):
            raise SpecError(f"--rdzv-id {rdzv_id!r}: use letters, digits, '.', '_' and '-'")
        pull_rank = parse_int("--pull-rank", o["pull_rank"], minimum=0)
        if pull_rank >= nproc:
            raise SpecError(f"--pull-rank {pull_rank}: the job has ranks 0..{nproc - 1}")
        push = parse_names("--push", o["push"])
        preload = parse_names("--preload", o["preload"], dotted=True)
        pull = parse_names("--pull", o["pull"])
        log_dir = o["log_dir"] or default_log_dir()
        log_dir = os.path.abspath(os.path.join(cwd, os.path.expanduser(str(log_dir))))
        return cls(
            nproc=nproc,
            max_restarts=max_restarts,
            monitor_interval=monitor_interval,
            start_method=start_method,
            rdzv_backend=rdzv_backend,
            rdzv_endpoint=rdzv_endpoint,
            rdzv_id=None if rdzv_id is None else str(rdzv_id),
            rdzv_conf=parse_pairs("--rdzv-conf", o["rdzv_conf"], split_commas=True),
            env=env,
            timeout=parse_optional_seconds("--timeout", o["timeout"]),
            collective_timeout=parse_optional_seconds(
                "--collective-timeout", o["collective_timeout"]
            ),
            heartbeat_timeout=parse_seconds("--heartbeat-timeout", o["heartbeat_timeout"]),
            async_error_handling=parse_async_error_handling(o["async_error_handling"]),
            hang_after=parse_optional_seconds("--hang-after", o["hang_after"]),
            push=push,
            pull=pull,
            pull_rank=pull_rank,
            widgets=bool(o["widgets"]),
            background=bool(o["background"]),
            log_dir=log_dir,
            warm=bool(o["warm"]),
            preload=preload,
            cwd=cwd,
            sys_path=tuple(sys_path),
            replay=bool(o["replay"]),
            one_off=bool(o["one_off"]),
        )

    # ---- transport ----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in _TUPLES:
            d[key] = list(d[key])
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> JobSpec:
        d = dict(d)
        for key in _TUPLES:
            d[key] = tuple(d.get(key, ()))
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        return cls.from_dict(json.loads(text))


_TUPLES = ("push", "pull", "preload", "sys_path")


# ---- environment checks ---------------------------------------------------------------------


def preflight(spec: JobSpec) -> None:
    """Check what only this machine can answer, so a bad setting fails before any launch."""
    if importlib.util.find_spec("torch") is None:
        raise SpecError(
            f"torch is not installed for this kernel's Python ({sys.executable}); the ranks "
            "need it: pip install torch"
        )
    for module in spec.preload:
        if importlib.util.find_spec(module.split(".")[0]) is None:  # no import: it may be heavy
            raise SpecError(f"--preload {module}: no such module for {sys.executable}")
    _check_writable_dir(spec.log_dir)
    host, port = spec.rdzv_endpoint.rsplit(":", 1)
    if int(port):
        _check_port_free(host.strip("[]"), int(port))


def _check_writable_dir(path: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".write-check-"):
            pass
    except OSError as e:
        raise SpecError(f"--log-dir {path}: cannot write there ({e.strerror or e})") from None


def _check_port_free(host: str, port: int) -> None:
    """Refuse a busy rendezvous port: torch's c10d treats a busy local port as a store some
    other agent hosts and would try to join it instead of failing (rendezvous/c10d_rendezvous_backend)."""
    families = [socket.AF_INET] + ([socket.AF_INET6] if socket.has_ipv6 else [])
    for family in families:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            # The store binds with SO_REUSEADDR; mirror it so TIME_WAIT leftovers don't count.
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("::" if family == socket.AF_INET6 else "", port))
            except OSError as e:
                if e.errno == errno.EADDRINUSE:
                    raise SpecError(
                        f"--rdzv-endpoint {host}:{port}: port {port} is already in use; "
                        "pick a free port or use localhost:0 to let the launcher choose"
                    ) from None
                if e.errno == errno.EADDRNOTAVAIL:  # no IPv6 on this host
                    continue
                raise
