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


def _imported(mod: str, is_package: bool, node: ast.AST) -> list[str]:
    """The absolute names an import statement names: `import a.b` -> a.b; `from a import b`
    (or its relative form) -> a.b, whether b is a module or a name in a."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if not isinstance(node, ast.ImportFrom):
        return []
    base = node.module or ""
    if node.level:
        package = mod if is_package else mod.rpartition(".")[0]
        up = package.split(".")[: len(package.split(".")) - node.level + 1]
        base = ".".join([*up, base] if base else up)
    return [f"{base}.{a.name}" for a in node.names]


def import_graph() -> dict[str, set[str]]:
    mods = _modules()

    def resolve(name: str) -> str | None:
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph: dict[str, set[str]] = {m: set() for m in mods}
    for mod, path in mods.items():
        for node in ast.walk(ast.parse(path.read_text())):
            # `from pkg import mod` depends on pkg.mod; `from mod import name`, on mod.
            for name in _imported(mod, path.name == "__init__.py", node):
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
        "elastic_nb.protocol",
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
    "elastic_nb": {"common", "protocol", "kernel", "cli"},
    "protocol": set(),  # the messages between processes: every process's, importing no other
    "common": {"protocol"},
    "kernel": {"common", "protocol"},
    "rank": {"common", "protocol"},
    "launcher": {"common", "protocol", "rank"},
    "supervisor": {"common", "protocol"},
    "server": {"common", "protocol"},
    "checkpoint": {"common", "protocol"},  # the cells' API, run in the ranks
    # a join agent, another machine's: what it shares with the notebook's supervisor, only
    # (JOIN_AGENT_SHARES)
    "join_agent": {"common", "protocol", "supervisor"},
    # the command line: `elastic-nb join` runs a join agent (join_agent/agent.py; its token's
    # errors are the channel's); `runs` and `logs` read run directories
    "cli": {"common", "protocol", "supervisor", "join_agent"},
    "__main__": {"cli"},  # python -m elastic_nb: the command line
}
# Inside the supervisor: pure judgements import no part that does I/O; the parts that own
# processes and learn from ranks do not know jobs or sessions; the service knows everything.
SUPERVISOR_WALLS = {
    "forensics": set(),
    # a rank's site; and the pid at the other end of a session rank's connection
    "ranks": {"forensics", "processes.site", "processes.peers"},
    # a site reports the agent as the zombie watchdog judges it
    "processes": {"forensics.watchdogs"},
    # other machines: a remote site (a second Site), the cluster of agents
    "nodes": {"processes", "forensics.watchdogs"},
    "runs": {"forensics", "ranks", "processes", "nodes"},
    "sessions": {"forensics", "ranks", "processes", "runs"},
    # the kernel's jobs and sessions: where each runs, started, stopped, listed
    "roster": {"processes", "runs", "sessions", "nodes"},
    "service": {
        "forensics",
        "ranks",
        "processes",
        "runs",
        "sessions",
        "overview",
        "nodes",
        "roster",
    },
    "overview": {"ranks", "runs", "sessions"},
    "__main__": {"service"},
}
# What a join agent's process shares with the notebook's supervisor: the channel between them,
# the files they exchange, the ownership of its machine's processes (a LocalSite, the launcher
# pool). The rank record the sites keep is below both (common/rank_state.py).
JOIN_AGENT_SHARES = ("nodes.channel", "nodes.files", "processes")


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
    if a == "join_agent" and b == "supervisor":
        inner = ".".join(dst.split(".")[2:])
        return any(inner == x or inner.startswith(x + ".") for x in JOIN_AGENT_SHARES)
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
    assert _allowed("elastic_nb.launcher.torch_agent", "elastic_nb.rank.bootstrap")


# ---- processes are the supervisor's process parts' business -------------------------------------

# What owning a process looks like in a module: these imported in any form (`import psutil`,
# `from psutil import Process`, `from elastic_nb.common.procs import orphans`, relative too),
# a signal sent by os.kill/os.killpg, a pidfd, /proc read, a socket's peer credentials.
_PROCESS_MODULES = ("psutil", "elastic_nb.common.procs")
_PROCESS_CALLS = ("os.kill", "os.killpg")
_PROCESS_WORD = "pidfd"  # in any identifier: os.pidfd_open, signal.pidfd_send_signal, procs'
_PROCESS_TEXT = "/proc"  # in any string but a docstring
_PROCESS_ATTRS = ("SO_PEERCRED",)

# The supervisors' modules (the notebook's, and a join agent's: its machine's) outside
# supervisor/processes/ that may touch a process anyway, each touch by itself, with why. Anything
# else found there fails the test below.
_SUPERVISORS = ("elastic_nb.supervisor", "elastic_nb.join_agent")
PROCESS_EXCEPTIONS = {
    ("elastic_nb.supervisor.service", "elastic_nb.common.procs"): (
        "the supervisor's own process: it makes itself a subreaper, watches its kernel's pid "
        "(its lifeline) and reaps the orphans it inherits"
    ),
    ("elastic_nb.supervisor.service", "psutil"): (
        "the orphans it inherits as a subreaper, as psutil processes, handed to each LocalSite"
    ),
    ("elastic_nb.supervisor.service", "pidfd"): "its kernel's pidfd: the lifeline it waits on",
    ("elastic_nb.supervisor.service", "os.kill"): (
        "os.kill(kernel, 0): whether its kernel lives, where no pidfd can be had"
    ),
    ("elastic_nb.join_agent.agent", "elastic_nb.common.procs"): (
        "a join agent is its machine's supervisor process: it makes itself the subreaper of "
        "its launchers and reaps the orphans it inherits, as service does"
    ),
    ("elastic_nb.join_agent.agent", "psutil"): (
        "its own process's one TCP connection to the supervisor: the address its machine is "
        "reached at (zmq does not tell a socket's local end)"
    ),
}


def _docstrings(tree: ast.AST) -> set[int]:
    found = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if (
            isinstance(body, list)
            and body
            and isinstance(body[0], ast.Expr)
            and isinstance(body[0].value, ast.Constant)
        ):
            found.add(id(body[0].value))
    return found


def process_touches(mod: str, source: str, is_package: bool = False) -> set[str]:
    """What in a module's source touches a process (the kinds above), each as it is named."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    found: set[str] = set()
    for node in ast.walk(tree):
        for name in _imported(mod, is_package, node):
            if any(name == m or name.startswith(m + ".") for m in _PROCESS_MODULES):
                found.add(name)
            if name in _PROCESS_CALLS:
                found.add(name)
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and f"{node.value.id}.{node.attr}" in _PROCESS_CALLS
        ):
            found.add(f"{node.value.id}.{node.attr}")
        identifiers = []
        if isinstance(node, ast.Name):
            identifiers = [node.id]
        elif isinstance(node, ast.Attribute):
            identifiers = [node.attr]
        elif isinstance(node, ast.alias):
            identifiers = [node.name, node.asname or ""]
        elif isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
            identifiers = [node.name]
        for ident in identifiers:
            if _PROCESS_WORD in ident.lower():
                found.add(_PROCESS_WORD)
            if ident in _PROCESS_ATTRS:
                found.add(ident)
        if (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and _PROCESS_TEXT in node.value
            and id(node) not in docs
        ):
            found.add(_PROCESS_TEXT)
    return found


