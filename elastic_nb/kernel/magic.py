"""The IPython magics.

Run a cell on N ranks (torchrun spellings; ``%%elastic?`` lists every flag)::

    %load_ext elastic_nb

    %%elastic --nproc 4
    import torch, torch.distributed as dist
    dist.init_process_group()
    x = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(x)
    x.item()                      # rank 0's last expression is the cell's result

Manage jobs and session defaults with the line magic::

    %elastic config --nproc 4 --max-restarts 1     # defaults for later cells (config reset)
    %elastic jobs                                  # this session's jobs
    %elastic logs [JOB] [--rank R] [--attempt K] [--tail N]
    %elastic stop [JOB]                            # stop running jobs
    %elastic stacks [JOB]                          # every rank's Python stack, now
    %elastic status                                # the supervisor process

Other machines join this notebook's jobs (``--nnodes MIN:MAX``)::

    %elastic join-command                          # the line to run there: elastic-nb join ...
    %elastic nodes                                 # this machine and every joined one

Keep ranks up across cells (a session: names stay defined; a restart replays the cells)::

    %elastic up --nproc 4 [launch flags]           # then a bare %%elastic runs on them
    %elastic session                               # ranks, attempt, restarts, replay journal
    %elastic down

The cell blocks until every rank has finished, under a live dashboard where the frontend draws
widgets (text elsewhere). Interrupt the kernel to stop the job: every rank is ended within seconds
and the kernel is yours again. ``--bg`` returns a handle at once instead::

    %%elastic --bg --nproc 4
    train()

    job = _; job.wait()   # or: await job, job.result, job.stop(), job.logs(rank=1), job.stacks()
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
from typing import Any

from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, argument_group, magic_arguments, parse_argstring
from IPython.display import display

from elastic_nb.common.errors import Refused
from elastic_nb.common.spec import JobSpec
from elastic_nb.kernel.cell import explicit_timeouts, notebook_modules, prepare_cell
from elastic_nb.kernel.client import current_client, get_client
from elastic_nb.kernel.flags import SpecError, check_memory_history, job_spec, preflight
from elastic_nb.kernel.job_handle import JobHandle, Renderer
from elastic_nb.kernel.listings import jobs_table, memory_lines, print_logs
from elastic_nb.kernel.nodes import join_command, nodes_table
from elastic_nb.kernel.options import OPTIONS, Option, add_arguments
from elastic_nb.kernel.render_text import TextRenderer
from elastic_nb.kernel.session_handle import (
    NO_SESSION_NO_REPLAY,
    SessionHandle,
    describe,
    up_options,
)
from elastic_nb.protocol.records import Summary

__all__ = ["ElasticMagics"]


def launch_arguments(func: Any) -> Any:
    """The flags of %%elastic (options.OPTIONS), shared by %elastic config."""
    for deco in reversed(add_arguments(argument, argument_group)):
        func = deco(func)
    return func


@magics_class
class ElasticMagics(Magics):
    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.session_defaults: dict[str, Any] = {}
        self.jobs: dict[str, JobHandle] = {}
        self.session: SessionHandle | None = None  # %elastic up's ranks, while they are up

    @magic_arguments()
    @launch_arguments
    @line_cell_magic
    def elastic(self, line: str, cell: str | None = None) -> Any:
        """Run the cell on N torch.distributed ranks under torchelastic (``%%elastic``), or
        manage jobs (``%elastic status|jobs|logs|stop|config``).
        """
        if cell is None:
            return self._line(line)
        return self._cell(line, cell)

    def _shell(self) -> InteractiveShell:
        assert self.shell is not None, "the magics are registered with a shell"
        return self.shell

    # ---- %%elastic --------------------------------------------------------------------------

    def _options(self, argv_line: str) -> dict[str, Any]:
        options: dict[str, Any] = vars(parse_argstring(self.elastic, argv_line))
        return options

    def _spec(self, options: dict[str, Any]) -> JobSpec:
        try:
            return job_spec(
                {**self.session_defaults, **options}, cwd=os.getcwd(), sys_path=sys.path
            )
        except SpecError as e:
            raise UsageError(str(e)) from None

    def _check_nodes(self, spec: JobSpec) -> None:
        """A job across machines needs this notebook open to other machines' agents."""
        if not spec.multi_node:
            return
        if get_client().nodes()["listening"] is None:
            count = f"{spec.nnodes_min}" + (
                f":{spec.nnodes_max}" if spec.nnodes_max != spec.nnodes_min else ""
            )
            where = "on joined nodes only" if spec.remote_only else "on other machines too"
            raise UsageError(
                f"--nnodes {count}: the job runs {where}, and none can join yet: "
                "%elastic join-command opens this notebook to them and prints the line to run "
                "on each (then %elastic nodes lists them)"
            )

    def _cell(self, line: str, cell: str) -> Any:
        options = self._options(line)
        session = self._live_session()
        if session is not None and not options.get("one_off"):
            try:
                options = session.cell_options(options, self.session_defaults)
            except ValueError as e:
                raise UsageError(str(e)) from None
        else:
            if options.get("replay") is False and session is None:
                print(NO_SESSION_NO_REPLAY, file=sys.stderr)
            session = None
        spec = self._spec(options)
        shell = self._shell()
        prepared = prepare_cell(line, cell, shell.user_ns, shell.user_ns_hidden, spec.push)
        try:
            preflight(spec)
        except SpecError as e:
            raise UsageError(str(e)) from None
        self._check_nodes(spec)
        if spec.collective_timeout is not None:
            for lineno in explicit_timeouts(prepared.source):
                print(
                    f"[elastic_nb] warning: cell line {lineno} passes timeout= to a process group; "
                    f"it overrides --collective-timeout {spec.collective_timeout:g} for that group",
                    file=sys.stderr,
                )
        if session is not None:
            spec = dataclasses.replace(spec, session=True)
        if spec.multi_node or (session is not None and session.spec.multi_node):
            # Other machines import the notebook's own modules too: they travel with the cell.
            spec = dataclasses.replace(spec, ship=notebook_modules(prepared.source, spec.cwd))
        job = JobHandle.submit(
            get_client(),
            spec,
            prepared.source,
            prepared.meta,
            prepared.payload,
            session.id if session is not None else None,
        )
        job.namespace = self._shell().user_ns
        self.jobs[job.id] = job
        renderer = self._renderer(job, spec)
        if spec.background:
            job.follow_in_background(renderer)
            return job  # displayed as its dashboard (or its repr)
        job.follow(renderer)
        return job.conclude()

    def _renderer(self, job: JobHandle, spec: JobSpec) -> Renderer:
        """The dashboard where the frontend renders widgets, text everywhere else. Under a
        dashboard the cell prints only the summary line, at the end: the dashboard shows the
        rest once, and its display's text is the start line, so that a saved notebook read
        without widgets (GitHub, nbviewer, nbconvert) still says how the job started and ended."""
        if spec.widgets and widgets_frontend(self.shell):
            from elastic_nb.kernel.dashboard import Dashboard

            dash = Dashboard(
                job.id,
                job.ranks_run_dir,
                spec,
                on_stop=functools.partial(job.stop, reason="button") if spec.background else None,
                on_stacks=job.stacks if spec.background else None,
                session=job.session,
            )
            job.widget = dash.widget
            if not spec.background:
                display(dash.widget)  # a background job is shown as the cell's result
            return _Both(dash, TextRenderer(job.id, job.ranks_run_dir, mode="summary"))
        text = TextRenderer(job.id, job.ranks_run_dir, mode="quiet" if spec.background else "live")
        text.start(spec.nproc, spec.worst_case_s, job.session, (spec.nnodes_min, spec.nnodes_max))
        return text

    # ---- %elastic -----------------------------------------------------------------------------

    def _line(self, line: str) -> Any:
        command, _, rest = line.strip().partition(" ")
        handlers = {
            "status": self._status,
            "jobs": self._jobs,
            "logs": self._logs,
            "stop": self._stop,
            "stacks": self._stacks,
            "config": self._config,
            "up": self._up,
            "down": self._down,
            "session": self._session_info,
            "nodes": self._nodes,
            "join-command": self._join_command,
        }
        if command not in handlers:
            raise UsageError(
                f"%elastic {command}: unknown command. Use one of: {', '.join(handlers)} "
                "(or %%elastic to run a cell; %elastic? for help)"
            )
        return handlers[command](rest.strip())

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

    def _jobs(self, rest: str) -> None:
        c = current_client()
        running = {j["job"]: j for j in c.jobs()} if c is not None else {}
        table = jobs_table(self.jobs.values(), running)
        print("\n".join(table) if table else "no jobs in this session yet")

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

    def _stacks(self, rest: str) -> None:
        """Every rank's Python stack, now, for a running job (the latest one by default)."""
        job_id = rest or None
        if job_id is not None:
            self._job(job_id)
        session = self._live_session()
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

    def _config(self, rest: str) -> None:
        if rest == "reset":
            self.session_defaults.clear()
        elif rest:
            options = self._options(rest)
            self._spec(options)  # reject a bad default now, not at the next cell
            session = self._live_session()
            if session is not None and options.get("memory_history"):
                # The session's next cells would be refused: say so now, where the flag is set.
                # (Without a session the next cell's own --env decides, and its preflight.)
                spec = self._spec(session.cell_options({}, {**self.session_defaults, **options}))
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

    # ---- sessions ---------------------------------------------------------------------------

    def _live_session(self) -> SessionHandle | None:
        if self.session is not None and not self.session.up:
            self.session = None  # it ended (down, out of restarts, the supervisor went)
        return self.session

    def _up(self, rest: str) -> None:
        session = self._live_session()
        if session is not None:
            raise UsageError(f"session {session.id} is already up: %elastic down ends it first")
        try:
            launch = up_options(self._options(rest), self.session_defaults)
        except ValueError as e:
            raise UsageError(str(e)) from None
        spec = dataclasses.replace(self._spec(launch), session=True)
        if spec.multi_node:
            spec = dataclasses.replace(spec, ship=notebook_modules("", spec.cwd))
        try:
            preflight(spec)
        except SpecError as e:
            raise UsageError(str(e)) from None
        self._check_nodes(spec)
        session = SessionHandle(get_client(), spec, launch)
        session.start()
        self.session = session

    def _down(self, rest: str) -> None:
        session = self._live_session()
        if session is None:
            print("no session is up")
            return
        session.down()
        self.session = None
        print(session.end_line())

    def _session_info(self, rest: str) -> None:
        session = self._live_session()
        if session is None:
            print("no session is up (%elastic up --nproc N starts one)")
            return
        try:
            print(describe(session.info()))
        except Refused as e:
            raise UsageError(e.reason) from None

    # ---- nodes ------------------------------------------------------------------------------

    def _join_command(self, rest: str) -> None:
        """The line that makes another machine a node of this notebook's jobs."""
        try:
            print(join_command(get_client(), rest))
        except ValueError as e:
            raise UsageError(str(e)) from None
        except Refused as e:
            raise UsageError(e.reason) from None

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


