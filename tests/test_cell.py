"""Preparing a cell in the kernel: what travels, what is refused."""

from __future__ import annotations

import pickle
import threading
import types

import pytest

from elastic_nb.common.errors import CellError
from elastic_nb.kernel.cell import prepare_cell

pytestmark = pytest.mark.unit


def helper(v: int) -> int:
    return v + 1


def test_modules_functions_and_data_are_sorted_out() -> None:
    ns = {
        "np": types.ModuleType("numpy"),
        "helper": helper,
        "lr": 0.1,
        "local": 1,
        "_": "output history",
    }
    cell = "import os\nlocal = 2\nprint(np, helper(local), lr, os, _)\n"
    p = prepare_cell("--nproc 2", cell, ns)
    assert p.source == "# %%elastic --nproc 2\n" + cell
    assert p.meta["modules"] == {"np": "numpy"}
    assert p.meta["objects"] == ["helper"]
    assert p.meta["notebook_names"] == ["lr"]  # data, not shipped: the NameError hint names it
    assert pickle.loads(p.payload)["helper"](1) == 2


def test_display_of_the_last_expression() -> None:
    assert prepare_cell("", "x = 1\nx\n", {}).meta["display"]
    assert not prepare_cell("", "x = 1\nx;\n", {}).meta["display"]
    assert not prepare_cell("", "x = 1\nx;  # hidden\n", {}).meta["display"]
    assert not prepare_cell("", "x = 1\n", {}).meta["display"]
    assert prepare_cell("", "f(\n  1\n)\n", {}).meta["display"]


def test_syntax_error_has_the_cell_line() -> None:
    with pytest.raises(CellError) as info:
        prepare_cell("--nproc 2", "a = 1\nb = (\n", {})
    # The unclosed "(" is on the cell's line 3, counting the %%elastic line as line 1.
    assert str(info.value).endswith("'(' was never closed (cell line 3)")
    with pytest.raises(CellError, match=r"cell line 2"):
        prepare_cell("", "!ls\n", {})


def test_push_refusals_name_the_object() -> None:
    with pytest.raises(CellError, match="--push missing: no such name"):
        prepare_cell("", "1\n", {}, push=("missing",))
    with pytest.raises(CellError, match="--push lock: it cannot be pickled"):
        prepare_cell("", "lock\n", {"lock": threading.Lock()}, push=("lock",))


def test_pushed_values_travel_with_shipped_code() -> None:
    p = prepare_cell("", "helper(data)\n", {"helper": helper, "data": [1, 2]}, push=("data",))
    assert set(pickle.loads(p.payload)) == {"helper", "data"} and p.meta["pushed"] == ["data"]
