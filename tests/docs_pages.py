"""The docs' pages as the tests read them: a page's text, a section of it under a heading, the
words between two phrases of a section. The tests that check an entry of a decision table or a
number the docs state read it from the page that states it (docs/howto, docs/explanation)."""

from __future__ import annotations

import re
from pathlib import Path

DOCS = Path(__file__).resolve().parent.parent / "docs"


def page(name: str) -> str:
    """The page `name` (a path under docs/, without .md)."""
    return (DOCS / f"{name}.md").read_text()


def section(name: str, heading: str) -> str:
    """The part of page `name` under `heading` (a heading's text, without its #s), up to the
    next heading of its level or above (a line of #s outside a fenced block); the page's top
    heading gives the whole page."""
    lines = page(name).split("\n")
    start = next(
        i for i, line in enumerate(lines) if re.fullmatch(rf"(#+) {re.escape(heading)}", line)
    )
    level = len(lines[start]) - len(lines[start].lstrip("#"))
    fenced, end = False, len(lines)
    for i in range(start + 1, len(lines)):
        fenced ^= lines[i].startswith("```")
        hashes = re.match(r"(#+) ", lines[i])
        if not fenced and hashes and len(hashes.group(1)) <= level:
            end = i
            break
    return "\n".join(lines[start:end])


def between(name: str, heading: str, before: str, after: str) -> str:
    """The words between `before` and `after` in a section, its lines joined."""
    text = " ".join(section(name, heading).split())
    start = text.index(before) + len(before)
    return text[start : text.index(after, start)]


def every_page() -> str:
    """Every page the docs have, written by hand, whitespace collapsed."""
    texts = (p.read_text() for p in sorted(DOCS.rglob("*.md")) if "_build" not in p.parts)
    return " ".join(" ".join(texts).split())