def process_crossings(mod: str, source: str, is_package: bool = False) -> list[str]:
    """The touches of a supervisor module outside supervisor/processes/ that no exception
    allows."""
    if not mod.startswith(_SUPERVISORS) or mod.startswith("elastic_nb.supervisor.processes"):
        return []
    return sorted(
        f"{mod}: {what}"
        for what in process_touches(mod, source, is_package)
        if (mod, what) not in PROCESS_EXCEPTIONS
    )


def test_only_the_process_parts_of_the_supervisor_touch_processes() -> None:
    """Every per-rank OS operation goes through a site (supervisor/processes/site.py): no other
    part of the supervisor imports process ownership (common.procs, psutil), signals a pid,
    opens a pidfd, reads /proc or a peer's credentials, but for the exceptions listed, each
    with its reason."""
    crossing = []
    touched = set()
    for mod, path in _modules().items():
        source = path.read_text()
        crossing += process_crossings(mod, source, path.name == "__init__.py")
        touched |= {(mod, what) for what in process_touches(mod, source)}
    assert not crossing, "supervisor modules that touch processes directly:\n" + "\n".join(crossing)
    # An exception nobody needs any more goes: it would let the next such touch in unseen.
    assert set(PROCESS_EXCEPTIONS) <= touched, set(PROCESS_EXCEPTIONS) - touched


def test_the_process_guard_catches_a_crossing() -> None:
    job = "elastic_nb.supervisor.runs.job"
    crossings = {
        "from elastic_nb.common.procs import job_processes": "elastic_nb.common.procs",
        "from ...common.procs import orphans": "elastic_nb.common.procs",
        "from ...common import procs": "elastic_nb.common.procs",
        "import psutil": "psutil",
        "from psutil import Process": "psutil",
        "import os\nos.kill(1, 0)": "os.kill",
        "from os import killpg": "os.killpg",
        "import os\nfd = os.pidfd_open(1)": "pidfd",
        "open(f'/proc/{pid}/stat')": "/proc",
        "s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, 12)": "SO_PEERCRED",
    }
    for source, what in crossings.items():
        found = process_crossings(job, source)
        assert len(found) == 1 and found[0].startswith(f"{job}: {what}"), (source, found)
    # Where it is allowed: the process parts; a docstring that only speaks of /proc.
    assert not process_crossings("elastic_nb.supervisor.processes.site", "import psutil")
    assert not process_crossings(job, '"""Reads nothing from /proc."""\n')
    # An exception is for its module and its touch only.
    assert not process_crossings("elastic_nb.supervisor.service", "import psutil")
    assert process_crossings("elastic_nb.supervisor.service", "from os import killpg")
    assert process_crossings("elastic_nb.supervisor.runs.job", "x = socket.SO_PEERCRED")


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


def test_the_layout_page_is_the_tree() -> None:
    """The contributing page's Layout names every module of the package (its name is unique:
    test above), and no module that is not there any more."""
    import re

    from tests.docs_pages import section

    layout = section("contributing", "Layout").split("\n```\n", 2)[1]
    layout = layout.split("\nnotebooks/", 1)[0]  # the package's part (tests/, scripts/ follow)
    named = set(re.findall(r"\b(\w+)\.py\b", layout))
    modules = {p.stem for p in PACKAGE.rglob("*.py") if p.stem not in ("__init__", "__main__")}
    assert modules - named == set(), "modules the Layout does not name"
    assert named - modules - {"__init__"} == set(), "the Layout names modules that are gone"
