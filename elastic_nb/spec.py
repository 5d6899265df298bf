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
import ipaddress
import json
import os
import re
import socket
import sys
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any

from elastic_nb import gpus

__all__ = ["DEFAULTS", "JobSpec", "SpecError", "default_log_dir", "preflight"]


class SpecError(ValueError):
    """A flag value that cannot launch a job; the message names the flag and the fix."""


START_METHODS = ("spawn", "forkserver")
RDZV_BACKENDS = ("c10d", "static")

# Variables torchelastic or elastic_nb set for every rank; a user value would break the launch.
MANAGED_ENV = frozenset(
    {
        "RANK",
        "LOCAL_RANK",
        "GROUP_RANK",
        "ROLE_RANK",
        "ROLE_NAME",
        "WORLD_SIZE",
        "LOCAL_WORLD_SIZE",
        "GROUP_WORLD_SIZE",
        "ROLE_WORLD_SIZE",
        "MASTER_ADDR",
        "MASTER_PORT",
        "TORCHELASTIC_RESTART_COUNT",
        "TORCHELASTIC_MAX_RESTARTS",
        "TORCHELASTIC_RUN_ID",
        "TORCHELASTIC_USE_AGENT_STORE",
        "TORCHELASTIC_ERROR_FILE",
    }
)
MANAGED_PREFIX = "ELASTIC_NB_"
# TORCH_NCCL_ASYNC_ERROR_HANDLING modes (torch/csrc/distributed/c10d/ProcessGroupNCCL.hpp) as
# elastic_nb runs them. Whatever the mode, NCCL's heartbeat monitor kills a rank after a timeout
# once it has dumped (ProcessGroupNCCL.cpp, HeartbeatMonitor): elastic_nb turns the monitor off
# for 0 and 2, so that they do what they say.
ASYNC_ERROR_HANDLING = {
    0: "no handling: the watchdog logs the timeout; the rank lives on (heartbeat monitor off)",
    1: "abort the communicators and end the rank, after the flight recorder has dumped",
    2: "abort the communicators; the error reaches the cell (heartbeat monitor off)",
    3: "end the rank without aborting the communicators",
}
# Modes that end a rank once its collective timed out (ProcessGroupNCCL.hpp, SHOULD_TEAR_DOWN).
TEARS_DOWN = (1, 3)
# After a timeout, NCCL's watchdog waits 4 x TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC (15 s) for the
# flight recorder's dump before it ends the rank: the longest a torn-down rank takes to go.
NCCL_DUMP_WAIT_S = 60.0

