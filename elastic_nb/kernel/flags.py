"""Flags into one `JobSpec`: each raw value (a string, or strings for a repeatable flag, as
argparse gives them) parsed into the value the spec holds, the whole validated (`job_spec`), and
what only this machine can answer checked before anything launches (`preflight`: a writable log
directory, a free rendezvous port). Every refusal is a `SpecError` that names the flag and says
what it takes."""

from __future__ import annotations

import errno
import importlib.util
import ipaddress
import os
import re
import socket
import sys
import tempfile
from collections.abc import Iterable, Mapping
from typing import Any

from elastic_nb.common.rundir import cache_home
from elastic_nb.common.spec import MANAGED_ENV, USER_ENV, JobSpec
from elastic_nb.kernel import gpus
from elastic_nb.kernel.options import ASYNC_ERROR_HANDLING, DEFAULTS

__all__ = ["SpecError", "check_memory_history", "default_log_dir", "job_spec", "preflight"]

START_METHODS = ("spawn", "forkserver")
RDZV_BACKENDS = ("c10d", "static")


class SpecError(ValueError):
    """A flag value that cannot launch a job; the message names the flag and the fix."""


MANAGED_PREFIX = "ELASTIC_NB_"
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")


def parse_async_error_handling(value: Any) -> int:
    mode = parse_int("--async-error-handling", value, minimum=0)
    if mode not in ASYNC_ERROR_HANDLING:
        modes = ", ".join(f"{k} ({v})" for k, v in ASYNC_ERROR_HANDLING.items())
        raise SpecError(f"--async-error-handling {mode}: choose one of {modes}")
    return mode


def parse_int(flag: str, value: Any, *, minimum: int) -> int:
    try:
        n = int(str(value).strip())
    except ValueError:
        raise SpecError(f"{flag} {value!r}: expected a whole number") from None
    if n < minimum:
        raise SpecError(f"{flag} {n}: must be at least {minimum}")
    return n


def parse_seconds(flag: str, value: Any) -> float:
    try:
        s = float(str(value).strip())
    except ValueError:
        raise SpecError(f"{flag} {value!r}: expected a number of seconds") from None
    if not s > 0 or s != s or s == float("inf"):
        raise SpecError(f"{flag} {value}: must be a positive number of seconds")
    return s


def parse_optional_seconds(flag: str, value: Any) -> float | None:
    if value is None or str(value).strip().lower() in ("", "none", "off"):
        return None
    return parse_seconds(flag, value)


def parse_nproc(value: Any, env: Mapping[str, str]) -> int:
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
    return parse_int("--nproc", text, minimum=1)


def parse_nnodes(value: Any) -> tuple[int, int]:
    """--nnodes N or MIN:MAX, as (MIN, MAX)."""
    text = str(value).strip()
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
    return lo, hi


# What torch's c10d rendezvous reads from --rdzv-conf (elastic/rendezvous/dynamic_rendezvous.py,
# create_handler; c10d_rendezvous_backend.py), each a whole number of seconds (or attempts).
C10D_CONF = (
    "join_timeout",
    "last_call_timeout",
    "close_timeout",
    "heartbeat_timeout",
    "keep_alive_interval",
    "keep_alive_max_attempt",
    "read_timeout",
)


def parse_rdzv_conf(value: Any, backend: str) -> dict[str, str]:
    conf = parse_pairs("--rdzv-conf", value, split_commas=True)
    if backend != "c10d":
        return conf
    for key, val in conf.items():
        if key == "timeout":
            raise SpecError(
                "--rdzv-conf timeout=...: torch's c10d rendezvous ignores it (only the etcd and "
                "static backends read it; LaunchConfig sets it to 900 for nothing): use "
                "join_timeout=S, how long a rendezvous waits for its nodes"
            )
        if key not in C10D_CONF:
            raise SpecError(
                f"--rdzv-conf {key}=...: not a setting of the c10d rendezvous (it reads "
                f"{', '.join(C10D_CONF)})"
            )
        parse_int(f"--rdzv-conf {key}", val, minimum=1)
    return conf


