"""The kernel's side of a session (``%elastic up``): ranks that stay up across cells.

``%elastic up --nproc 4 [launch flags]`` starts the session and returns once every rank waits
for cells; a bare ``%%elastic`` then runs on those ranks (names a cell defines stay defined), and
``%elastic down`` ends it. The session's own events (restarts, replays, its end) are printed
under the ``%elastic up`` cell by a follower thread, the way a ``--bg`` job's end is.
"""

from __future__ import annotations

import contextlib
import contextvars
import queue
import secrets
import sys
import threading
import time
from typing import Any

from elastic_nb import protocol
from elastic_nb.common import report
from elastic_nb.common.errors import ElasticError, SupervisorDied
from elastic_nb.common.spec import JobSpec
from elastic_nb.kernel.client import GONE, SupervisorClient
from elastic_nb.kernel.job_handle import WAKE_S
from elastic_nb.kernel.options import OPTIONS
from elastic_nb.protocol.records import Summary

__all__ = ["NO_SESSION_NO_REPLAY", "SessionHandle", "describe", "up_options"]

SESSION_MAX_RESTARTS = "3"  # an interactive session is worth restarting: replay brings it back
DOWN_WAIT_S = 10.0  # after `down`: the ranks leave their loop, or the teardown's grace ends them


NO_SESSION_NO_REPLAY = (
    "[elastic_nb] --no-replay: no session is up (%elastic up starts one); the cell runs as a job "
    "of its own"
)
# A cell's own flags that mean nothing to the ranks a session launches.
_CELL_ONLY = ("push", "pull", "pull_rank", "replay", "one_off", "background")


