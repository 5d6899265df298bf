"""Which renderer a cell gets: the dashboard where the frontend draws widgets, text elsewhere."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from elastic_nb.kernel.magic import widgets_frontend
from tests.kernel import Kernel, assert_job_gone

pytestmark = pytest.mark.e2e

WIDGET = "application/vnd.jupyter.widget-view+json"
# docs/howto/dashboard.md: "The kernel sends the dashboard at most one message per 0.2 s".
SEND_EVERY_S = 0.2


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


def test_a_widget_frontend_gets_the_dashboard_and_the_summary_line(widget_kernel: Kernel) -> None:
    ex = widget_kernel.ok(
        "%%elastic --nproc 2\nimport os\nprint('hello from', os.environ['RANK'])\n"
    )
    shown, deltas = _widget_traffic(ex.messages)
    assert len(shown) == 1
    lines = [t for d in deltas for _, stream, texts in d.get("lines", ()) for t in texts]
    assert {"hello from 0", "hello from 1"} <= set(lines)  # in the dashboard...
    assert "[rank 0]" not in ex.stdout  # ...not as text.
    # The start line is the dashboard's text (what is shown where widgets are not), the
    # summary line the only text printed under it: each said once.
    start = f"[elastic_nb] job {ex.job_id}: starting 2 ranks"
    assert shown[0]["content"]["data"]["text/plain"].startswith(start)
    assert ex.stdout == f"{_summary_of(ex.stdout, ex.job_id, 'succeeded · 2 ranks')}\n"
    assert deltas[-1]["header"]["state"] == "succeeded"
    assert len(deltas) <= ex.seconds / SEND_EVERY_S + 2  # one message per tick at most
    assert_job_gone(ex.job_id)


PAUSED_TOO_LONG = """%%elastic --nproc 2 --collective-timeout 3
import torch, torch.distributed as dist
dist.init_process_group("gloo")
if dist.get_rank() == 1:
    breakpoint()
dist.all_reduce(torch.ones(1))
"""


def test_the_dashboard_stays_live_at_a_prompt_and_the_jobs_end_ends_the_wait(
    widget_kernel: Kernel,
) -> None:
    """Rank 1 at its breakpoint and nobody answers; rank 0 waits for it in an all_reduce
    whose 3 s timeout torch cannot extend. While the input box waits, the dashboard goes on:
    rank 0's chip says it waits for rank 1 and when its timeout runs out. When it does, the
    job fails, and the cell ends without an answer (the prompt's rank is gone)."""
    ex = widget_kernel.debug(PAUSED_TOO_LONG, lambda prompt, ex: None, timeout=90)
    assert ex.prompts == ["[rank 1] (Pdb) "]
    assert ex.ename == "JobFailed", ex.stderr
    _, deltas = _widget_traffic(ex.messages)
    # (the kernel's clock when the delta was sent, its chip for rank 0)
    chips = [(d["now"], d["ranks"]["0"]) for d in deltas if "0" in d.get("ranks", {})]
    waiting = [(now, c) for now, c in chips if c["state"] == "waiting"]
    assert waiting, chips
    now, chip = waiting[0]
    assert chip["label"].startswith("waiting for rank 1 (paused) in all_reduce #"), chip
    assert 0 < chip["expires"] - now <= 3, (now, chip)
    assert deltas[-1]["header"]["state"] == "failed"
    assert_job_gone(ex.job_id)


def _summary_of(stdout: str, job: str, what: str) -> str:
    """The summary line of `job` in `stdout`, which must hold it once."""
    lines = [line for line in stdout.splitlines() if line.startswith(f"[elastic_nb] job {job} ")]
    assert len(lines) == 1 and lines[0].startswith(f"[elastic_nb] job {job} {what}"), stdout
    return lines[0]


FAILING = (
    "%%elastic --nproc 2\n"
    "import torch, torch.distributed as dist\n"
    "dist.init_process_group()\n"
    "if dist.get_rank() == 1:\n"
    "    raise ValueError('rank 1 ran out of patience')\n"
    "dist.all_reduce(torch.ones(1))\n"
)


def test_a_saved_notebook_read_without_widgets_says_each_thing_once(
    tmp_path: Path, cache_home: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A notebook run where widgets are drawn and saved without their state (JupyterLab's
    default), then read where widgets are not drawn: nbconvert's HTML falls back to each
    output's text, as GitHub and nbviewer do. Each cell's outputs say its start line once, its
    summary once, and a failing rank's traceback once."""
    import html

    import nbformat
    from nbclient import NotebookClient
    from nbconvert import HTMLExporter

    monkeypatch.setenv("ELASTIC_NB_WIDGETS", "1")
    nb = nbformat.v4.new_notebook()
    nb.cells = [
        nbformat.v4.new_code_cell(src)
        for src in ("%load_ext elastic_nb", FAILING, "%%elastic --nproc 2\nprint('hi')\n6 * 7\n")
    ]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3"}
    client = NotebookClient(
        nb,
        timeout=180,
        kernel_name="python3",
        allow_errors=True,
        store_widget_state=False,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()
    body, _ = HTMLExporter(exclude_input=True).from_notebook_node(nb)
    text = html.unescape(re.sub(r"<[^>]+>", "", body))
    jobs = []
    for cell, outcome in ((nb.cells[1], "failed · cause: exception"), (nb.cells[2], "succeeded")):
        (shown,) = [o for o in cell.outputs if o.output_type == "display_data"]
        assert WIDGET in shown.data  # the dashboard was there
        start = re.match(
            r"\[elastic_nb\] job ([0-9a-f]{8}): starting 2 ranks \(", shown.data["text/plain"]
        )
        assert start, shown.data["text/plain"]
        job = start.group(1)
        jobs.append(job)
        assert text.count(start.group(0)) == 1
        assert text.count(f"[elastic_nb] job {job} {outcome} · 2 ranks") == 1
        assert text.count(f"[elastic_nb] job {job}") == 2  # the start and the summary: no more
    assert text.count("raise ValueError('rank 1 ran out of patience')") == 1  # the error's
    assert text.count("JobFailed: rank 1 failed first: ValueError") == 1
    assert "42" in nb.cells[2].outputs[-1].data["text/plain"]
    for job in jobs:
        assert_job_gone(job)


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
