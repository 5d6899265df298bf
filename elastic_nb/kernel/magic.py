"""The IPython magics.

Run a cell on N ranks (torchrun spellings; ``%%elastic?`` lists every flag)::

    %load_ext elastic_nb

    %%elastic --nproc 4
    import torch, torch.distributed as dist
    dist.init_process_group()
    x = torch.ones(1) * (dist.get_rank() + 1)
    dist.all_reduce(x)
    x.item()                      # rank 0's last expression is the cell's result

Manage jobs, sessions and machines with the line magic, ``%elastic COMMAND``: its commands are
declared in commands.py (``%elastic?`` lists them). Keep ranks up across cells (a session: names
stay defined; a restart replays the cells)::

    %elastic up --nproc 4 [launch flags]           # then a bare %%elastic runs on them
    %elastic down

The cell blocks until every rank has finished, under a live dashboard where the frontend draws
widgets (text elsewhere). Interrupt the kernel to stop the job: every rank is ended within seconds
and the kernel is yours again. ``--bg`` returns a handle at once instead::

    %%elastic --bg --nproc 4
    train()

    job = _; job.wait()   # or: await job, job.result, job.stop(), job.logs(rank=1), job.stacks()
"""

from __future__ import annotations

import dataclasses
import functools
import os
import secrets
import sys
from typing import Any

from IPython.core.error import UsageError
from IPython.core.interactiveshell import InteractiveShell
from IPython.core.magic import Magics, line_cell_magic, magics_class
from IPython.core.magic_arguments import argument, argument_group, magic_arguments, parse_argstring
from IPython.display import display

from elastic_nb.common.spec import JobSpec
from elastic_nb.common.submission import Submission
from elastic_nb.kernel.cell import explicit_timeouts, notebook_modules, prepare_cell
from elastic_nb.kernel.client import get_client
from elastic_nb.kernel.commands import COMMANDS, LineCommands, commands_help
from elastic_nb.kernel.flags import SpecError, job_spec, preflight
from elastic_nb.kernel.job_handle import JobHandle, Renderer
from elastic_nb.kernel.options import add_arguments
from elastic_nb.kernel.render_text import TextRenderer
from elastic_nb.kernel.session_handle import (
    NO_SESSION_NO_REPLAY,
    SessionHandle,
)
from elastic_nb.protocol.records import Summary

__all__ = ["ElasticMagics"]


def launch_arguments(func: Any) -> Any:
    """The flags of %%elastic (options.OPTIONS), shared by %elastic config."""
    for deco in reversed(add_arguments(argument, argument_group)):
        func = deco(func)
    return func


def _with_commands(func: Any) -> Any:
    """The magic's help lists the line magic's commands (commands.COMMANDS)."""
    func.__doc__ = f"{func.__doc__.rstrip()}\n\n{commands_help()}\n"
    return func


@magics_class
class ElasticMagics(Magics, LineCommands):
    def __init__(self, shell: Any) -> None:
        super().__init__(shell)
        self.session_defaults: dict[str, Any] = {}
        self.jobs: dict[str, JobHandle] = {}
        self.session: SessionHandle | None = None  # %elastic up's ranks, while they are up

    @magic_arguments()
    @launch_arguments
    @line_cell_magic
    @_with_commands
    def elastic(self, line: str, cell: str | None = None) -> Any:
        """Run the cell on N torch.distributed ranks under torchelastic (``%%elastic``), or
        manage jobs, sessions and machines (``%elastic COMMAND``):
        """
        if cell is None:
            return self._line(line)
        return self.run_cell(line, cell)

    def _shell(self) -> InteractiveShell:
        assert self.shell is not None, "the magics are registered with a shell"
        return self.shell

    # ---- %%elastic --------------------------------------------------------------------------

    def options(self, argv_line: str) -> dict[str, Any]:
        options: dict[str, Any] = vars(parse_argstring(self.elastic, argv_line))
        return options

    def spec(self, options: dict[str, Any]) -> JobSpec:
        try:
            return job_spec(
                {**self.session_defaults, **options}, cwd=os.getcwd(), sys_path=sys.path
            )
        except SpecError as e:
            raise UsageError(str(e)) from None

    def check_nodes(self, spec: JobSpec) -> None:
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

    def run_cell(self, line: str, cell: str) -> Any:
        """%%elastic: the cell on the ranks (a session's, if one is up), followed to its end."""
        options = self.options(line)
        session = self.live_session()
        if session is not None and not options.get("one_off"):
            try:
                options = session.cell_options(options, self.session_defaults)
            except ValueError as e:
                raise UsageError(str(e)) from None
        else:
            if options.get("replay") is False and session is None:
                print(NO_SESSION_NO_REPLAY, file=sys.stderr)
            session = None
        spec = self.spec(options)
        shell = self._shell()
        prepared = prepare_cell(line, cell, shell.user_ns, shell.user_ns_hidden, spec.push)
        try:
            preflight(spec)
        except SpecError as e:
            raise UsageError(str(e)) from None
        self.check_nodes(spec)
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
        submission = Submission(
            secrets.token_hex(4),
            spec,
            prepared.source,
            prepared.meta,
            prepared.payload,
            session.id if session is not None else None,
        )
        job = JobHandle.submit(get_client(), submission)
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
        name, _, rest = line.strip().partition(" ")
        command = COMMANDS.get(name)
        if command is None:
            raise UsageError(
                f"%elastic {name}: unknown command. Use one of: {', '.join(COMMANDS)} "
                "(or %%elastic to run a cell; %elastic? for help)"
            )
        return command.run(self, rest.strip())


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
        self.live_beside_input = dash.live_beside_input  # the text prints only the end

    def update(self, msg: dict[str, Any]) -> None:
        self._dash.update(msg)

    def flush(self, now: bool = False) -> None:
        self._dash.flush(now)

    def end(self, summary: Summary) -> None:
        try:
            self._dash.end(summary)
        finally:
            self._text.end(summary)
