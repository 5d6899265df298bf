"""The JupyterLab extension as a person uses it: a real `jupyter lab` serving the extension built
from this tree (and the server extension), a headless Chromium, real kernels and ranks.

The Elastic jobs panel acts on a job while a blocking `%%elastic` cell keeps its kernel busy
(a busy kernel does not hear widget clicks): its buttons go through the Jupyter server to the
supervisor. Screenshots go to test-output/browser/ (labext-*.png).
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from playwright.sync_api import expect

from tests.kernel import assert_job_gone, wait_for
from tests.lab import (
    LabServer,
    Notebook,
    browser_fixture,  # noqa: F401  (the fixture `browser`)
    page_fixture,  # noqa: F401  (the fixture `page`)
    serve,
)


@pytest.fixture(scope="module")
def lab(tmp_path_factory: pytest.TempPathFactory, cache_home: Path) -> Iterator[LabServer]:
    yield from serve(tmp_path_factory, cache_home, "lab")


PLAIN = "import os\nfor step in range(3):\n    print(step)\n"


@pytest.mark.parametrize(
    "magic",
    [
        "%%elastic --nproc 2",
        # A colon and a quote in the flags (an endpoint, an environment value) must not leave
        # the parser inside a block or a string for the cell's own lines.
        "%%elastic --nproc 2 --rdzv-endpoint localhost:29500 --env GREETING=it's",
    ],
)
def test_an_elastic_cell_keeps_python_highlighting(page: Any, lab: LabServer, magic: str) -> None:
    """The lines under `%%elastic` are highlighted as Python, as in a plain cell: each keyword
    carries the same highlighting class as there, drawn in the theme's keyword colour."""
    name = f"highlight-{abs(hash(magic)) % 10_000}.ipynb"
    nb = Notebook(page, lab, lab.write_notebook(name, [PLAIN, f"{magic}\n{PLAIN}"]))
    keyword_color = page.evaluate(
        """() => {
            const probe = document.createElement('span');
            probe.style.color = 'var(--jp-mirror-editor-keyword-color)';
            document.body.append(probe);
            const color = getComputedStyle(probe).color;
            probe.remove();
            return color;
        }"""
    )
    for word in ("import", "for", "in"):
        plain = _token(nb, 0, word)
        expect(plain).to_have_attribute("class", re.compile(r"\S"))  # highlighted, once loaded
        highlighted = plain.get_attribute("class")
        assert _color(plain) == keyword_color, (word, _color(plain), keyword_color)
        elastic = _token(nb, 1, word)
        expect(elastic).to_have_attribute("class", highlighted)
        assert _color(elastic) == keyword_color


def _token(nb: Notebook, cell: int, text: str) -> Any:
    """The editor's span for a token (the first with exactly this text)."""
    spans = nb.cell(cell).locator(".jp-InputArea-editor .cm-content span")
    return spans.filter(has_text=re.compile(rf"^{re.escape(text)}$")).first


def _color(locator: Any) -> str:
    return locator.evaluate("(e) => getComputedStyle(e).color")


_ = (assert_job_gone, wait_for)
