"""The line magic's commands, ``%elastic COMMAND [ARGS]``: each declared once (`COMMANDS`: its
arguments, what it does, its handler); the magic dispatches through the table and ``%elastic?``
lists it.
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from IPython.core.error import UsageError

from elastic_nb.common.errors import Refused
from elastic_nb.common.spec import JobSpec
from elastic_nb.kernel.cell import notebook_modules
from elastic_nb.kernel.client import current_client, get_client
from elastic_nb.kernel.flags import SpecError, check_memory_history, preflight
from elastic_nb.kernel.job_handle import JobHandle
from elastic_nb.kernel.listings import jobs_table, memory_lines, print_logs
from elastic_nb.kernel.nodes import join_command, nodes_table
from elastic_nb.kernel.options import OPTIONS, Option
from elastic_nb.kernel.session_handle import SessionHandle, describe, up_options

__all__ = ["COMMANDS", "Command", "LineCommands", "command", "commands_help"]


@dataclass(frozen=True)
class Command:
    name: str
    args: str  # its arguments, as its usage shows them
    does: str  # what it does, in a line
    run: Callable[[LineCommands, str], Any]  # the handler, given the rest of the line


COMMANDS: dict[str, Command] = {}  # in the order the help lists them
Handler = TypeVar("Handler", bound=Callable[..., Any])


def command(name: str, args: str, does: str) -> Callable[[Handler], Handler]:
    """Declare a handler as the command `name` (`args`: its usage; `does`: what it does)."""

    def declare(run: Handler) -> Handler:
        COMMANDS[name] = Command(name, args, does, run)
        return run

    return declare


class LineCommands:
    """The commands' handlers, a part of the magics (ElasticMagics): what they share with
    ``%%elastic`` is declared here and kept there."""

    jobs: dict[str, JobHandle]  # this notebook's, by id
    session: SessionHandle | None  # %elastic up's ranks, while they are up
    session_defaults: dict[str, Any]  # %elastic config's

    # %%elastic's own parsing, that %elastic config and %elastic up use too
    options: Callable[[str], dict[str, Any]]  # a line's flags
    spec: Callable[[dict[str, Any]], JobSpec]  # flags (over the defaults) as a spec
    check_nodes: Callable[[JobSpec], None]  # UsageError if a multi-node spec cannot run
    run_cell: Callable[[str, str], Any]  # %%elastic itself: its line and the cell

    def live_session(self) -> SessionHandle | None:
        """The session whose ranks are up (%elastic up), if one is."""
        if self.session is not None and not self.session.up:
            self.session = None  # it ended (down, out of restarts, the supervisor went)
        return self.session

    @command(
        "status",
        "",
        "the supervisor (pid, socket, its log of what went wrong on its side), its running jobs "
        "and sessions with each rank's memory, and the warm launcher (pid, ready, memory)",
    )
    def _status(self, rest: str) -> None:
        c = current_client()
        if c is None:
            print("supervisor: not running (it starts with the next %%elastic cell)")
            return
        st = c.status()
        print(f"supervisor: pid {st['pid']}, up {st['uptime_s']:.0f} s")
        print(f"  socket: {c.socket_path}")
        print(f"  log:    {c.log_path}")
        print(f"  running jobs: {', '.join(st['running']) or 'none'}")
        for s in st.get("sessions", ()):
            print(
                f"  session {s['session']}: {s['state']}, {s['world_size']} ranks, attempt "
                f"{s['attempt']}, restarts {s['restarts']}/{s['max_restarts']}, "
                f"{s['cells_run']} cells run"
            )
        for owner, ranks in st.get("memory", {}).items():
            if ranks:
                print(f"  memory of {owner}'s ranks (sampled each second):")
                print("\n".join(f"    {line}" for line in memory_lines(ranks)))
        w = st.get("warm")
        if w is None:
            print(
                "  warm launcher: none (the next cell starts one; %elastic config --no-warm keeps none)"
            )
            return
        zygote = f"the zygote (pid {w['zygote']}, torch imported once for every launcher)"
        if w["pid"] is None:
            state = "ready" if w["zygote_ready"] else "importing torch"
            print(f"  warm launcher: none yet; {zygote} is {state}")
            return
        print(
            f"  warm launcher: pid {w['pid']}, {'ready' if w['ready'] else 'warming up'}, "
            f"{w['pss_mb']:.0f} MB (PSS; RSS {w['rss_mb']:.0f} MB) with its fork server"
            + (f" and {zygote}" if w["zygote"] else "")
            + (f", preloaded: {', '.join(w['preload'])}" if w["preload"] else "")
        )

    @command("jobs", "", "this notebook's jobs: outcome, ranks, restarts, wall time, run directory")
    def _jobs(self, rest: str) -> None:
        c = current_client()
        running = {j["job"]: j for j in c.jobs()} if c is not None else {}
        table = jobs_table(self.jobs.values(), running)
        print("\n".join(table) if table else "no jobs in this session yet")

    @command(
        "logs",
        "[JOB] [--rank R] [--attempt K] [--tail N]",
        "a job's rank logs from its run directory (default: the last job, every rank, the last "
        "50 lines)",
    )
    def _logs(self, rest: str) -> None:
        parser = argparse.ArgumentParser(prog="%elastic logs", add_help=False)
        parser.add_argument("job", nargs="?")
        parser.add_argument("--rank", type=int)
        parser.add_argument("--attempt", type=int)
        parser.add_argument("--tail", type=int, default=50, help="lines per file; 0 for all")
        try:
            args = parser.parse_args(rest.split())
        except SystemExit:
            raise UsageError(
                "usage: %elastic logs [JOB] [--rank R] [--attempt K] [--tail N]"
            ) from None
        job = self._job(args.job)
        print_logs(job, args.rank, args.attempt, args.tail)

    @command("stop", "[JOB]", "stop every running job (and session cell), or JOB")
    def _stop(self, rest: str) -> None:
        job_id = rest or None
        if job_id is not None:
            self._job(job_id)
        c = current_client()
        if c is None:
            print("no running jobs")
            return
        stopping = c.stop(job_id, reason="user")
        print(f"stopping: {', '.join(stopping)}" if stopping else "no running jobs")

    @command(
        "stacks",
        "[JOB]",
        "every live rank's Python stack, now, all threads, inside a collective too (default: the "
        "session, else the running job)",
    )
    def _stacks(self, rest: str) -> None:
        """Every rank's Python stack, now, for a running job (the latest one by default)."""
        job_id = rest or None
        if job_id is not None:
            self._job(job_id)
        session = self.live_session()
        if job_id is None and session is not None:
            job_id = session.id
        c = current_client()
        if c is None:
            raise UsageError("no running job: %elastic stacks needs one (e.g. started with --bg)")
        try:
            text = c.stacks(job_id)
        except Refused as e:
            raise UsageError(e.reason) from None
        print(text)

    @command(
        "config", "[FLAGS | reset]", "defaults for later cells (flags on a cell override them)"
    )
    def _config(self, rest: str) -> None:
        if rest == "reset":
            self.session_defaults.clear()
        elif rest:
            options = self.options(rest)
            self.spec(options)  # reject a bad default now, not at the next cell
            session = self.live_session()
            if session is not None and options.get("memory_history"):
                # The session's next cells would be refused: say so now, where the flag is set.
                # (Without a session the next cell's own --env decides, and its preflight.)
                spec = self.spec(session.cell_options({}, {**self.session_defaults, **options}))
                try:
                    check_memory_history(spec)
                except SpecError as e:
                    raise UsageError(f"session {session.id}: {e}") from None
            self.session_defaults.update(options)
            c = current_client()
            if "warm" in options and c is not None:
                c.keep_warm(options["warm"])  # --no-warm frees the warm processes' memory now
        if self.session_defaults:
            print("session defaults for %%elastic (flags on a cell override them):")
            for o in OPTIONS:
                if o.dest in self.session_defaults:
                    print(f"  {_as_flag(o, self.session_defaults[o.dest])}")
        else:
            print("no session defaults: every flag has its built-in default (%elastic? lists them)")

    @command(
        "up",
        "--nproc N [FLAGS]",
        "keep ranks up across cells: a session (launch flags as %%elastic's; --max-restarts 3 by "
        "default)",
    )
    def _up(self, rest: str) -> None:
        session = self.live_session()
        if session is not None:
            raise UsageError(f"session {session.id} is already up: %elastic down ends it first")
        try:
            launch = up_options(self.options(rest), self.session_defaults)
        except ValueError as e:
            raise UsageError(str(e)) from None
        spec = dataclasses.replace(self.spec(launch), session=True)
        if spec.multi_node:
            spec = dataclasses.replace(spec, ship=notebook_modules("", spec.cwd))
        try:
            preflight(spec)
        except SpecError as e:
            raise UsageError(str(e)) from None
        self.check_nodes(spec)
        session = SessionHandle(get_client(), spec, launch)
        session.start()
        self.session = session

    @command("down", "", "end the session's ranks; the next bare %%elastic is a one-off job again")
    def _down(self, rest: str) -> None:
        session = self.live_session()
        if session is None:
            print("no session is up")
            return
        session.down()
        self.session = None
        print(session.end_line())

    @command(
        "session",
        "",
        "the session: state, ranks and pids, attempt, restarts, cells run, the replay journal, "
        "its latest checkpoint",
    )
    def _session_info(self, rest: str) -> None:
        session = self.live_session()
        if session is None:
            print("no session is up (%elastic up --nproc N starts one)")
            return
        try:
            print(describe(session.info()))
        except Refused as e:
            raise UsageError(e.reason) from None

    @command(
        "join-command",
        "[--host H] [--port P] [--new-token] [--token-file PATH]",
        "the line that makes another machine a node of this notebook's jobs; --new-token "
        "replaces the token and drops the agents holding the old one; --token-file keeps the "
        "token out of the notebook",
    )
    def _join_command(self, rest: str) -> None:
        """The line that makes another machine a node of this notebook's jobs."""
        try:
            print(join_command(get_client(), rest))
        except ValueError as e:
            raise UsageError(str(e)) from None
        except Refused as e:
            raise UsageError(e.reason) from None

    @command(
        "debug",
        "[--rank R]",
        "on a session: the debugger at the exception of the last failed cell (its first failed "
        "rank's, or R's), in that cell's frames, as IPython's %debug",
    )
    def _debug(self, rest: str) -> Any:
        session = self.live_session()
        if session is None:
            raise UsageError(
                "%elastic debug opens a session rank's last failure: no session is up (a "
                "one-off job's ranks have exited; %elastic up --nproc N starts a session)"
            )
        parser = argparse.ArgumentParser(prog="%elastic debug", add_help=False)
        parser.add_argument("--rank", type=int)
        try:
            args = parser.parse_args(rest.split())
        except SystemExit:
            raise UsageError("usage: %elastic debug [--rank R]") from None
        rank = args.rank
        if rank is None:
            failed = [
                j.summary
                for j in self.jobs.values()
                if j.session == session.id and j.summary and j.summary["outcome"] == "failed"
            ]
            failure = failed[-1].get("failure") if failed else None
            if not failure:
                raise UsageError(
                    f"no cell of session {session.id} has failed: nothing to debug "
                    "(--rank R opens R's last failure, if it had one)"
                )
            rank = int(failure["rank"])
        if not 0 <= rank < session.spec.world_size:
            raise UsageError(
                f"--rank {rank}: the session has ranks 0-{session.spec.world_size - 1}"
            )
        # A cell of its own on the session's ranks, left out of the replay: on `rank`, the
        # debugger in the frames the failed cell left (rank/notebook_input.py), the others idle.
        source = f"from elastic_nb.rank.notebook_input import debug_last\ndebug_last({rank})\n"
        return self.run_cell("--no-replay", source)

    @command(
        "nodes",
        "",
        "this machine and every joined one (host, address, GPUs, CPUs, versions, state, last "
        "heard, its jobs), and refused joins with why",
    )
    def _nodes(self, rest: str) -> None:
        print("\n".join(nodes_table(get_client().nodes())))

    def _job(self, job_id: str | None) -> JobHandle:
        if not self.jobs:
            raise UsageError("no jobs in this session yet")
        if job_id is None:
            return list(self.jobs.values())[-1]
        if job_id not in self.jobs:
            raise UsageError(f"no job {job_id!r} in this session (%elastic jobs lists them)")
        return self.jobs[job_id]


def _as_flag(o: Option, value: Any) -> str:
    """A parsed value as the flag that gives it (for %elastic config)."""
    if o.action in ("store_true", "store_false"):
        return o.flags[0] if value == (o.action == "store_true") else o.flags[-1]
    if isinstance(value, list):
        value = ",".join(value)
    return f"{o.flags[0]} {value}"


def commands_help() -> str:
    """Every command and what it does (the magic's help ends with them)."""
    return "\n".join(
        f"    %elastic {c.name} {c.args}".rstrip() + f"\n        {c.does}"
        for c in COMMANDS.values()
    )