def parse_endpoint(text: str) -> str:
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host:
        raise SpecError(f"--rdzv-endpoint {text!r}: expected HOST:PORT, e.g. localhost:29500")
    port_n = parse_int("--rdzv-endpoint port", port, minimum=0)
    if port_n > 65535:
        raise SpecError(f"--rdzv-endpoint {text}: port {port_n} is out of range")
    if not is_local_host(host.strip("[]")):
        raise SpecError(
            f"--rdzv-endpoint {text}: {host} is not this machine; the rendezvous belongs to the "
            "notebook's machine (other nodes reach it through their join agent), so name a "
            "port here: localhost:PORT"
        )
    return f"{host}:{port_n}"


def is_local_host(host: str) -> bool:
    """Loopback, or this machine's name. The FQDN is looked up last, only for a name that is
    neither: its reverse lookup can take seconds on a badly configured network."""
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        pass
    return host in ("localhost", socket.gethostname()) or host == socket.getfqdn()


def flatten(value: Any) -> list[str]:
    if value is None:
        return []
    if isinstance(value, str):
        return [value]
    out: list[str] = []
    for v in value:
        out.extend(flatten(v))
    return out


def parse_names(flag: str, value: Any, dotted: bool = False) -> tuple[str, ...]:
    names: list[str] = []
    for item in flatten(value):
        for name in item.replace(",", " ").split():
            if not all(_NAME.match(part) for part in (name.split(".") if dotted else [name])):
                raise SpecError(f"{flag} {name!r}: not a Python {'module ' if dotted else ''}name")
            if name not in names:
                names.append(name)
    return tuple(names)


def parse_pairs(flag: str, value: Any, *, split_commas: bool) -> dict[str, str]:
    pairs: dict[str, str] = {}
    if isinstance(value, Mapping):
        return {str(k): str(v) for k, v in value.items()}
    for item in flatten(value):
        for pair in item.split(",") if split_commas else [item]:
            key, sep, val = pair.partition("=")
            if not sep or not key.strip():
                raise SpecError(f"{flag} {pair!r}: expected KEY=VALUE")
            pairs[key.strip()] = val
    return pairs


def parse_env(value: Any) -> dict[str, str]:
    env = parse_pairs("--env", value, split_commas=False)
    for key in env:
        if not _NAME.match(key):
            raise SpecError(f"--env {key}=...: not a valid environment variable name")
        if key in MANAGED_ENV or (key.startswith(MANAGED_PREFIX) and key not in USER_ENV):
            raise SpecError(
                f"--env {key}=...: {key} is set by the launcher for every rank and cannot be overridden"
            )
    return env


def default_log_dir() -> str:
    """Run directories live under the user's cache directory unless --log-dir says otherwise."""
    return str(cache_home() / "runs")


def parse_log_dir(value: Any, cwd: str) -> str:
    log_dir = value or default_log_dir()
    return os.path.abspath(os.path.join(cwd, os.path.expanduser(str(log_dir))))


def parse_monitor_interval(value: Any) -> float:
    seconds = parse_seconds("--monitor-interval", value)
    if seconds > 10:
        raise SpecError(
            f"--monitor-interval {seconds:g}: the agent checks its ranks this often; "
            "above 10 s failures go unnoticed for too long"
        )
    return seconds


def parse_start_method(value: Any) -> str:
    start_method = str(value)
    if start_method == "fork":
        raise SpecError(
            "--start-method fork is not offered: the launcher process has asked torch about "
            "CUDA, and forking after that breaks CUDA in the ranks; use spawn or forkserver"
        )
    if start_method not in START_METHODS:
        raise SpecError(f"--start-method {start_method}: choose one of {', '.join(START_METHODS)}")
    return start_method


def parse_rdzv_backend(value: Any, across_machines: bool) -> str:
    """`across_machines`: the job may have ranks on another machine (--nnodes, --remote-only)."""
    rdzv_backend = str(value)
    if rdzv_backend not in RDZV_BACKENDS:
        raise SpecError(
            f"--rdzv-backend {rdzv_backend}: elastic_nb's jobs rendezvous with "
            f"{' or '.join(RDZV_BACKENDS)}"
        )
    if rdzv_backend == "static" and across_machines:
        raise SpecError(
            "--rdzv-backend static fixes every node's rank ahead: a job across machines "
            "rendezvous with c10d, whose rounds follow nodes as they join and leave"
        )
    return rdzv_backend


def parse_rdzv_endpoint(value: Any, backend: str) -> str:
    rdzv_endpoint = parse_endpoint(str(value))
    if backend == "static" and rdzv_endpoint.rsplit(":", 1)[1] == "0":
        raise SpecError("--rdzv-backend static needs a fixed port: --rdzv-endpoint localhost:PORT")
    return rdzv_endpoint


