"""elastic_nb: run a notebook cell on N torch.distributed ranks, with clean failures.

    %load_ext elastic_nb

    %%elastic --nproc 4
    <training code>

The package's top level stays light: every rank imports it (the worker bootstrap lives here),
so torch, IPython and anyio load only where they are used.
"""

from __future__ import annotations

from typing import Any

from elastic_nb.common.errors import (
    CellError,
    ElasticError,
    JobFailed,
    JobStopped,
    JobTimeout,
    SupervisorDied,
)

__all__ = [
    "CellError",
    "ElasticError",
    "JobFailed",
    "JobStopped",
    "JobTimeout",
    "SupervisorDied",
    "load_ipython_extension",
    "unload_ipython_extension",
]

__version__ = "0.1.0"


def load_ipython_extension(ipython: Any) -> None:
    from elastic_nb.kernel.client import start_in_background
    from elastic_nb.kernel.magic import ElasticMagics

    ipython.register_magics(ElasticMagics)
    start_in_background()  # so that the first cell finds torch imported and a launcher ready


def _jupyter_labextension_paths() -> list[dict[str, str]]:
    """Where the built JupyterLab extension is, for `jupyter labextension develop`."""
    return [{"src": "labextension", "dest": "elastic-nb"}]


def unload_ipython_extension(ipython: Any) -> None:
    from elastic_nb.kernel.client import shutdown_client

    shutdown_client()
