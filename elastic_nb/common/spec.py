"""The one description of a job: every launch knob, as the supervisor, the launcher and every
rank read it (it travels as JSON). The kernel builds it from flags and validates it
(kernel/flags.py); nothing here parses a flag, imports torch or IPython.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass, fields
from typing import Any

from elastic_nb.protocol.wire import ProtocolError, check_record

__all__ = ["CHECKPOINT_DIR_ENV", "MANAGED_ENV", "TEARS_DOWN", "USER_ENV", "JobSpec"]

# elastic_nb's variables a user may give the ranks (--env): where elastic_nb.checkpoint keeps a
# notebook's checkpoints.
CHECKPOINT_DIR_ENV = "ELASTIC_NB_CHECKPOINT_DIR"
USER_ENV = frozenset({CHECKPOINT_DIR_ENV})

# Variables torchelastic or elastic_nb set for every rank: a rank takes these from its own start,
# never from the job's environment (a forked rank adopts the job's), and --env may not set them.
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

# Modes that end a rank once its collective timed out (ProcessGroupNCCL.hpp, SHOULD_TEAR_DOWN).
TEARS_DOWN = (1, 3)
# After a timeout, NCCL's watchdog waits 4 x TORCH_NCCL_WAIT_TIMEOUT_DUMP_MILSEC (15 s) for the
# flight recorder's dump before it ends the rank: the longest a torn-down rank takes to go.
NCCL_DUMP_WAIT_S = 60.0


@dataclass(frozen=True)
class JobSpec:
    """Everything the supervisor, the launcher and the ranks need to run one cell.

    Built by `kernel.flags.job_spec` (from flags: kernel.options declares each one, its default
    and help) or `from_json` (in a rank); the fields are the parsed values."""

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
    memory_history: bool  # record CUDA allocations' stacks; at an OOM, what filled the GPU
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
    # Across machines (--nnodes MIN:MAX): this many nodes each run `nproc` ranks; the notebook's
    # machine is one of them unless `remote_only`. `ship`: the notebook's own modules the cell
    # imports (files beside it), sent to every other node.
    nnodes_min: int = 1
    nnodes_max: int = 1
    remote_only: bool = False
    ship: tuple[str, ...] = ()
    pdb: bool = False  # --pdb: a rank whose cell raises waits in the debugger first (post-mortem)

    @property
    def multi_node(self) -> bool:
        """Ranks on join agents' machines: rounds of the supervisor's (runs/rounds.py)."""
        return self.nnodes_max > 1 or self.remote_only

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
        """Ranks on one node; a multi-node group's world is its round's (RankGroup.world_size)."""
        return self.nproc

    # ---- transport ----------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        for key in _TUPLES:
            d[key] = list(d[key])
        return d

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> JobSpec:
        """A spec as it crossed a boundary (a submit, a join agent's order, a run directory's
        spec.json): every field of its type, none unknown, or ProtocolError naming the field
        (a submit with `nproc: "four"` is refused there, not by the launcher it would start)."""
        d = check_record(dict(d), cls, "the job's spec")
        unknown = sorted(set(d) - _FIELDS)
        if unknown:
            raise ProtocolError(f"the job's spec: unknown field {unknown[0]!r}")
        for key in _TUPLES:
            d[key] = tuple(d.get(key, ()))
        return cls(**d)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=1, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        return cls.from_dict(json.loads(text))


_TUPLES = ("push", "pull", "preload", "sys_path", "ship")
_FIELDS = frozenset(f.name for f in fields(JobSpec))
