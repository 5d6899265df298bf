"""A flag's raw value (a string, or strings for a repeatable flag, as argparse gives them) turned
into the value a `JobSpec` holds, or a `SpecError` that names the flag and says what it takes."""

from __future__ import annotations

import ipaddress
import os
import re
import socket
from collections.abc import Mapping
from typing import Any

from elastic_nb.kernel import gpus
from elastic_nb.kernel.options import ASYNC_ERROR_HANDLING


class SpecError(ValueError):
    """A flag value that cannot launch a job; the message names the flag and the fix."""


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


def check_single_node(nnodes: str, endpoint: str) -> None:
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


def parse_endpoint(text: str) -> str:
    host, sep, port = text.strip().rpartition(":")
    if not sep or not host:
        raise SpecError(f"--rdzv-endpoint {text!r}: expected HOST:PORT, e.g. localhost:29500")
    port_n = parse_int("--rdzv-endpoint port", port, minimum=0)
    if port_n > 65535:
        raise SpecError(f"--rdzv-endpoint {text}: port {port_n} is out of range")
    if not is_local_host(host.strip("[]")):
        raise SpecError(
            f"--rdzv-endpoint {text}: {host} is not this machine; a remote rendezvous means a "
            "multi-node job, which this version does not run (use localhost:PORT)"
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
        if key in MANAGED_ENV or key.startswith(MANAGED_PREFIX):
            raise SpecError(
                f"--env {key}=...: {key} is set by the launcher for every rank and cannot be overridden"
            )
    return env