_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def default_log_dir() -> str:
    """Run directories live under the user's cache directory unless --log-dir says otherwise."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return os.path.join(base, "elastic_nb", "runs")


# Built-in defaults of every option, by JobSpec field name. `%elastic config` overrides them
# for the session; flags on the cell override both.
DEFAULTS: dict[str, Any] = {
    "nproc": "1",
    "nnodes": "1",
    "max_restarts": 0,
    "monitor_interval": 0.1,
    "start_method": "forkserver",
    "rdzv_backend": "c10d",
    "rdzv_endpoint": "localhost:0",
    "rdzv_id": None,
    "rdzv_conf": (),
    "env": (),
    "timeout": None,
    "collective_timeout": 120.0,
    "heartbeat_timeout": 480.0,
    "async_error_handling": 1,
    "hang_after": 120.0,
    "push": (),
    "pull": (),
    "pull_rank": 0,
    "widgets": True,
    "background": False,
    "log_dir": None,
    "warm": True,
    "preload": (),
}


@dataclass(frozen=True)
class JobSpec:
    """Everything the supervisor, the launcher and the ranks need to run one cell."""

    nproc: int
    max_restarts: int = 0
    monitor_interval: float = 0.1
    # Ranks fork from a server that imported torch once (warm: before the cell was even run).
    start_method: str = "forkserver"
    rdzv_backend: str = "c10d"
    rdzv_endpoint: str = "localhost:0"
    rdzv_id: str | None = None
    rdzv_conf: dict[str, str] = field(default_factory=dict)
    env: dict[str, str] = field(default_factory=dict)
    timeout: float | None = None
    # Interactive defaults (torch's are 30 min gloo / 10 min NCCL): a stuck collective fails the
    # cell in two minutes, with every rank's stack, instead of holding the notebook for half an hour.
    collective_timeout: float | None = 120.0
    # TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC, torch's own default: the monitor acts only when NCCL's
    # watchdog thread itself is stuck (a CUDA or NCCL call that hangs), never on a slow
    # collective; lower, it can end a healthy rank whose watchdog waits behind a long cudaFree.
    # --hang-after shows every stack long before.
    heartbeat_timeout: float = 480.0
    async_error_handling: int = 1  # TORCH_NCCL_ASYNC_ERROR_HANDLING: 1 = abort and tear down
    hang_after: float | None = 120.0  # no output and no exit for this long: dump every stack
    push: tuple[str, ...] = ()
    pull: tuple[str, ...] = ()
    pull_rank: int = 0
    widgets: bool = True
    background: bool = False  # --bg: the cell returns a handle at once
    log_dir: str = field(default_factory=default_log_dir)
    warm: bool = True  # keep a launcher (and its fork server) ready for the next cell
    preload: tuple[str, ...] = ()  # modules the fork server imports for every rank
    cwd: str = field(default_factory=os.getcwd)
    sys_path: tuple[str, ...] = ()
    # SIGTERM -> SIGKILL grace when a job is stopped: the supervisor's for the process group,
    # torchelastic's (shutdown_timeout, 30 s by default) for the ranks. A notebook waits on it.
    stop_grace: float = 2.0

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

        env = _parse_env(o["env"])
        nproc = _parse_nproc(o["nproc"], {**os.environ, **env})
        _check_single_node(str(o["nnodes"]), str(o["rdzv_endpoint"]))
        max_restarts = _parse_int("--max-restarts", o["max_restarts"], minimum=0)
        monitor_interval = _parse_seconds("--monitor-interval", o["monitor_interval"])
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
        rdzv_endpoint = _parse_endpoint(str(o["rdzv_endpoint"]))
        if rdzv_backend == "static" and rdzv_endpoint.rsplit(":", 1)[1] == "0":
            raise SpecError(
                "--rdzv-backend static needs a fixed port: --rdzv-endpoint localhost:PORT"
            )
        rdzv_id = o["rdzv_id"]
        if rdzv_id is not None and not re.fullmatch(r"[A-Za-z0-9_.\-]+", str(rdzv_id)):
            raise SpecError(f"--rdzv-id {rdzv_id!r}: use letters, digits, '.', '_' and '-'")
        pull_rank = _parse_int("--pull-rank", o["pull_rank"], minimum=0)
        if pull_rank >= nproc:
            raise SpecError(f"--pull-rank {pull_rank}: the job has ranks 0..{nproc - 1}")
        push = _parse_names("--push", o["push"])
        preload = _parse_names("--preload", o["preload"], dotted=True)
        pull = _parse_names("--pull", o["pull"])
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
            rdzv_conf=_parse_pairs("--rdzv-conf", o["rdzv_conf"], split_commas=True),
            env=env,
            timeout=_parse_optional_seconds("--timeout", o["timeout"]),
            collective_timeout=_parse_optional_seconds(
                "--collective-timeout", o["collective_timeout"]
            ),
            heartbeat_timeout=_parse_seconds("--heartbeat-timeout", o["heartbeat_timeout"]),
            async_error_handling=_parse_async_error_handling(o["async_error_handling"]),
            hang_after=_parse_optional_seconds("--hang-after", o["hang_after"]),
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


def _parse_async_error_handling(value: Any) -> int:
    mode = _parse_int("--async-error-handling", value, minimum=0)
    if mode not in ASYNC_ERROR_HANDLING:
        modes = ", ".join(f"{k} ({v})" for k, v in ASYNC_ERROR_HANDLING.items())
        raise SpecError(f"--async-error-handling {mode}: choose one of {modes}")
    return mode


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


# ---- parsers --------------------------------------------------------------------------------


def _parse_int(flag: str, value: Any, *, minimum: int) -> int:
    try:
        n = int(str(value).strip())
    except ValueError:
        raise SpecError(f"{flag} {value!r}: expected a whole number") from None
    if n < minimum:
        raise SpecError(f"{flag} {n}: must be at least {minimum}")
    return n


def _parse_seconds(flag: str, value: Any) -> float:
    try:
        s = float(str(value).strip())
    except ValueError:
        raise SpecError(f"{flag} {value!r}: expected a number of seconds") from None
    if not s > 0 or s != s or s == float("inf"):
        raise SpecError(f"{flag} {value}: must be a positive number of seconds")
    return s


def _parse_optional_seconds(flag: str, value: Any) -> float | None:
    if value is None or str(value).strip().lower() in ("", "none", "off"):
        return None
    return _parse_seconds(flag, value)


def _parse_nproc(value: Any, env: Mapping[str, str]) -> int:
    text = str(value).strip().lower()
    if text in ("gpu", "auto"):
        count = gpus.visible_gpu_count(env)
        if count:
            return count
        if text == "gpu":
            visible = env.get("CUDA_VISIBLE_DEVICES")
            raise SpecError(
                "--nproc gpu: no NVIDIA GPU is visible"
                + ("" if visible is None else f" with CUDA_VISIBLE_DEVICES={visible!r}")
            )
        text = "cpu"
    if text == "cpu":
        return os.cpu_count() or 1
    return _parse_int("--nproc", text, minimum=1)


def _check_single_node(nnodes: str, endpoint: str) -> None:
    text = nnodes.strip()
    parts = text.split(":")
    if len(parts) > 2:
        raise SpecError(f"--nnodes {text}: expected N or MIN:MAX")
    try:
        lo, hi = int(parts[0]), int(parts[-1])
    except ValueError:
        raise SpecError(f"--nnodes {text}: expected N or MIN:MAX with whole numbers") from None
    if lo < 1:
        raise SpecError(f"--nnodes {text}: a job needs at least one node")
    if lo > hi:
        raise SpecError(f"--nnodes {text}: MIN ({lo}) is larger than MAX ({hi})")
    if (lo, hi) != (1, 1):
        raise SpecError(
            f"--nnodes {text}: a multi-node job needs a rendezvous every node can reach "
            f"(--rdzv-endpoint HOST:PORT on a shared host, not {endpoint}) and an agent on each "
            "node; this version of elastic_nb runs single-node jobs only, so use --nnodes 1"
        )


def _parse_endpoint(text: str) -> str:
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host:
        raise SpecError(f"--rdzv-endpoint {text!r}: expected HOST:PORT, e.g. localhost:29500")
    port_n = _parse_int("--rdzv-endpoint port", port, minimum=0)
    if port_n > 65535:
        raise SpecError(f"--rdzv-endpoint {text}: port {port_n} is out of range")
    if not _is_local_host(host.strip("[]")):
        raise SpecError(
            f"--rdzv-endpoint {text}: {host} is not this machine; a remote rendezvous means a "
            "multi-node job, which this version does not run (use localhost:PORT)"
        )
    return f"{host}:{port_n}"


def _is_local_host(host: str) -> bool:
    if host in ("localhost", socket.gethostname(), socket.getfqdn()):
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _flatten(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    out: list[str] = []
    for v in value:
        out.extend(_flatten(v))
    return out


def _parse_names(flag: str, value: Any, dotted: bool = False) -> tuple[str, ...]:
    names: list[str] = []
    for item in _flatten(value):
        for name in item.replace(",", " ").split():
            if not all(_NAME.match(part) for part in (name.split(".") if dotted else [name])):
                raise SpecError(f"{flag} {name!r}: not a Python {'module ' if dotted else ''}name")
            if name not in names:
                names.append(name)
    return tuple(names)


def _parse_pairs(flag: str, value: Any, *, split_commas: bool) -> dict[str, str]:
    pairs: dict[str, str] = {}
    if isinstance(value, Mapping):
        return {str(k): str(v) for k, v in value.items()}
    for item in _flatten(value):
        for pair in item.split(",") if split_commas else [item]:
            key, sep, val = pair.partition("=")
            if not sep or not key.strip():
                raise SpecError(f"{flag} {pair!r}: expected KEY=VALUE")
            pairs[key.strip()] = val
    return pairs


def _parse_env(value: Any) -> dict[str, str]:
    env = _parse_pairs("--env", value, split_commas=False)
    for key in env:
        if not _NAME.match(key):
            raise SpecError(f"--env {key}=...: not a valid environment variable name")
        if key in MANAGED_ENV or key.startswith(MANAGED_PREFIX):
            raise SpecError(
                f"--env {key}=...: {key} is set by the launcher for every rank and cannot be overridden"
            )
    return env
