"""Module names that travel as strings: started with ``python -m``, preloaded by name before the
job exists, or looked up in ``sys.modules``. One place, so that moving a module means changing a
line here, and `tests/test_imports.py` imports every one of them."""

from __future__ import annotations

__all__ = [
    "LAUNCHER",
    "LAUNCHER_AGENT",
    "NAMED",
    "RANK_BOOTSTRAP",
    "RANK_SESSION_LOOP",
    "ROLE_ENV",
    "SERVER_EXTENSION",
    "STORE_PORT_ENV",
    "STORE_ROLE",
    "SUPERVISOR",
    "WARMUP",
]

SUPERVISOR = "elastic_nb.supervisor"  # python -m: the kernel's client starts it
LAUNCHER = "elastic_nb.launcher"  # python -m: the supervisor starts the zygote
LAUNCHER_AGENT = (
    "elastic_nb.launcher.torch_agent"  # what every launcher (a fork of the zygote) runs
)
RANK_BOOTSTRAP = "elastic_nb.rank.bootstrap"  # a one-off job's rank
RANK_SESSION_LOOP = "elastic_nb.rank.session_loop"  # a session's rank
WARMUP = "elastic_nb.launcher.warmup"  # what a fork server imports for every rank it forks
SERVER_EXTENSION = "elastic_nb.server"  # the Jupyter server extension (jupyter-config/ names it)

# What a fork of the zygote becomes (its fork request's environment says): a launcher (the
# default), or a multi-node group's rendezvous store (launcher/store_host.py).
ROLE_ENV = "ELASTIC_NB_LAUNCHER_ROLE"
STORE_ROLE = "store"
STORE_PORT_ENV = "ELASTIC_NB_STORE_PORT"  # the port the store serves on (0: a free one)

NAMED = (
    SUPERVISOR,
    LAUNCHER,
    LAUNCHER_AGENT,
    RANK_BOOTSTRAP,
    RANK_SESSION_LOOP,
    WARMUP,
    SERVER_EXTENSION,
)
