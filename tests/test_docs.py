"""The docs are checked like code: every `--flag`, `%elastic COMMAND` and `elastic-nb COMMAND`
the README, the docs' pages and the notebooks name exists; the reference pages are generated
from the declarations, and the built pages have a row for every declared flag and command (with
its declared default) and for nothing else; and the site builds and reads in a real Chromium
(`make docs`, which CI runs, builds it with the notebooks run and every warning an error)."""

from __future__ import annotations

import argparse
import functools
import http.server
import json
import re
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from elastic_nb.cli import command_line
from elastic_nb.kernel.commands import COMMANDS
from elastic_nb.kernel.options import OPTIONS, shown_default

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"

# Other tools' flags the docs name in code spans, and whose they are.
OTHERS = {
    "--device": "benchmarks/ scripts (P1, P2 and P6 on a GPU: --device cuda)",
    "--no-index": "pip's (the GPU machine installs wheels with no package registry)",
    "--allow-errors": "jupyter nbconvert's (a headless run that goes on past a failed cell)",
}


def _texts() -> dict[str, str]:
    """Every document a user reads, by its path: markdown as written, a notebook's cells."""
    texts = {"README.md": (ROOT / "README.md").read_text()}
    for page in DOCS.rglob("*.md"):
        if "_build" not in page.parts:
            texts[str(page.relative_to(ROOT))] = page.read_text()
    for nb in (ROOT / "notebooks").glob("*.ipynb"):
        cells = json.loads(nb.read_text())["cells"]
        texts[str(nb.relative_to(ROOT))] = "\n".join("".join(c["source"]) for c in cells)
    return texts


def _subcommands() -> dict[str, argparse.ArgumentParser]:
    parser = command_line()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    return dict(sub.choices)


def _declared_flags() -> set[str]:
    """The %%elastic flags, the %elastic commands' own, and the command line's."""
    flags = {f for o in OPTIONS for f in o.spellings}
    flags |= {f for c in COMMANDS.values() for f in re.findall(r"--[a-z][a-z0-9-]*", c.args)}
    for parser in _subcommands().values():
        flags |= {f for a in parser._actions for f in a.option_strings}
    return flags


def named(text: str) -> tuple[set[str], set[str], set[str]]:
    """The flags, %elastic commands and elastic-nb commands a text names: a flag on a
    `%%elastic` line or opening a code span; a command in code (a span, a block's line)."""
    flags: set[str] = set()
    for line in re.findall(r"^\s*%%elastic\b.*$", text, re.M):
        flags |= set(re.findall(r"(?<![\w-])--[a-z][a-z0-9_-]*", line))
    flags |= set(re.findall(r"`(--[a-z][a-z0-9_-]*)", text))
    commands = set(re.findall(r"(?:^|`)\s*%elastic ([a-z][a-z-]*)", text, re.M))
    cli = set(re.findall(r"(?:^|`|\$ )elastic-nb ([a-z]+)(?![\w.])", text, re.M))
    return flags, commands, cli


@pytest.mark.unit
def test_what_the_docs_name_is_declared() -> None:
    flags, subcommands = _declared_flags() | set(OTHERS), _subcommands()
    unknown = []
    for where, text in _texts().items():
        f, c, cli = named(text)
        unknown += [f"{where}: {x}" for x in sorted(f - flags)]
        unknown += [f"{where}: %elastic {x}" for x in sorted(c - COMMANDS.keys())]
        unknown += [f"{where}: elastic-nb {x}" for x in sorted(cli - subcommands.keys())]
    assert not unknown, "named in the docs, declared nowhere:\n" + "\n".join(unknown)


@pytest.mark.unit
def test_the_check_sees_what_it_checks() -> None:
    """Not vacuous: the words it looks for are found where a reader would see them, and a
    misspelt one would be caught."""
    flags, commands, cli = named(
        "%%elastic --nproc 2 --colective-timeout 5\n`%elastic up --nproc 2`, `elastic-nb joins`"
    )
    assert flags == {"--nproc", "--colective-timeout"} and commands == {"up"}
    assert cli == {"joins"} and "--colective-timeout" not in _declared_flags()
    everything = [named(t) for t in _texts().values()]
    assert set().union(*(c for _, c, _ in everything)) >= {"up", "down", "debug", "join-command"}
    assert set().union(*(x for _, _, x in everything)) >= {"join", "runs", "logs"}


@pytest.mark.unit
def test_the_readmes_figures_are_the_benchmarks_latest() -> None:
    """The README's figures beside torchrun are those of benchmarks/README.md's latest results
    (which `make bench` rewrites): each median and ratio as that table's row gives it."""
    readme = (ROOT / "README.md").read_text()
    table = readme.split("\n## Beside torchrun\n", 1)[1].split("\n## ", 1)[0]
    rows = [
        [c.strip() for c in r.strip("|").split("|")]
        for r in re.findall(r"^\|.*\(P\w+\) \|.*$", table, re.M)
    ]
    assert len(rows) == 3
    latest = (ROOT / "benchmarks" / "README.md").read_text().split("<!-- results -->", 1)[1]
    for what, ours, theirs, ratio in rows:
        key = re.search(r"\((P\w+)\)$", what).group(1)  # type: ignore[union-attr]
        measured = next(r for r in latest.splitlines() if r.startswith(f"| {key} "))
        cells = [c.strip() for c in measured.strip("|").split("|")]
        assert cells[1].startswith(ours.split(",")[0] + " ("), (key, cells[1])
        assert cells[2].startswith(theirs.split(",")[0] + " ("), (key, cells[2])
        assert cells[3] == ratio.replace("×", "x"), (key, cells[3])


