"""Turn a notebook cell into what the ranks run: checked source, shipped names, a payload.

Everything that can be wrong with a cell is found here, in the kernel, before anything
launches: a syntax error (reported with the cell's own line numbers), a ``--push`` name the
notebook does not have, an object that cannot be pickled.

Names the cell uses but does not define travel by themselves when they are code: modules are
re-imported by name in each rank; functions and classes pickle with cloudpickle (by value when
the notebook defined them, by reference when a module did). Other notebook data travels only
with ``--push``; the ranks are told which names the notebook had, so a NameError can say so.
"""

from __future__ import annotations

import ast
import builtins
import importlib.util
import inspect
import os
import re
import sys
import types
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from elastic_nb.common import pickling
from elastic_nb.common.errors import CellError

__all__ = ["PreparedCell", "explicit_timeouts", "notebook_modules", "prepare_cell"]

# The calls whose timeout= argument overrides --collective-timeout.
_GROUP_CALLS = frozenset({"init_process_group", "new_group", "new_subgroups", "init_device_mesh"})

# IPython's own names in the user namespace, beyond user_ns_hidden: its output and input history
# (_, __, ___, _7, _i, _ii, _i7, _ih, _oh, _dh) and helpers.
_IPYTHON_NAMES = frozenset({"In", "Out", "get_ipython", "exit", "quit"})
_IPYTHON_HISTORY = re.compile(r"_+|_\d+|_i+|_i\d+|_[iod]h")


@dataclass(frozen=True)
class PreparedCell:
    source: str  # what the ranks execute: line 1 is the magic line, as a comment
    meta: dict[str, Any]  # display, modules, objects, notebook_names
    payload: bytes | None  # cloudpickled {name: object}


def prepare_cell(
    line: str,
    cell: str,
    user_ns: Mapping[str, Any],
    hidden: Mapping[str, Any] | frozenset[str] = frozenset(),
    push: tuple[str, ...] = (),
) -> PreparedCell:
    # Keep the magic as line 1 so every line number matches the notebook cell.
    source = f"# %%elastic {line}".rstrip() + "\n" + cell
    tree = _parse(source)
    display = _displays_last_value(tree, source)

    missing = [n for n in push if n not in user_ns]
    if missing:
        raise CellError(
            f"--push {', '.join(missing)}: no such name in the notebook "
            f"({'it is' if len(missing) == 1 else 'they are'} defined nowhere the kernel can see)"
        )

    modules: dict[str, str] = {}
    shipped: dict[str, Any] = {}
    notebook_names: list[str] = []
    for name in sorted(_free_names(tree)):
        if name in push or name not in user_ns or name in hidden or name in _IPYTHON_NAMES:
            continue
        if _IPYTHON_HISTORY.fullmatch(name):
            continue
        value = user_ns[name]
        if isinstance(value, types.ModuleType):
            modules[name] = value.__name__
        elif inspect.isfunction(value) or inspect.isclass(value) or inspect.isbuiltin(value):
            shipped[name] = value
        else:
            notebook_names.append(name)
    objects = {**shipped, **{n: user_ns[n] for n in push}}
    payload = _pickle(objects, pushed=set(push)) if objects else None
    meta = {
        "magic_line": line,
        "display": display,
        "modules": modules,
        "objects": sorted(objects),
        "pushed": list(push),
        "notebook_names": notebook_names,
    }
    return PreparedCell(source=source, meta=meta, payload=payload)


def _parse(source: str) -> ast.Module:
    try:
        return ast.parse(source, filename="<%%elastic cell>")
    except SyntaxError as e:
        raise CellError.from_syntax_error(e) from None


def _displays_last_value(tree: ast.Module, source: str) -> bool:
    """Like IPython: a trailing expression is displayed unless its line ends with ';'."""
    if not tree.body or not isinstance(tree.body[-1], ast.Expr):
        return False
    node = tree.body[-1]
    lines = source.splitlines()
    end_line = lines[(node.end_lineno or node.lineno) - 1]
    rest = end_line[node.end_col_offset or 0 :]
    return not rest.lstrip().startswith(";")


def _free_names(tree: ast.Module) -> set[str]:
    """Names the cell reads and never binds anywhere (conservative: binding anywhere counts)."""
    loaded: set[str] = set()
    bound: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            (loaded if isinstance(node.ctx, ast.Load) else bound).add(node.id)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            bound.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for alias in node.names:
                bound.add((alias.asname or alias.name).split(".")[0])
        elif isinstance(node, ast.arg):
            bound.add(node.arg)
        elif isinstance(node, ast.ExceptHandler) and node.name:
            bound.add(node.name)
        elif isinstance(node, (ast.Global, ast.Nonlocal)):
            loaded.update(node.names)
    return loaded - bound - set(dir(builtins))


def _pickle(objects: dict[str, Any], pushed: set[str]) -> bytes:
    try:
        return pickling.dumps(objects)  # a GPU tensor travels on the CPU (see pickling.py)
    except Exception:
        pass
    # Find the culprit so the message names it.
    for name, value in objects.items():
        try:
            pickling.dumps(value)
        except Exception as e:
            if name in pushed:
                raise CellError(
                    f"--push {name}: it cannot be pickled, so it cannot travel to the ranks "
                    f"({type(e).__name__}: {e}). Create it inside the cell instead."
                ) from None
            raise CellError(
                f"the cell uses the notebook's {name!r}, which cannot be pickled to ship it to "
                f"the ranks ({type(e).__name__}: {e}). Define it inside the cell, or in a module "
                "the ranks can import."
            ) from None
    raise CellError("the cell's objects could not be pickled together (a shared unpicklable part)")


def explicit_timeouts(source: str) -> list[int]:
    """Lines (of `source`) that create a process group with an explicit ``timeout=``, which
    wins over --collective-timeout."""
    lines = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if name in _GROUP_CALLS and any(k.arg == "timeout" for k in node.keywords):
            lines.append(node.lineno)
    return sorted(lines)


def notebook_modules(source: str, cwd: str) -> tuple[str, ...]:
    """The notebook's own modules a cell on other machines needs: files or packages under the
    kernel's working directory (beside the notebook, not installed), that the cell imports or
    the notebook has imported (a function of theirs pickles by reference). Their paths; sent to
    every other node, first on its ranks' sys.path."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module.split(".")[0])
    names.update(n.split(".")[0] for n in list(sys.modules) if n and not n.startswith("_"))
    root = os.path.realpath(cwd)
    found: set[str] = set()
    for name in names:
        path = _local_module(name, root)
        if path is not None:
            found.add(path)
    return tuple(sorted(found))


def _local_module(name: str, root: str) -> str | None:
    module = sys.modules.get(name)
    origin = getattr(module, "__file__", None) if module is not None else None
    if origin is None and module is None:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            return None
        origin = spec.origin if spec is not None and spec.has_location else None
    if not origin:
        return None
    path = os.path.realpath(str(origin))
    if not path.startswith(root + os.sep) or "-packages" + os.sep in path:
        return None
    # A package travels whole (its directory); a module as its file.
    return os.path.dirname(path) if os.path.basename(path) == "__init__.py" else path
