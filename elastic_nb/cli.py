"""`elastic-nb` (also ``python -m elastic_nb``): a terminal's side of elastic_nb.

Its commands and their arguments are `command_line()`'s (``elastic-nb --help``; the docs' command-line
reference is generated from it): ``join`` makes this machine a node of a notebook's jobs,
``runs`` lists the latest run directories, ``logs`` prints a run's rank logs.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

from elastic_nb.common.rundir import cache_home

__all__ = ["TOKEN_ENV", "command_line", "main"]

TOKEN_ENV = "ELASTIC_NB_TOKEN"


def command_line() -> argparse.ArgumentParser:
    """The command line, declared once: what `main` parses and the docs' reference shows."""
    parser = argparse.ArgumentParser(
        prog="elastic-nb",
        description="A terminal's side of elastic_nb (also python -m elastic_nb).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    join = sub.add_parser(
        "join",
        help="make this machine a node of a notebook's jobs (the line %%elastic join-command "
        f"prints; the token from ${TOKEN_ENV} where neither --token nor --token-file is given)",
    )
    join.add_argument("endpoint", metavar="HOST:PORT", help="the notebook's supervisor")
    join.add_argument(
        "--token",
        default=os.environ.get(TOKEN_ENV),
        help=f"from %%elastic join-command (default: ${TOKEN_ENV}, which, unlike a command "
        "line, other users of this machine cannot read)",
    )
    join.add_argument(
        "--token-file",
        type=Path,
        help="read the token from this file, which must be its owner's alone (%%elastic "
        "join-command --token-file writes it so)",
    )
    join.add_argument(
        "--workdir",
        type=Path,
        default=cache_home() / "agent",
        help="run directories and per-job working directories here (default: %(default)s)",
    )
    join.add_argument(
        "--addr",
        help="the address other nodes reach this one at (default: the one this machine reaches "
        "the notebook's from)",
    )
    join.add_argument(
        "--rejoin",
        action="store_true",
        help="once the notebook's supervisor is gone (its ranks ended), wait and join again "
        "instead of exiting (a network cut that heals)",
    )
    runs = sub.add_parser("runs", help="the latest run directories")
    runs.add_argument("--log-dir", type=Path, default=cache_home() / "runs")
    logs = sub.add_parser("logs", help="a run's rank logs")
    logs.add_argument("run", help="a run's id (or its directory)")
    logs.add_argument("--rank", type=int)
    logs.add_argument("--attempt", type=int)
    logs.add_argument("--tail", type=int, default=50, help="lines per file; 0 for all")
    logs.add_argument("--log-dir", type=Path, default=cache_home() / "runs")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = command_line()
    args = parser.parse_args(argv)

    if args.command == "join":
        if args.token_file is not None:
            try:
                args.token = read_token(args.token_file)
            except (OSError, ValueError) as e:
                print(f"elastic-nb join: {e}", file=sys.stderr)
                return 2
        if not args.token:
            parser.error(f"join: a token is needed: --token TOKEN or ${TOKEN_ENV}")
        from elastic_nb.join_agent.agent import run_agent
        from elastic_nb.supervisor.nodes.channel import TokenError

        try:
            return run_agent(args.endpoint, args.token, args.workdir, args.addr, args.rejoin)
        except TokenError as e:
            print(f"elastic-nb join: {e}", file=sys.stderr)
            return 2
    from elastic_nb.common.run_records import rank_logs, runs_table
    from elastic_nb.common.rundir import RunDir

    if args.command == "runs":
        print("\n".join(runs_table(args.log_dir)))
        return 0
    path = Path(args.run)
    rd = RunDir(path if path.is_dir() else args.log_dir / args.run)
    if not rd.path.is_dir():
        print(f"elastic-nb logs: no run {args.run} in {args.log_dir}", file=sys.stderr)
        return 2
    print("\n".join(rank_logs(rd, args.rank, args.attempt, args.tail)))
    return 0


def read_token(path: Path) -> str:
    """The token in `path`, a file no one but its owner (this user) can read or write."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
    with os.fdopen(fd) as f:
        st = os.fstat(f.fileno())
        if st.st_uid != os.getuid() or st.st_mode & 0o077:
            raise ValueError(
                f"{path} is not this user's alone (mode {st.st_mode & 0o777:o}): a token others "
                f"can read admits them too (chmod 600 {path})"
            )
        return f.read().strip()


if __name__ == "__main__":
    sys.exit(main())