@pytest.mark.unit
def test_the_readmes_links_lead_somewhere() -> None:
    """The README is read on a code host, where its links are the repository's paths: each
    relative one names a file of the repository (a page's anchor aside)."""
    readme = (ROOT / "README.md").read_text()
    targets = re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", readme)
    relative = [t for t in targets if not re.match(r"[a-z]+://", t)]
    assert len(relative) > 20  # the docs' pages, the notebooks, the picture
    assert [t for t in relative if not (ROOT / t).is_file()] == []


@pytest.mark.unit
def test_the_reference_pages_are_generated() -> None:
    """Each reference page is its directive (nothing in it written by hand), and every
    directive the docs' extension declares has its page."""
    pages = {p.stem: p.read_text() for p in (DOCS / "reference").glob("*.md")}
    for page, directive in {
        "flags": "elastic-nb-flags",
        "commands": "elastic-nb-commands",
        "cli": "elastic-nb-cli",
        "rundir": "elastic-nb-rundir",
        "rest": "elastic-nb-rest",
    }.items():
        assert "{" + directive + "}" in pages[page], page
    declared = re.findall(
        r'add_directive\("([a-z-]+)"', (DOCS / "_ext" / "elastic_nb_docs.py").read_text()
    )
    assert len(declared) == 5


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """The site, built as `make docs` builds it but for running the notebooks (their pages show
    what they hold: `make docs` runs them), served over HTTP."""
    from sphinx.cmd.build import build_main

    out = tmp_path_factory.mktemp("site")
    code = build_main(
        [
            "-W",
            "--keep-going",
            "-q",
            "-b",
            "html",
            "-D",
            "nb_execution_mode=off",
            str(DOCS),
            str(out),
        ]
    )
    assert code == 0, "the docs site did not build cleanly"
    handler = functools.partial(http.server.SimpleHTTPRequestHandler, directory=str(out))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


@pytest.fixture
def page() -> Iterator[Any]:
    from playwright.sync_api import sync_playwright

    from tests.lab import CHROMIUM, CHROMIUM_ARGS

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, headless=True, args=CHROMIUM_ARGS)
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        errors: list[str] = []
        page.on("pageerror", lambda e: errors.append(e.message))
        yield page
        browser.close()
    assert not errors, errors


@pytest.mark.browser
def test_the_site_reads_and_finds_a_flag(site: str, page: Any) -> None:
    from playwright.sync_api import expect

    from tests.lab import shot

    page.goto(f"{site}/index.html")
    expect(page.locator("h1")).to_have_text(re.compile(r"^elastic_nb"))
    for link in ("Install", "Tutorials", "How-to guides", "Explanation", "Reference"):
        expect(page.locator(".sidebar-tree").get_by_role("link", name=link)).to_be_visible()
    shot(page, page.locator("article"), "docs-index.png")

    # Every declared flag and command has its row in the reference, with the declared default,
    # and no row names one that is not declared.
    page.goto(f"{site}/reference/flags.html")
    rows = page.locator("table.elastic-nb-ref tbody tr").evaluate_all(
        "rows => rows.map(r => [...r.querySelectorAll('td')].map(td => td.innerText.trim()))"
    )
    shown = {}
    for o in OPTIONS:
        flags = list(o.spellings)
        if o.metavar:
            flags[0] = f"{flags[0]} {o.metavar}"
        shown[", ".join(flags)] = shown_default(o)
    assert {cells[0]: cells[1] for cells in rows} == shown
    page.goto(f"{site}/reference/commands.html")
    listed = page.locator("table.elastic-nb-ref tbody tr td:first-child code").all_inner_texts()
    assert sorted(c.split()[1] for c in listed) == sorted(COMMANDS)

    page.goto(f"{site}/reference/flags.html")
    row = page.locator(
        "tr", has=page.locator("code", has_text=re.compile(r"^--collective-timeout"))
    )
    expect(row).to_have_count(1)
    (option,) = [o for o in OPTIONS if o.flags[0] == "--collective-timeout"]
    expect(row.locator("td").nth(1)).to_have_text(shown_default(option))  # the declaration's
    shot(page, row, "docs-flags.png")

    page.goto(f"{site}/tutorials/quickstart.html")
    expect(page.locator("div.cell").first).to_contain_text("%load_ext elastic_nb")
    expect(page.locator("div.cell", has_text="%%elastic --nproc 4").first).to_be_visible()
    shot(page, page.locator("article"), "docs-notebook.png")

    page.goto(f"{site}/search.html?q=collective-timeout")
    results = page.locator("#search-results a")
    expect(results.filter(has_text="%%elastic flags")).to_have_count(1, timeout=30_000)
    shot(page, page.locator("#search-results"), "docs-search.png")
