"""The live dashboard under a %%elastic cell: an anywidget fed by one writer.

The job's follower (the cell's thread, or a background job's thread) is the only writer: it
folds each supervisor update into the `DashboardState` and, once the queue of updates is drained,
sends *one* custom message with everything that changed (``flush``), at most one per
`SEND_EVERY_S`. A snapshot of the whole
state goes out as the widget's synced trait every `SNAPSHOT_EVERY_S` and at the end, for views
that start late and for the saved notebook. The browser keeps the same bounded state per model
(``dashboard.js``), so any number of views cost the kernel nothing more.

Buttons send custom messages back. A busy kernel (ipykernel 7.4) does not handle them until the
cell ends, so a blocking cell shows no buttons, only the interrupt hint; a ``--bg`` job's cell has
ended and its Stop and Stacks buttons work.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import anywidget
import traitlets

from elastic_nb.common import report
from elastic_nb.common.spec import JobSpec
from elastic_nb.kernel.dashboard.model import DashboardState
from elastic_nb.protocol.records import Summary

__all__ = ["Dashboard", "DashboardWidget"]

# One message a tick: at most five a second, whatever the ranks print (jupyter_server drops
# IOPub past 1000 msgs/s; browsers stall long before that on big DOM updates).
SEND_EVERY_S = 0.2
SNAPSHOT_EVERY_S = 2.0

_STATIC = Path(__file__).with_name("static")


class DashboardWidget(anywidget.AnyWidget):
    _esm = _STATIC / "dashboard.js"
    _css = _STATIC / "dashboard.css"
    snapshot = traitlets.Dict().tag(sync=True)

    def __init__(self, *, text: str = "", **kwargs: Any) -> None:
        """`text`: the display's text/plain, what readers that draw no widgets show in its
        place (GitHub, nbviewer, nbconvert: they fall back to it without the widget state)."""
        super().__init__(**kwargs)
        self.text = text

    def __repr__(self) -> str:
        h = self.snapshot.get("header", {})
        return f"<elastic_nb dashboard: job {h.get('job')} {h.get('state')}>"

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        bundle = super()._repr_mimebundle_(**kwargs)
        if bundle is None or not self.text:
            return bundle
        data, metadata = bundle
        return {**data, "text/plain": self.text}, metadata


class Dashboard:
    """A renderer (update / flush / end) that draws a job into a `DashboardWidget`."""

    live_beside_input = True  # its sends are comm messages: any thread's, none under the input

    def __init__(
        self,
        job_id: str,
        run_dir: str,
        spec: JobSpec,
        on_stop: Callable[[], None] | None = None,
        on_stacks: Callable[[], object] | None = None,
        session: str | None = None,
    ) -> None:
        """`on_stop`/`on_stacks`: what the buttons do (a background job's dashboard has them);
        `session`: the session whose ranks run the cell, if one."""
        self.state = DashboardState(job_id, run_dir, spec, session)
        # The dashboard's header says what the start line says; the line itself is the
        # display's text, for readers without widgets (the cell prints it nowhere else).
        nodes = (spec.nnodes_min, spec.nnodes_max)
        start = report.start_line(job_id, spec.nproc, spec.worst_case_s, session, nodes)
        self.widget = DashboardWidget(snapshot=self.state.snapshot(), text=start)
        self._snapshot_at = self._sent_at = time.monotonic()
        self._actions = {"stop": on_stop, "stacks": on_stacks}
        self.widget.on_msg(self._on_msg)

    def update(self, msg: dict[str, Any]) -> None:
        self.state.apply(msg)

    def flush(self, now: bool = False) -> None:
        if not now and time.monotonic() - self._sent_at < SEND_EVERY_S:
            return  # held: the follower flushes again within FLUSH_WAIT_S
        delta = self.state.take_delta()
        if delta is None:
            return
        self.widget.send(delta)
        self._sent_at = time.monotonic()
        if time.monotonic() - self._snapshot_at >= SNAPSHOT_EVERY_S:
            self._snapshot()

    def end(self, summary: Summary) -> None:
        self.state.end(summary)
        delta = self.state.take_delta()
        if delta is not None:
            self.widget.send(delta)
        self._snapshot()  # the final state is what the notebook file keeps

    def _snapshot(self) -> None:
        self.widget.snapshot = self.state.snapshot()
        self._snapshot_at = time.monotonic()

    def _on_msg(self, _widget: Any, content: dict[str, Any], _buffers: Any) -> None:
        """A button (runs on the kernel's main thread, never the writer's): act off-thread,
        the state comes back through the supervisor's updates like any other change."""
        action = self._actions.get(content.get("kind", "")) if isinstance(content, dict) else None
        if action is not None and self.state.summary is None:
            threading.Thread(target=_quietly, args=(action,), daemon=True).start()


def _quietly(action: Callable[[], Any]) -> None:
    """A click that comes as the job ends has nothing left to act on; a traceback from this
    thread would land in whichever cell runs."""
    with contextlib.suppress(Exception):
        action()
