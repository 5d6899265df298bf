"""Every flag of ``%%elastic``, declared once: its spellings, default, help and group.

The magic's parser, ``%elastic config``, `DEFAULTS` (what `flags.job_spec` starts from) and
the docs' flags reference (docs/_ext/elastic_nb_docs.py) all come from `OPTIONS`. Defaults
are raw, as a flag would give them; `flags.job_spec` parses and validates them.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

__all__ = ["DEFAULTS", "OPTIONS", "Option", "add_arguments", "shown_default"]

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


@dataclass(frozen=True)
class Option:
    dest: str  # the JobSpec field (and DEFAULTS key)
    flags: tuple[str, ...]  # as a user types them, the first is its name
    default: Any  # raw, as the flag would give it
    help: str  # "{default}" is replaced by the shown default
    group: str
    metavar: str | None = None
    action: str | None = None  # "append" (repeatable), "store_true" or "store_false"
    shown: str | None = None  # the default as help and the docs say it, when not the value
    torchrun: bool = False  # torchrun's flag: its underscore spelling works too
    per_cell: bool = False  # a cell on a session (%elastic up) may give it; the rest launch ranks

    @property
    def spellings(self) -> tuple[str, ...]:
        if not self.torchrun:
            return self.flags
        under = tuple(f"--{f[2:].replace('-', '_')}" for f in self.flags if "-" in f[2:])
        return self.flags + under


_RANKS, _RDZV, _ENV, _DATA, _OUT = "ranks", "rendezvous", "environment and limits", "data", "output"
_SESSION = "sessions (%elastic up)"

OPTIONS: tuple[Option, ...] = (
    Option(
        "nproc",
        ("--nproc", "--nproc-per-node"),
        "1",
        "ranks to run: a number, 'gpu' (one per GPU the ranks would see: counted through NVML "
        "with CUDA's rules for CUDA_VISIBLE_DEVICES, --env included; with MIG, CUDA counts in a "
        "throwaway process; the kernel never initialises CUDA), 'cpu', or 'auto' ('gpu', else "
        "'cpu')",
        _RANKS,
        metavar="N",
        torchrun=True,
    ),
    Option(
        "nnodes",
        ("--nnodes",),
        "1",
        "machines, each running --nproc ranks: this one and join agents (%elastic join-command); "
        "MIN:MAX starts once MIN are there and grows to MAX as more join",
        _RANKS,
        metavar="N|MIN:MAX",
    ),
    Option(
        "remote_only",
        ("--remote-only",),
        False,
        "run no ranks on the notebook's machine (a laptop or a login node driving GPU machines): "
        "only on joined nodes",
        _RANKS,
        action="store_true",
        shown="off",
    ),
    Option(
        "max_restarts",
        ("--max-restarts",),
        0,
        "restarts of the whole group after a failure; each is reported as it happens",
        _RANKS,
        metavar="N",
        torchrun=True,
    ),
    Option(
        "monitor_interval",
        ("--monitor-interval",),
        0.1,
        "how often torchelastic's agent checks its ranks, in seconds",
        _RANKS,
        metavar="S",
        torchrun=True,
    ),
    Option(
        "start_method",
        ("--start-method",),
        "forkserver",
        "how ranks start: forked from a server that imported torch once (warm: before the "
        "cell), or each a fresh interpreter ('fork' is refused: the launcher's agent runs threads)",
        _RANKS,
        metavar="forkserver|spawn",
        torchrun=True,
    ),
    Option(
        "warm",
        ("--no-warm", "--warm"),
        True,
        "--no-warm starts this cell's launcher from scratch and keeps none ready for the next; "
        "--warm keeps one ready again (a launcher and its fork server wait with torch imported)",
        _RANKS,
        action="store_false",
        shown="warm",
    ),
    Option(
        "preload",
        ("--preload",),
        (),
        "modules the fork server imports once for every rank, warm for the next cell "
        "(comma-separated, repeatable; e.g. transformers)",
        _RANKS,
        metavar="MODULES",
        action="append",
        shown="none",
    ),
    Option(
        "rdzv_backend",
        ("--rdzv-backend",),
        "c10d",
        "rendezvous backend",
        _RDZV,
        metavar="c10d|static",
        torchrun=True,
    ),
    Option(
        "rdzv_endpoint",
        ("--rdzv-endpoint",),
        "localhost:0",
        "rendezvous address on this machine; port 0 picks a free port; a busy port is refused",
        _RDZV,
        metavar="HOST:PORT",
        torchrun=True,
    ),
    Option(
        "rdzv_id",
        ("--rdzv-id",),
        None,
        "rendezvous run id",
        _RDZV,
        metavar="ID",
        shown="the job id",
        torchrun=True,
    ),
    Option(
        "rdzv_conf",
        ("--rdzv-conf",),
        (),
        "extra rendezvous settings (e.g. join_timeout=60)",
        _RDZV,
        metavar="K=V,...",
        action="append",
        torchrun=True,
    ),
    Option(
        "env",
        ("--env",),
        (),
        "environment variable for every rank; repeatable",
        _ENV,
        metavar="K=V",
        action="append",
    ),
    Option(
        "timeout",
        ("--timeout",),
        None,
        "deadline for the whole job, in seconds; past it every rank is stopped (JobTimeout)",
        _ENV,
        metavar="S",
        per_cell=True,
    ),
    # Interactive default (torch's are 30 min gloo / 10 min NCCL): a stuck collective fails the
    # cell in two minutes, with every rank's stack, instead of holding the notebook for half an hour.
    Option(
        "collective_timeout",
        ("--collective-timeout",),
        120.0,
        "default timeout of every process group the cell creates (gloo and NCCL), in seconds, "
        "patched into torch.distributed before the cell runs; 'off' keeps torch's 30 min / "
        "10 min; an explicit timeout= in the cell still wins, and the magic warns about it",
        _ENV,
        metavar="S",
        shown="120",
    ),
    # TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC, torch's own default: the monitor acts only when NCCL's
    # watchdog thread itself is stuck (a CUDA or NCCL call that hangs), never on a slow
    # collective; lower, it can end a healthy rank whose watchdog waits behind a long cudaFree.
    # --hang-after shows every stack long before.
    Option(
        "heartbeat_timeout",
        ("--heartbeat-timeout",),
        480.0,
        "NCCL's heartbeat monitor (TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC, torch's own default): it "
        "ends a rank whose NCCL watchdog thread is stuck this long (a hung CUDA or NCCL call), "
        "never a slow collective; lower, it can end a healthy rank whose watchdog waits behind "
        "a long cudaFree",
        _ENV,
        metavar="S",
        shown="480",
    ),
    Option(
        "async_error_handling",
        ("--async-error-handling",),
        1,
        "what NCCL does when a collective times out (TORCH_NCCL_ASYNC_ERROR_HANDLING): "
        + "; ".join(f"{k}: {v}" for k, v in ASYNC_ERROR_HANDLING.items())
        + ". With 1 and 3 the watchdog's first line fails the cell; with 0 and 2 elastic_nb "
        "raises an alert with every rank's stack and the cell goes on",
        _ENV,
        metavar="0-3",
    ),
    Option(
        "hang_after",
        ("--hang-after",),
        120.0,
        "no output and no exit from any rank for this long: an alert with every rank's stack; "
        "the job keeps running; 'off' disables",
        _ENV,
        metavar="S",
        shown="120",
        per_cell=True,
    ),
    # torch's allocation history costs each allocation a stack (about 2 µs) and each rank some
    # memory: off unless asked (torch/cuda/memory.py, _record_memory_history).
    Option(
        "memory_history",
        ("--memory-history",),
        False,
        "record every CUDA allocation's Python stack in each rank; at a CUDA OOM the report "
        "names the cell lines whose allocations filled the GPU and keeps torch's snapshot "
        "(for pytorch.org/memory_viz) in the run directory; refused where the ranks see no GPU",
        _ENV,
        action="store_true",
        shown="",
        per_cell=True,
    ),
    # IPython's %pdb, on the ranks: the rank that raises waits at its prompt (rank/notebook_input.py).
    Option(
        "pdb",
        ("--pdb",),
        False,
        "a rank whose cell raises stops in the debugger at its exception (post-mortem, as "
        "IPython's %pdb) before it fails the cell; the other ranks are held (stopped) until it "
        "is done",
        _ENV,
        action="store_true",
        shown="",
        per_cell=True,
    ),
    Option(
        "push",
        ("--push",),
        (),
        "notebook objects to send to every rank (comma-separated, repeatable); modules, "
        "functions and classes the cell uses travel without it",
        _DATA,
        metavar="NAMES",
        action="append",
        per_cell=True,
    ),
    Option(
        "pull",
        ("--pull",),
        (),
        "names to bring back into the notebook when the job succeeds",
        _DATA,
        metavar="NAMES",
        action="append",
        per_cell=True,
    ),
    Option(
        "pull_rank",
        ("--pull-rank",),
        0,
        "the rank --pull reads from",
        _DATA,
        metavar="R",
        per_cell=True,
    ),
    Option(
        "background",
        ("--bg",),
        False,
        "return a job handle at once (job.wait(), await job, job.result, job.stop(), "
        "job.logs()), shown as the dashboard, and run on in the background",
        _OUT,
        action="store_true",
        shown="",
    ),
    Option(
        "widgets",
        ("--no-widgets",),
        True,
        "text output instead of the live dashboard (text is what nbconvert, terminal IPython "
        "and frontends without widgets get anyway)",
        _OUT,
        action="store_false",
        shown="",
        per_cell=True,
    ),
    Option(
        "log_dir",
        ("--log-dir",),
        None,
        "where run directories go",
        _OUT,
        metavar="DIR",
        shown="~/.cache/elastic_nb/runs",
        torchrun=True,
    ),
    Option(
        "replay",
        ("--no-replay",),
        True,
        "on a session: leave this cell out of the replay after a restart (a training loop "
        "you do not want to run again)",
        _SESSION,
        action="store_false",
        shown="",
        per_cell=True,
    ),
    Option(
        "one_off",
        ("--one-off",),
        False,
        "while a session is up: run this cell as a job of its own, beside the session",
        _SESSION,
        action="store_true",
        shown="",
        per_cell=True,
    ),
)

DEFAULTS: dict[str, Any] = {o.dest: o.default for o in OPTIONS}


def shown_default(o: Option) -> str:
    if o.shown is not None:
        return o.shown
    if o.default in (None, (), {}):
        return "none"
    return str(o.default)


def add_arguments(add: Any, group: Any) -> list[Any]:
    """The argparse arguments of every option, through IPython's `argument`/`argument_group`
    decorator factories (`add`, `group`); returns the decorators in order. Defaults are
    suppressed: only the flags a user gives are parsed, and defaults merge in layers."""
    decorators, current = [], None
    for o in OPTIONS:
        if o.group != current:
            current = o.group
            decorators.append(group(current))
        shown = shown_default(o)
        # argparse %-formats help: a "%elastic ..." in it must reach the reader as written.
        help_text = (o.help + (f" (default: {shown})" if shown else "")).replace("%", "%%")
        if o.action in ("store_true", "store_false") and len(o.flags) == 2:
            # --no-X / --X: one option, two flags that set it each way.
            for flag, action, shown_help in zip(
                o.flags, ("store_false", "store_true"), (help_text, argparse.SUPPRESS), strict=True
            ):
                each = {"dest": o.dest, "action": action, "default": argparse.SUPPRESS}
                decorators.append(add(flag, help=shown_help, **each))
            continue
        kwargs: dict[str, Any] = {"dest": o.dest, "default": argparse.SUPPRESS, "help": help_text}
        if o.action is not None:
            kwargs["action"] = o.action
        if o.metavar is not None:
            kwargs["metavar"] = o.metavar
        decorators.append(add(*o.spellings, **kwargs))
    return decorators
