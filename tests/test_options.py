"""Every flag is declared once (elastic_nb/kernel/options.py): the parser and DEFAULTS say what
the declaration says (the docs' flags reference is generated from it: tests/test_docs.py)."""

from __future__ import annotations

from dataclasses import fields

import pytest
from IPython.core.magic_arguments import parse_argstring

from elastic_nb.common.spec import JobSpec
from elastic_nb.kernel.magic import ElasticMagics
from elastic_nb.kernel.options import DEFAULTS, OPTIONS

pytestmark = pytest.mark.unit


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