def widgets_frontend(shell: Any) -> bool:
    """Whether the frontend draws ipywidgets. A kernel cannot ask its frontend, so the rule is:
    a kernel (not terminal IPython) started by jupyter_server (JupyterLab, Notebook 7: it sets
    JPY_SESSION_NAME) or by VS Code (VSCODE_PID, or VSCODE_CWD where VS Code runs in WSL or a
    container, as Panel found); nbclient, nbconvert and papermill set neither and get text.
    ELASTIC_NB_WIDGETS=1 or 0 overrides it; --no-widgets (or %elastic config --no-widgets) opts
    a cell out."""
    forced = os.environ.get("ELASTIC_NB_WIDGETS")
    if forced in ("0", "1"):
        return forced == "1"
    if getattr(shell, "kernel", None) is None:
        return False
    return any(os.environ.get(v) for v in ("JPY_SESSION_NAME", "VSCODE_PID", "VSCODE_CWD"))


class _Both:
    """The dashboard, and the summary line printed under it."""

    def __init__(self, dash: Renderer, text: TextRenderer) -> None:
        self._dash, self._text = dash, text

    def update(self, msg: dict[str, Any]) -> None:
        self._dash.update(msg)

    def flush(self) -> None:
        self._dash.flush()

    def end(self, summary: Summary) -> None:
        try:
            self._dash.end(summary)
        finally:
            self._text.end(summary)
