"""The Jupyter server extension: REST endpoints under ``/elastic-nb/api/`` through which the
JupyterLab panel lists, stops and inspects the jobs and sessions of every supervisor of this
user, without going through a kernel (a blocking %%elastic cell keeps its kernel busy).

Enabled on install by ``jupyter-config/jupyter_server_config.d/elastic_nb.json``.
"""

from __future__ import annotations

from typing import Any

from elastic_nb.common import modules

__all__ = ["_jupyter_server_extension_points"]


def _jupyter_server_extension_points() -> list[dict[str, str]]:
    return [{"module": modules.SERVER_EXTENSION}]


def _load_jupyter_server_extension(serverapp: Any) -> None:
    from elastic_nb.server.handlers import setup_handlers

    setup_handlers(serverapp.web_app)
    serverapp.log.info("elastic_nb: the Elastic jobs panel's API is at /elastic-nb/api/")
