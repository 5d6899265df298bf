"""No import cycle anywhere in the package: every import statement (at module level, inside
functions, under TYPE_CHECKING) is an edge; importing a package's own parent is not."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

PACKAGE = Path(__file__).resolve().parent.parent / "elastic_nb"


def _modules() -> dict[str, Path]:
    mods = {}
    for path in PACKAGE.rglob("*.py"):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = path
    return mods


def import_graph() -> dict[str, set[str]]:
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*up, base] if base else up)
                # `from pkg import mod` depends on pkg.mod; `from mod import name`, on mod.
                names = [
                    f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names
                ]
            for name in names:
                target = resolve(name)
                if target and target != mod and not mod.startswith(target + "."):
                    graph[mod].add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    done: set[str] = set()

    def visit(node: str, path: list[str]) -> list[str] | None:
        if node in path:
            return [*path[path.index(node) :], node]
        if node in done:
            return None
        for nxt in sorted(graph[node]):
            found = visit(nxt, [*path, node])
            if found:
                return found
        done.add(node)
        return None

    for node in sorted(graph):
        found = visit(node, [])
        if found:
            return found
    return None


def test_the_package_has_no_import_cycle() -> None:
    graph = import_graph()
    assert "elastic_nb.supervisor.runs.job" in graph and "elastic_nb.kernel.magic" in graph
    assert graph["elastic_nb.kernel.job_handle"] >= {
        "elastic_nb.kernel.client",
        "elastic_nb.common.protocol",
    }
    cycle = find_cycle(graph)
    assert cycle is None, " -> ".join(cycle)


def test_the_walker_sees_a_cycle() -> None:
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]


# ---- the walls between processes ------------------------------------------------------------

# Who may import whom, by the folder of the process that runs a module: a module may import its
# own folder and the folders listed. The package's root (__init__) is the kernel's entry point
# (load_ipython_extension); rank/ is imported by the launcher (its entry points) and never
# imports the kernel or the supervisor.
WALLS = {
    "elastic_nb": {"common", "kernel", "cli"},
    "common": set(),
    "kernel": {"common"},
    "rank": {"common"},
    "launcher": {"common", "rank"},
    "supervisor": {"common"},
    "server": {"common"},
    "checkpoint": {"common"},  # the cells' API, run in the ranks
    # the command line: `elastic-nb join` runs a join agent (the supervisor of its machine's
    # processes, supervisor/nodes/join_agent.py); `runs` and `logs` read run directories
    "cli": {"common", "supervisor"},
    "__main__": {"cli"},  # python -m elastic_nb: the command line
}
# Inside the supervisor: pure judgements import no part that does I/O; the parts that own
# processes and learn from ranks do not know jobs or sessions; the service knows everything.
SUPERVISOR_WALLS = {
    "forensics": {"ranks.rank_state"},
    "ranks": {"forensics", "processes.node"},
    # a node reports the agent as the zombie watchdog judges it
    "processes": {"ranks.rank_state", "forensics.watchdogs"},
    # other machines: a remote node (a second Node), the cluster of agents, the join agent (a
    # LocalNode of its own machine's)
    "nodes": {"processes", "ranks.rank_state", "forensics.watchdogs"},
    "runs": {"forensics", "ranks", "processes", "nodes"},
    "sessions": {"forensics", "ranks", "processes", "runs"},
    "service": {"forensics", "ranks", "processes", "runs", "sessions", "overview", "nodes"},
    "overview": {"ranks", "runs", "sessions"},
    "__main__": {"service"},
}


def _folder(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else "elastic_nb"


def _allowed(src: str, dst: str) -> bool:
    a, b = _folder(src), _folder(dst)
    if b == "elastic_nb":
        return False  # the root is an entry point, not a library
    if a == b and a != "supervisor":
        return True
    if b not in WALLS[a] and a != b:
        return False
    if a == "supervisor" == b:
        inner_a = src.split(".")[2] if src.count(".") >= 2 else "__init__"
        inner_b = ".".join(dst.split(".")[2:]) or "__init__"
        if inner_a == inner_b.split(".")[0] or inner_b == "__init__":
            return True
        allowed = SUPERVISOR_WALLS.get(inner_a, set())
        return any(inner_b == x or inner_b.startswith(x + ".") for x in allowed)
    return True


def test_no_import_crosses_a_process_wall() -> None:
    graph = import_graph()
    crossing = sorted(
        f"{src} -> {dst}" for src, dsts in graph.items() for dst in dsts if not _allowed(src, dst)
    )
    assert not crossing, "imports across a wall:\n" + "\n".join(crossing)


def test_the_walls_catch_a_crossing() -> None:
    assert not _allowed("elastic_nb.rank.bootstrap", "elastic_nb.kernel.flags")
    assert not _allowed("elastic_nb.common.spec", "elastic_nb.kernel.flags")
    assert not _allowed("elastic_nb.server.supervisors", "elastic_nb.kernel.client")
    assert not _allowed("elastic_nb.supervisor.sessions.session", "elastic_nb.rank.session_loop")
    assert not _allowed("elastic_nb.supervisor.forensics.verdict", "elastic_nb.supervisor.runs.job")
    assert not _allowed("elastic_nb.supervisor.runs.job", "elastic_nb.supervisor.sessions.session")
    assert _allowed("elastic_nb.supervisor.runs.job", "elastic_nb.supervisor.ranks.rank_book")
    assert _allowed("elastic_nb.launcher.agent", "elastic_nb.rank.bootstrap")


def test_only_the_process_parts_of_the_supervisor_touch_processes() -> None:
    """Every per-rank OS operation goes through a node (supervisor/processes/node.py): no other
    part of the supervisor imports process ownership (common.procs) or psutil."""
    touching = []
    for mod, path in _modules().items():
        if not mod.startswith("elastic_nb.supervisor.") or ".processes" in mod:
            continue
        if mod in ("elastic_nb.supervisor.service", "elastic_nb.supervisor.nodes.join_agent"):
            # the supervisor's own process (subreaper, its kernel's lifeline), and a join
            # agent's (the subreaper of its machine's launchers)
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [f"{node.module}.{a.name}" for a in node.names]
            if any(n == "psutil" or n.endswith("common.procs") for n in names):
                touching.append(mod)
    assert not touching, (
        f"supervisor modules that touch processes directly: {sorted(set(touching))}"
    )


def test_module_names_that_travel_as_strings_come_from_one_place_and_import() -> None:
    import importlib

    from elastic_nb.common import modules

    for name in modules.NAMED:
        importlib.import_module(name)
    strays = []
    for mod, path in _modules().items():
        if mod == "elastic_nb.common.modules":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.Constant)
                and isinstance(node.value, str)
                and node.value.startswith("elastic_nb.")
                and " " not in node.value
            ):
                strays.append(f"{mod}: {node.value}")
    assert not strays, f"module names as strings outside common/modules.py: {strays}"


def test_every_module_name_is_unique_in_the_package() -> None:
    """A name says what a module is, once: no two modules of the package share one."""
    names: dict[str, list[str]] = {}
    for mod, path in _modules().items():
        if path.name not in ("__init__.py", "__main__.py"):
            names.setdefault(path.stem, []).append(mod)
    assert not {n: m for n, m in names.items() if len(m) > 1}
