"""Which renderer a cell gets: the dashboard where the frontend draws widgets, text elsewhere."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from elastic_nb.dashboard.widget import SEND_EVERY_S
from elastic_nb.magic import widgets_frontend
from tests.kernel import Kernel, assert_job_gone

WIDGET = "application/vnd.jupyter.widget-view+json"


@pytest.mark.parametrize(
    ("env", "kernel", "expected"),
    [
        ({}, True, False),  # nbclient, nbconvert, papermill: no widget manager
        ({"JPY_SESSION_NAME": "a.ipynb"}, True, True),  # JupyterLab, Notebook 7
        ({"VSCODE_PID": "123"}, True, True),  # VS Code's Jupyter extension
        ({"VSCODE_CWD": "/home/me"}, True, True),  # VS Code in WSL or a container
        ({"JPY_SESSION_NAME": "a.ipynb"}, False, False),  # terminal IPython
        ({"JPY_SESSION_NAME": "a.ipynb", "ELASTIC_NB_WIDGETS": "0"}, True, False),
        ({"ELASTIC_NB_WIDGETS": "1"}, True, True),
    ],
)
def test_the_frontend_rule(
    monkeypatch: pytest.MonkeyPatch, env: dict[str, str], kernel: bool, expected: bool
) -> None:
    for name in ("JPY_SESSION_NAME", "VSCODE_PID", "VSCODE_CWD", "ELASTIC_NB_WIDGETS"):
        monkeypatch.delenv(name, raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    shell = SimpleNamespace(kernel=object() if kernel else None)
    assert widgets_frontend(shell) is expected


@pytest.fixture(scope="module")
def widget_kernel(tmp_path_factory: pytest.TempPathFactory, cache_home: Path) -> Iterator[Kernel]:
    k = Kernel(
        str(tmp_path_factory.mktemp("nb")),
        env={"XDG_CACHE_HOME": str(cache_home), "ELASTIC_NB_WIDGETS": "1"},
    )
    k.ok("%load_ext elastic_nb")
    yield k
    k.shutdown()


def _widget_traffic(messages: list[dict[str, Any]]) -> tuple[list[Any], list[Any]]:
    shown = [
        m for m in messages if m["msg_type"] == "display_data" and WIDGET in m["content"]["data"]
    ]
    deltas = [
        m["content"]["data"]["content"]
        for m in messages
        if m["msg_type"] == "comm_msg" and m["content"]["data"].get("method") == "custom"
    ]
    return shown, deltas


def test_a_widget_frontend_gets_the_dashboard_and_a_text_record(widget_kernel: Kernel) -> None:
    ex = widget_kernel.ok(
        "%%elastic --nproc 2\nimport os\nprint('hello from', os.environ['RANK'])\n"
    )
    shown, deltas = _widget_traffic(ex.messages)
    assert len(shown) == 1
    lines = [t for d in deltas for _, stream, texts in d.get("lines", ()) for t in texts]
    assert {"hello from 0", "hello from 1"} <= set(lines)  # in the dashboard...
    assert "[rank 0]" not in ex.stdout  # ...not as text,
    assert f"[elastic_nb] job {ex.job_id}: starting 2 ranks" in ex.stdout  # but the record is
    assert f"[elastic_nb] job {ex.job_id} succeeded · 2 ranks" in ex.stdout
    assert deltas[-1]["header"]["state"] == "succeeded"
    assert len(deltas) <= ex.seconds / SEND_EVERY_S + 2  # one message per tick at most
    assert_job_gone(ex.job_id)


def test_no_widgets_is_plain_text_everywhere(widget_kernel: Kernel) -> None:
    ex = widget_kernel.ok("%%elastic --nproc 1 --no-widgets\nprint('plain')\n")
    shown, deltas = _widget_traffic(ex.messages)
    assert not shown and not deltas
    assert "[rank 0] plain" in ex.stdout
    assert_job_gone(ex.job_id)


def test_a_background_job_is_displayed_as_its_dashboard(widget_kernel: Kernel) -> None:
    ex = widget_kernel.ok("%%elastic --bg --nproc 1\nprint('later')\n")
    (result,) = [m for m in ex.messages if m["msg_type"] == "execute_result"]
    assert WIDGET in result["content"]["data"]
    assert result["content"]["data"]["text/plain"].startswith("<elastic_nb job ")
    widget_kernel.ok("job = _")
    widget_kernel.ok("job.wait(timeout=120)")
    assert_job_gone(result["content"]["data"]["text/plain"].split()[2])
