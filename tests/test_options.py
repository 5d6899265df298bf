"""Every flag is declared once (elastic_nb/options.py): the parser, DEFAULTS and the README's flag
table must say what the declaration says."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

import pytest
from IPython.core.magic_arguments import parse_argstring

from elastic_nb.common.spec import JobSpec
from elastic_nb.kernel.commands import COMMANDS
from elastic_nb.kernel.magic import ElasticMagics
from elastic_nb.kernel.options import DEFAULTS, OPTIONS, shown_default

pytestmark = pytest.mark.unit

README = Path(__file__).resolve().parent.parent / "README.md"


def readme_flag_table() -> dict[tuple[str, ...], str]:
    """The rows of the README's `%%elastic [flags]` table: flags -> default column."""
    text = README.read_text()
    table = text[text.index("### `%%elastic [flags]`") :].split("\n\n")[1]
    rows = {}
    for line in table.splitlines()[2:]:
        cells = line.replace("\\|", "/").strip().strip("|").split("|")
        first, default = [c.strip() for c in cells][:2]
        flags = tuple(re.findall(r"`(--[a-z-]+)", first))
        rows[flags] = default.strip("`")
    return rows


def test_the_readme_table_is_the_declaration() -> None:
    declared = {o.flags: shown_default(o) for o in OPTIONS}
    assert readme_flag_table() == declared


def test_every_field_of_a_spec_is_a_flag_and_has_one_default() -> None:
    assert list(DEFAULTS) == [o.dest for o in OPTIONS]  # one declaration each
    # the kernel's (ship: the notebook's modules a cell on other machines imports), the
    # supervisor's
    not_flags = {"cwd", "sys_path", "stop_grace", "session", "ship"}
    split = {"nnodes": {"nnodes_min", "nnodes_max"}}  # one flag, two fields (MIN:MAX)
    fields_of_flags = set(DEFAULTS) - set(split) | set().union(*split.values())
    assert {f.name for f in fields(JobSpec)} - not_flags == fields_of_flags


@pytest.mark.parametrize("option", [o for o in OPTIONS if o.torchrun], ids=lambda o: o.dest)
def test_torchruns_underscore_spellings_parse(option) -> None:
    flag = next(f for f in option.spellings if "_" in f)
    value = "x" if option.metavar else ""
    parsed = vars(parse_argstring(ElasticMagics.elastic, f"{flag} {value}".strip()))
    expected = [value] if option.action == "append" else value
    assert parsed == {option.dest: expected}


def test_no_warm_and_warm_set_one_option() -> None:
    assert vars(parse_argstring(ElasticMagics.elastic, "--no-warm")) == {"warm": False}
    assert vars(parse_argstring(ElasticMagics.elastic, "--warm")) == {"warm": True}
    assert vars(parse_argstring(ElasticMagics.elastic, "")) == {}  # defaults merge in layers


def test_the_readme_lists_every_line_magic_command() -> None:
    """README's `%elastic COMMAND` table has a row for each command the magic declares
    (kernel/commands.COMMANDS), and no other."""
    readme = (Path(__file__).resolve().parent.parent / "README.md").read_text()
    table = readme.split("### `%elastic COMMAND`", 1)[1].split("\n### ", 1)[0]
    listed = re.findall(r"^\| `%elastic ([a-z-]+)", table, re.M)
    assert sorted(listed) == sorted(COMMANDS), listed
