"""A forked child's end (launcher/forked.py), entry by entry: the launcher's zygote and a
launcher's fork server end their children with it, with the status the interpreter gives (the
two disagreed: sys.exit() ended a launcher with 1, sys.exit("why") a helper with 0)."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

import pytest

from elastic_nb.launcher.forked import run_then_exit

pytestmark = pytest.mark.unit


def _exit(code: object) -> Callable[[], None]:
    def main() -> None:
        sys.exit(code)

    return main


def _raise() -> None:
    raise ValueError("in the child")


@pytest.mark.parametrize(
    ("main", "status", "said"),
    [
        (lambda: None, 0, b""),
        (_exit(None), 0, b""),
        (_exit(0), 0, b""),
        (_exit(3), 3, b""),
        (_exit("no launcher for you"), 1, b"no launcher for you\n"),
        (_raise, 1, b"ValueError: in the child\n"),
    ],
    ids=["returns", "sys.exit()", "sys.exit(0)", "sys.exit(3)", "sys.exit(text)", "raises"],
)
def test_a_forked_child_ends_as_the_interpreter_would(
    main: Callable[[], object], status: int, said: bytes
) -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        sys.stderr = open(write, "w")  # noqa: SIM115 - the child's stderr until its os._exit
        run_then_exit(main)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        err = f.read()
    _, wait = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(wait) == status
    assert err.endswith(said), err
