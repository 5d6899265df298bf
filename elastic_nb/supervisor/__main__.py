from __future__ import annotations

import argparse
import signal

import anyio

from elastic_nb.supervisor.server import Supervisor


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m elastic_nb.supervisor")
    parser.add_argument(
        "--listen-fd", type=int, required=True, help="listening Unix socket, inherited"
    )
    parser.add_argument(
        "--kernel-pid", type=int, required=True, help="exit when this process exits"
    )
    args = parser.parse_args()
    # The kernel's interrupt must never reach us: we run in our own session, and ignore SIGINT
    # until the signal receiver takes it over (a job is stopped by request, not by Ctrl-C).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    anyio.run(Supervisor(args.listen_fd, args.kernel_pid).run)


if __name__ == "__main__":
    main()
