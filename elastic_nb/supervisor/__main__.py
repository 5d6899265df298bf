"""`python -m elastic_nb.supervisor`: the supervisor process a kernel starts (see server.py)."""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys

import anyio

from elastic_nb.supervisor.service import Supervisor


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m elastic_nb.supervisor")
    parser.add_argument(
        "--listen-fd", type=int, required=True, help="listening Unix socket, inherited"
    )
    parser.add_argument(
        "--kernel-pid", type=int, required=True, help="exit when this process exits"
    )
    parser.add_argument("--log", required=True, help="our own log file: removed after a clean exit")
    parser.add_argument("--kernel-id", help="the kernel's id (Jupyter's), for the JupyterLab panel")
    args = parser.parse_args()
    # The kernel's interrupt never reaches us (we run in a session of our own), and a job is
    # stopped by request, not by Ctrl-C: ignore SIGINT.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # stderr is the supervisor's log file (the kernel opened it): what went wrong, with tracebacks.
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    anyio.run(Supervisor(args.listen_fd, args.kernel_pid, args.log, args.kernel_id).run)
    with contextlib.suppress(OSError):
        os.unlink(args.log)


if __name__ == "__main__":
    main()
