"""The REST endpoints under ``{base_url}elastic-nb/api/``, for the JupyterLab panel.

Every handler requires jupyter_server's authentication and authorization (an unauthenticated
call gets 403 and nothing of a job), and reaches supervisors only over their private Unix
sockets (supervisors.py), in a worker thread: the server's event loop never waits on one.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Callable
from typing import Any, TypeVar

from jupyter_server.auth.decorator import authorized
from jupyter_server.base.handlers import APIHandler
from jupyter_server.utils import url_path_join
from tornado import web

from elastic_nb import protocol
from elastic_nb.common.rundir import RunDir
from elastic_nb.server import supervisors
from elastic_nb.server.supervisors import RegisteredSupervisor, SupervisorError

__all__ = ["ROUTES", "setup_handlers"]

AUTH_RESOURCE = "elastic-nb"
LOG_CHUNK = 256 * 1024  # bytes of a log per call, following it
DEFAULT_TAIL = 200
T = TypeVar("T")
R = TypeVar("R")  # a reply's data


class _Handler(APIHandler):
    auth_resource = AUTH_RESOURCE

    async def blocking(self, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(None, lambda: fn(*args, **kwargs))

    async def overview(self) -> list[tuple[RegisteredSupervisor, protocol.kernel.PanelEntry]]:
        """(supervisor, entry) for every job, session and cell of every live supervisor, asked
        all at once: one slow supervisor delays the listing by its own time only."""
        found = await self.blocking(supervisors.find)
        replies = await asyncio.gather(*(self.blocking(_overview_of, sup) for sup in found))
        return [
            (sup, entry) for sup, entries in zip(found, replies, strict=True) for entry in entries
        ]

    async def owner(self, job_id: str) -> tuple[RegisteredSupervisor, protocol.kernel.PanelEntry]:
        for sup, entry in await self.overview():
            if entry["id"] == job_id:
                return sup, entry
        raise web.HTTPError(404, f"no job {job_id}")

    async def ask(
        self, sup: RegisteredSupervisor, msg: protocol.kernel.Request, reply: type[R]
    ) -> R:
        try:
            return await self.blocking(sup.request, msg, reply)
        except SupervisorError as e:
            raise web.HTTPError(404 if e.missing else 409, str(e)) from None


class JobsHandler(_Handler):
    @web.authenticated
    @authorized
    async def get(self) -> None:
        """Every job, session and session cell of every supervisor of this user, oldest first
        (``jobs``: ``id``, ``kind`` (job, session, cell), ``session`` (a cell's),
        ``supervisor_pid``, ``kernel_id``, ``notebook`` (the server's path of the notebook whose
        kernel runs it), ``state``, ``running``, ``world_size``, ``attempt``, ``restarts``,
        ``max_restarts``, ``created``, ``elapsed_s``, the latest ``alerts`` (``kind``,
        ``severity``, ``rank``, ``text``), ``paused`` (ranks at a prompt), ``run_dir``, and its
        ``outcome`` and ``summary`` line once ended); and the machines of every notebook open to
        other machines (``machines``: its join agents, as `%elastic nodes` lists them)."""
        notebooks = await self._notebooks()
        jobs = []
        for sup, entry in await self.overview():
            jobs.append(
                {
                    **entry,
                    "supervisor_pid": sup.pid,
                    "kernel_id": sup.kernel_id,
                    "notebook": notebooks.get(sup.kernel_id or ""),
                }
            )
        found = await self.blocking(supervisors.find)
        nodes = await asyncio.gather(*(self.blocking(_nodes_of, sup) for sup in found))
        machines = [
            {
                **n,
                "supervisor_pid": sup.pid,
                "kernel_id": sup.kernel_id,
                "notebook": notebooks.get(sup.kernel_id or ""),
            }
            for sup, n in zip(found, nodes, strict=True)
            if n is not None and n.get("listening")
        ]
        self.finish(
            json.dumps({"jobs": sorted(jobs, key=lambda j: j["created"]), "machines": machines})
        )

    async def _notebooks(self) -> dict[str, str]:
        """kernel id -> the path (relative to the server's root) of the notebook using it."""
        found = {}
        assert self.serverapp is not None  # a handler of a running server
        for s in await self.serverapp.session_manager.list_sessions():
            kernel = (s.get("kernel") or {}).get("id")
            if kernel:
                found[kernel] = s.get("path") or s.get("name")
        return found


class StopHandler(_Handler):
    @web.authenticated
    @authorized
    async def post(self, job_id: str) -> None:
        """Stop a job (a session: take it down), as its cell's interrupt would: ``{"stopping":
        [ids]}``, the jobs now on their way out."""
        sup, entry = await self.owner(job_id)
        if entry["kind"] == "session":
            await self.ask(
                sup,
                protocol.kernel.Down(
                    kind=protocol.kernel.DOWN, req=1, session=job_id, reason="panel"
                ),
                protocol.kernel.Done,
            )
            stopping = [job_id] if entry["running"] else []
        else:
            stop = protocol.kernel.Stop(
                kind=protocol.kernel.STOP, req=1, job=job_id, reason="panel"
            )
            stopping = (await self.ask(sup, stop, protocol.kernel.Stopping))["stopping"]
        self.finish(json.dumps({"stopping": stopping}))


class StacksHandler(_Handler):
    @web.authenticated
    @authorized
    async def post(self, job_id: str) -> None:
        """Every live rank's stack, now: ``{"text": report, "ranks": [{"rank", "pid", ...}]}``;
        409 when the job is not running."""
        sup, entry = await self.owner(job_id)
        if not entry["running"]:
            raise web.HTTPError(409, f"job {job_id} is not running")
        stacks = protocol.kernel.Stacks(kind=protocol.kernel.STACKS, req=1, job=job_id)
        reply = await self.ask(sup, stacks, protocol.kernel.StackText)
        ranks = split_stacks(reply["text"])
        for r in ranks:
            r["pid"] = reply["pids"].get(str(r["rank"]))
        self.finish(json.dumps({"text": reply["text"], "ranks": ranks}))


class LogsHandler(_Handler):
    @web.authenticated
    @authorized
    async def get(self, job_id: str) -> None:
        """A rank's log (``rank``, ``stream=out``, its stdout, or ``err``) of an attempt (the
        latest, or ``attempt``): without ``offset``, its last ``tail`` lines (200 by default);
        with it, what was written since (at most 256 KiB a call), to follow the log: its ``text``,
        the ``offset`` to ask from next, ``path``, ``size``, ``rank``, ``attempt``, ``stream``. A session
        cell's ranks are its session's: their logs are the session's."""
        _, entry = await self.owner(job_id)
        try:
            rank = int(self.get_argument("rank", "0"))
            tail = int(self.get_argument("tail", str(DEFAULT_TAIL)))
            offset = self.get_argument("offset", None)
            start = None if offset is None else int(offset)
            asked = self.get_argument("attempt", None)
            attempt = None if asked is None else int(asked)
        except ValueError:
            raise web.HTTPError(400, "rank, tail, offset and attempt are numbers") from None
        stream = self.get_argument("stream", "out")
        if stream not in ("out", "err"):
            raise web.HTTPError(400, "stream is out or err")
        if not 0 <= rank < entry["world_size"]:
            raise web.HTTPError(400, f"job {job_id} has ranks 0-{entry['world_size'] - 1}")
        rd = RunDir(entry["logs_dir"])
        if attempt is None:
            attempt = max(rd.attempts(), default=0)
        elif not 0 <= attempt <= entry["attempt"]:
            raise web.HTTPError(400, f"job {job_id} has attempts 0-{entry['attempt']}")
        chunk = await self.blocking(_read_log, rd.log(attempt, rank, stream), start, tail)
        self.finish(json.dumps({"rank": rank, "attempt": attempt, "stream": stream, **chunk}))


class EventsHandler(_Handler):
    @web.authenticated
    @authorized
    async def get(self, job_id: str) -> None:
        """The job's dashboard messages after ``since`` (a sequence number), as its cell's
        dashboard got them (the latest 1,000 are kept), each with its ``seq`` and time ``t``:
        ``{"events": [...], "seq": latest}``."""
        sup, _ = await self.owner(job_id)
        try:
            since = int(self.get_argument("since", "0"))
        except ValueError:
            raise web.HTTPError(400, "since is a number") from None
        events = protocol.kernel.Events(kind=protocol.kernel.EVENTS, req=1, job=job_id, since=since)
        reply = await self.ask(sup, events, protocol.kernel.EventList)
        self.finish(json.dumps({"events": reply["events"], "seq": reply["seq"]}))


def _overview_of(sup: RegisteredSupervisor) -> list[protocol.kernel.PanelEntry]:
    overview = protocol.kernel.Overview(kind=protocol.kernel.OVERVIEW, req=1)
    try:
        return sup.request(overview, protocol.kernel.PanelList)["jobs"]
    except SupervisorError:
        return []  # gone or going (its jobs with it), or of another elastic_nb version


def _nodes_of(sup: RegisteredSupervisor) -> protocol.kernel.MachineList | None:
    try:
        nodes = protocol.kernel.Nodes(kind=protocol.kernel.NODES, req=1)
        return sup.request(nodes, protocol.kernel.MachineList)
    except SupervisorError:
        return None


def split_stacks(text: str) -> list[dict[str, Any]]:
    """The per-rank blocks of a stacks report ("rank N · ..." and its frames; across machines
    "node 1 (gpu-b) rank N · ..."), as the dashboard shows them side by side; the title line
    above them is the report's."""
    ranks: list[dict[str, Any]] = []
    for line in text.splitlines():
        m = re.match(r"(?:node \d+ \([^)]*\) )?rank (\d+)\b", line)
        if m:
            ranks.append({"rank": int(m.group(1)), "pid": None, "text": line})
        elif ranks:
            ranks[-1]["text"] += "\n" + line
    return ranks


def _read_log(path: Any, offset: int | None, tail: int) -> dict[str, Any]:
    """From `offset` (a chunk, to follow the file), or its last `tail` lines; with the offset to
    ask from next."""
    try:
        with open(path, "rb") as f:
            size = f.seek(0, 2)
            if offset is None:
                start = max(0, size - LOG_CHUNK)
                f.seek(start)
                data = f.read()
                lines = data.splitlines(keepends=True)
                if start and lines:
                    lines = lines[1:]  # a partial first line
                data = b"".join(lines[-tail:] if tail > 0 else lines)
                return _chunk(path, data, size, size)
            start = min(max(0, offset), size)
            f.seek(start)
            data = f.read(LOG_CHUNK)
            return _chunk(path, data, start + len(data), size)
    except FileNotFoundError:
        return _chunk(path, b"", 0, 0)


def _chunk(path: Any, data: bytes, offset: int, size: int) -> dict[str, Any]:
    return {
        "path": str(path),
        "text": data.decode(errors="replace"),
        "offset": offset,
        "size": size,
    }


# Every endpoint, under {base_url}elastic-nb/api/jobs ("{job}": a job's or a session's id): the
# server's routes and the docs' REST reference are both made from this table.
ROUTES: tuple[tuple[str, type[_Handler]], ...] = (
    ("", JobsHandler),
    ("{job}/stop", StopHandler),
    ("{job}/stacks", StacksHandler),
    ("{job}/logs", LogsHandler),
    ("{job}/events", EventsHandler),
)


def setup_handlers(web_app: Any) -> None:
    base = url_path_join(web_app.settings["base_url"], "elastic-nb", "api", "jobs")
    job = r"(?P<job_id>[0-9a-zA-Z]+)"
    web_app.add_handlers(
        ".*$",
        [
            (url_path_join(base, *path.format(job=job).split("/")) if path else base, handler)
            for path, handler in ROUTES
        ],
    )
