"""A forked child's end, as the interpreter would end it: the launcher's zygote forks launchers,
a launcher forks multiprocessing's helpers, and each child runs its main, then leaves with
os._exit (a fork must not run its parent's atexit handlers, nor flush its parent's buffers a
second time) and the status Python itself would give."""

from __future__ import annotations

import contextlib
import os
import sys
import traceback
from collections.abc import Callable
from typing import NoReturn

__all__ = ["exit_status", "run_then_exit"]


def run_then_exit(main: Callable[[], object], flush: bool = True) -> NoReturn:
    """Run `main`, then end the process: 0 when it returns, its SystemExit's status, or 1 with
    the traceback on stderr for any other exception. `flush`: its stdout and stderr first (a
    child whose buffers may still hold its parent's output says False)."""
    code = 1
    try:
        main()
        code = 0
    except SystemExit as e:
        code = exit_status(e)
    except BaseException:
        traceback.print_exc()
    finally:
        if flush:
            with contextlib.suppress(Exception):
                sys.stdout.flush()
                sys.stderr.flush()
        os._exit(code)


def exit_status(e: SystemExit) -> int:
    """The status the interpreter gives a SystemExit: None is 0, an int is itself, anything else
    is printed to stderr and is 1 (sys.exit("message"))."""
    if e.code is None:
        return 0
    if isinstance(e.code, int):
        return e.code
    with contextlib.suppress(Exception):
        print(e.code, file=sys.stderr)
    return 1
