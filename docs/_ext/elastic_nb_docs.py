"""The docs' reference pages, generated from the code's own declarations (nothing in them is
written by hand): the %%elastic flags (`kernel.options.OPTIONS`), the %elastic commands
(`kernel.commands.COMMANDS`), the elastic-nb command line (`cli.command_line`), the run
directory's layout (`common.rundir`'s docstring, where it is defined) and the server
extension's REST endpoints (`server.handlers.ROUTES`).

Each is a directive that builds docutils nodes directly: the declarations' words are shown as
written, never parsed as markup.
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Iterable, Sequence
from typing import Any

from docutils import nodes
from sphinx.application import Sphinx
from sphinx.util.docutils import SphinxDirective

Cell = str | nodes.Node | Sequence[nodes.Node]


def _cell(content: Cell) -> nodes.entry:
    entry = nodes.entry()
    if isinstance(content, str):
        entry += nodes.paragraph(text=content)
    elif isinstance(content, nodes.Node):
        entry += nodes.paragraph("", "", content)
    else:
        entry += nodes.paragraph("", "", *content)
    return entry


def _code(*texts: str) -> list[nodes.Node]:
    out: list[nodes.Node] = []
    for i, text in enumerate(texts):
        if i:
            out.append(nodes.Text(", "))
        out.append(nodes.literal(text=text))
    return out


def table(
    headers: Sequence[str], rows: Iterable[Sequence[Cell]], widths: Sequence[int]
) -> nodes.table:
    group = nodes.tgroup(cols=len(headers))
    for width in widths:
        group += nodes.colspec(colwidth=width)
    head = nodes.thead()
    row = nodes.row()
    for h in headers:
        row += _cell(h)
    head += row
    group += head
    body = nodes.tbody()
    for cells in rows:
        row = nodes.row()
        for c in cells:
            row += _cell(c)
        body += row
    group += body
    t = nodes.table(classes=["elastic-nb-ref"])
    t += group
    return t


class Flags(SphinxDirective):
    """Every %%elastic flag, by group: its spellings, default, whether a session's cell takes
    it, and what it does (OPTIONS, the one declaration the parser is made from)."""

    def run(self) -> list[nodes.Node]:
        from elastic_nb.kernel.options import OPTIONS, shown_default

        out: list[nodes.Node] = []
        groups: dict[str, list[Any]] = {}
        for o in OPTIONS:
            groups.setdefault(o.group, []).append(o)
        for name, options in groups.items():
            out.append(nodes.rubric(text=name))
            rows = []
            for o in options:
                flags = list(o.spellings)
                if o.metavar:
                    flags[0] = f"{flags[0]} {o.metavar}"
                shown = shown_default(o)
                rows.append(
                    (
                        _code(*flags),
                        shown,
                        "yes" if o.per_cell else "",
                        o.help.replace("{default}", shown),
                    )
                )
            out.append(
                table(("flag", "default", "session cell", "what it does"), rows, (22, 12, 8, 58))
            )
        return out


class Commands(SphinxDirective):
    """Every %elastic command (COMMANDS, the declaration the magic dispatches on)."""

    def run(self) -> list[nodes.Node]:
        from elastic_nb.kernel.commands import COMMANDS

        rows = [(_code(f"%elastic {c.name} {c.args}".rstrip()), c.does) for c in COMMANDS.values()]
        return [table(("command", "what it does"), rows, (35, 65))]


class CommandLine(SphinxDirective):
    """The elastic-nb command line, from the parser `main` parses with."""

    def run(self) -> list[nodes.Node]:
        from elastic_nb.cli import command_line

        parser = command_line()
        sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        helps = {a.dest: a.help for a in sub._choices_actions}
        out: list[nodes.Node] = []
        for name, p in sub.choices.items():
            out.append(nodes.rubric(text=f"elastic-nb {name}"))
            out.append(nodes.paragraph(text=helps.get(name) or ""))
            usage = p.format_usage().removeprefix("usage: ").strip()
            out.append(nodes.literal_block(text=usage, language="text"))
            formatter = p._get_formatter()
            rows = []
            for action in p._actions:
                if isinstance(action, argparse._HelpAction):
                    continue
                names = action.option_strings or [action.metavar or action.dest]
                what = formatter._expand_help(action) if action.help else ""
                rows.append((_code(*names), what))
            out.append(table(("argument", "what it does"), rows, (30, 70)))
        return out


class RunDirLayout(SphinxDirective):
    """The run directory's layout, as common/rundir.py defines it (its docstring)."""

    def run(self) -> list[nodes.Node]:
        from elastic_nb.common import rundir

        doc = inspect.getdoc(rundir) or ""
        layout = doc.split("::", 1)[1].strip("\n")
        return [nodes.literal_block(text=inspect.cleandoc(layout), language="text")]


class RestApi(SphinxDirective):
    """The server extension's endpoints (ROUTES, the table the server's routes are made from)."""

    def run(self) -> list[nodes.Node]:
        from elastic_nb.server.handlers import ROUTES

        rows = []
        for path, handler in ROUTES:
            for method in ("get", "post"):
                if method in vars(handler):
                    doc = inspect.getdoc(vars(handler)[method]) or ""
                    url = "/elastic-nb/api/jobs" + (f"/{path}" if path else "")
                    rows.append((method.upper(), _code(url), " ".join(doc.split())))
        return [table(("method", "path", "what it does"), rows, (8, 32, 60))]


def setup(app: Sphinx) -> dict[str, Any]:
    app.add_directive("elastic-nb-flags", Flags)
    app.add_directive("elastic-nb-commands", Commands)
    app.add_directive("elastic-nb-cli", CommandLine)
    app.add_directive("elastic-nb-rundir", RunDirLayout)
    app.add_directive("elastic-nb-rest", RestApi)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