def parse_rdzv_id(value: Any) -> str | None:
    if value is not None and not re.fullmatch(r"[A-Za-z0-9_.\-]+", str(value)):
        raise SpecError(f"--rdzv-id {value!r}: use letters, digits, '.', '_' and '-'")
    return None if value is None else str(value)


def parse_pull_rank(value: Any, ranks: int) -> int:
    """`ranks`: how many the job has at the least."""
    pull_rank = parse_int("--pull-rank", value, minimum=0)
    if pull_rank >= ranks:
        raise SpecError(f"--pull-rank {pull_rank}: the job has ranks 0..{ranks - 1}")
    return pull_rank


def job_spec(
    options: Mapping[str, Any],
    *,
    cwd: str | None = None,
    sys_path: Iterable[str] = (),
) -> JobSpec:
    """A spec from raw option values (strings or lists of strings, as argparse gives).

    Unknown keys are a programming error; missing keys take `DEFAULTS`.
    """
    unknown = set(options) - set(DEFAULTS)
    if unknown:
        raise TypeError(f"unknown job options: {sorted(unknown)}")
    o = {**DEFAULTS, **options}
    cwd = os.path.abspath(cwd or os.getcwd())

    env = parse_env(o["env"])
    nproc = parse_nproc(o["nproc"], {**os.environ, **env})
    nnodes_min, nnodes_max = parse_nnodes(o["nnodes"])
    remote_only = bool(o["remote_only"])
    rdzv_backend = str(o["rdzv_backend"])
    # The keywords in the order of the checks, not the spec's fields': of several bad flags, the
    # first is the one reported.
    return JobSpec(
        nproc=nproc,
        max_restarts=parse_int("--max-restarts", o["max_restarts"], minimum=0),
        monitor_interval=parse_monitor_interval(o["monitor_interval"]),
        start_method=parse_start_method(o["start_method"]),
        rdzv_backend=parse_rdzv_backend(rdzv_backend, nnodes_max > 1 or remote_only),
        rdzv_endpoint=parse_rdzv_endpoint(o["rdzv_endpoint"], rdzv_backend),
        rdzv_id=parse_rdzv_id(o["rdzv_id"]),
        pull_rank=parse_pull_rank(o["pull_rank"], nproc * nnodes_min),
        push=parse_names("--push", o["push"]),
        preload=parse_names("--preload", o["preload"], dotted=True),
        pull=parse_names("--pull", o["pull"]),
        log_dir=parse_log_dir(o["log_dir"], cwd),
        rdzv_conf=parse_rdzv_conf(o["rdzv_conf"], rdzv_backend),
        env=env,
        timeout=parse_optional_seconds("--timeout", o["timeout"]),
        collective_timeout=parse_optional_seconds("--collective-timeout", o["collective_timeout"]),
        heartbeat_timeout=parse_seconds("--heartbeat-timeout", o["heartbeat_timeout"]),
        async_error_handling=parse_async_error_handling(o["async_error_handling"]),
        hang_after=parse_optional_seconds("--hang-after", o["hang_after"]),
        memory_history=bool(o["memory_history"]),
        pdb=bool(o["pdb"]),
        widgets=bool(o["widgets"]),
        background=bool(o["background"]),
        warm=bool(o["warm"]),
        cwd=cwd,
        sys_path=tuple(sys_path),
        replay=bool(o["replay"]),
        one_off=bool(o["one_off"]),
        nnodes_min=nnodes_min,
        nnodes_max=nnodes_max,
        remote_only=remote_only,
    )


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
    check_memory_history(spec)
    _check_writable_dir(spec.log_dir)
    host, port = spec.rdzv_endpoint.rsplit(":", 1)
    if int(port):
        _check_port_free(host.strip("[]"), int(port))


def check_memory_history(spec: JobSpec) -> None:
    """--memory-history records CUDA allocations: refused where the ranks see no GPU."""
    if spec.memory_history and gpus.visible_gpu_count({**os.environ, **spec.env}) == 0:
        raise SpecError(
            "--memory-history records CUDA allocations, and no NVIDIA GPU is visible to the "
            "ranks (CUDA_VISIBLE_DEVICES included): leave the flag out for a CPU job"
        )


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