def up_options(options: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
    """%elastic up's flags: launch flags, and defaults for the session's cells (--no-widgets,
    --timeout, --hang-after). ValueError for a cell's own flag."""
    cell_only = [o.flags[0] for o in OPTIONS if o.dest in options and o.dest in _CELL_ONLY]
    if cell_only:
        raise ValueError(
            f"%elastic up {', '.join(cell_only)}: a cell's flag; give it to the cells that run "
            "on the session"
        )
    if "max_restarts" not in options and "max_restarts" not in config:
        return {**options, "max_restarts": SESSION_MAX_RESTARTS}
    return dict(options)


class SessionHandle:
    def __init__(self, client: SupervisorClient, spec: JobSpec, options: dict[str, Any]) -> None:
        self.id = secrets.token_hex(4)
        self.spec = spec
        self.options = options  # the launch flags it was started with (cells' flags add to them)
        self.state = "starting"
        self.attempt = 0
        self.summary: Summary | None = None
        self.run_dir = ""
        self._client = client
        self._queue = client.subscribe(self.id)
        self._ended = threading.Event()

    @property
    def up(self) -> bool:
        return self.summary is None and self._client.alive

    def cell_options(self, options: dict[str, Any], config: dict[str, Any]) -> dict[str, Any]:
        """A cell's flags on this session: its launch flags and the %elastic config defaults of
        a cell's own flags beneath them. ValueError for a launch flag: the ranks are up."""
        given = [o.flags[0] for o in OPTIONS if o.dest in options and not o.per_cell]
        if given:
            own = ", ".join(o.flags[0] for o in OPTIONS if o.per_cell and o.dest != "one_off")
            raise ValueError(
                f"{', '.join(given)}: session {self.id} is up, and its ranks were launched with "
                f"their own flags; a cell on it takes only {own}. Run it beside the session "
                "with %%elastic --one-off ..., or end the session with %elastic down"
            )
        defaults = {
            k: v for k, v in config.items() if any(o.dest == k and o.per_cell for o in OPTIONS)
        }
        return {**self.options, **defaults, **options}

    def end_line(self) -> str:
        s = self.summary
        if s is None:
            return f"[elastic_nb] session {self.id}: still ending (see %elastic status)"
        return (
            f"[elastic_nb] session {self.id} {s['outcome']}: {s['reason']} "
            f"(restarts {s['restarts']}/{s['max_restarts']}, {s['wall_s']:.0f} s)"
        )

    def start(self) -> None:
        """Start the ranks and wait until they wait for cells (an interrupt ends the session)."""
        t0 = time.monotonic()
        try:
            self.run_dir = self._client.up(self.id, self.spec)["run_dir"]
            while self.state != "ready":
                with contextlib.suppress(queue.Empty):  # in slices: see handle.WAKE_S
                    self._take(self._queue.get(timeout=WAKE_S))
                if self.summary is not None:
                    raise ElasticError(
                        f"session {self.id} did not come up: {self.summary['reason']} "
                        f"(logs: {self.run_dir})"
                    )
        except BaseException:
            if self.summary is None:
                with contextlib.suppress(ElasticError):
                    self._client.down(self.id)
            self._client.unsubscribe(self.id)
            raise
        n, m = self.spec.nproc, self.spec.max_restarts
        print(
            f"[elastic_nb] session {self.id}: {n} rank{'s' if n != 1 else ''} up in "
            f"{time.monotonic() - t0:.1f} s (restarts 0/{m}); a bare %%elastic runs on them, "
            f"%elastic down ends them · logs: {self.run_dir}"
        )
        self._follow_in_background()

    def down(self) -> None:
        if self.summary is None:
            with contextlib.suppress(ElasticError):
                self._client.down(self.id)
            self._ended.wait(DOWN_WAIT_S + self.spec.stop_grace)

    def info(self) -> protocol.kernel.SessionState:
        return self._client.session(self.id)

    def _follow_in_background(self) -> None:
        """Print the session's own news under the cell that started it (ipykernel keeps the
        parent message in a context variable: the copy keeps it)."""
        context = contextvars.copy_context()

        def run() -> None:
            try:
                while self.summary is None:
                    with contextlib.suppress(queue.Empty):
                        self._take(self._queue.get(timeout=1.0), echo=True)
            except SupervisorDied as e:
                print(f"[elastic_nb] session {self.id}: {e}", file=sys.stderr)
            finally:
                self._client.unsubscribe(self.id)
                self._ended.set()

        threading.Thread(
            target=context.run, args=(run,), name=f"elastic_nb-session-{self.id}", daemon=True
        ).start()

    def _take(self, msg: Any, echo: bool = False) -> None:
        if msg is GONE:
            self.summary = protocol.records.summary(self.id, "failed", "the supervisor is gone")
            raise SupervisorDied(
                f"the elastic_nb supervisor is gone ({self._client.gone_reason}); the session's "
                "ranks went with it"
            )
        if msg["kind"] == protocol.kernel.UPDATE:
            self.state = msg.get("state", self.state)
            self.attempt = msg.get("attempt", self.attempt)
            for alert in msg.get("alerts", ()) if echo else ():
                stream = sys.stderr if alert["severity"] == "error" else sys.stdout
                print(f"[elastic_nb] session {self.id}: {alert['title']}", file=stream)
        elif msg["kind"] == protocol.kernel.END:
            self.summary = msg["summary"]
            self.state = self.summary["outcome"]
            if echo:
                print(self.end_line())


def describe(info: protocol.kernel.SessionState) -> str:
    """``%elastic session``: its ranks, attempt, restarts, cells and the replay journal."""
    out = [
        f"session {info['session']}: {info['state']}, {info['world_size']} ranks, attempt "
        f"{info['attempt']}, restarts {info['restarts']}/{info['max_restarts']}, "
        f"{info['cells_run']} cells run",
        f"  run dir: {info['run_dir']}",
        "  ranks: "
        + ", ".join(f"{r['rank']} (pid {r['pid']}, {r['state']})" for r in info["ranks"]),
    ]
    saved = info.get("checkpoint")
    if saved:
        ago = report.duration(max(0.0, time.time() - saved["time"]))
        out.append(f"  latest checkpoint: {saved['words']}, saved {ago} ago, in {saved['path']}")
    journal = info["journal"]
    out.append(f"  replay journal ({len(journal)} cells that succeeded, replayed after a restart):")
    for e in journal:
        note = "" if e["replay"] else "  [--no-replay: left out]"
        out.append(f"    cell {e['no']} (job {e['job']}): {e['line']}{note}")
    for r in info["replays"]:
        n = r["cells"]
        how = (
            "failed" if r["failed"] else f"{n} cell{'s' if n != 1 else ''} in {r['seconds']:.2f} s"
        )
        out.append(f"  replayed on attempt {r['attempt']}: {how}")
    return "\n".join(out)
