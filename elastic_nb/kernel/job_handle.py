"""The kernel's handle on one job: following its events to the end, and the notebook's API.

The handle subscribes to its job's messages (`client.subscribe`) before it submits the job; one
follower (the cell's thread, or a background job's own thread) takes them off and feeds them
to a renderer. For ``%%elastic --bg`` the handle is what the cell returns: ``stop()``,
``wait()``, ``await job``, ``result``, ``logs()``, ``stacks()``.
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import math
import pickle
import queue
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from elastic_nb import protocol
from elastic_nb.common import procs
from elastic_nb.common.errors import (
    ElasticError,
    JobFailed,
    JobStopped,
    JobTimeout,
    Refused,
    SupervisorDied,
)
from elastic_nb.common.rundir import RunDir
from elastic_nb.common.spec import JobSpec
from elastic_nb.common.submission import Submission
from elastic_nb.kernel.client import GONE, SupervisorClient
from elastic_nb.kernel.rank_prompts import RankPrompts, beside_input
from elastic_nb.protocol.records import Summary

__all__ = ["JobHandle", "Renderer"]

# After an interrupt the supervisor normally ends the job in well under a second (SIGTERM to the
# whole group, 2 s grace at most); past this the kernel kills the job's processes itself.
STOP_TIMEOUT_S = 4.0

WAKE_S = 0.1  # how long the kernel's main thread waits in one go, so that it sees an interrupt
FLUSH_WAIT_S = 0.1  # a quiet queue still gets the renderer's held-back changes out this soon


class Renderer(Protocol):
    """What draws a job: `update` folds one supervisor update in, `flush` shows what the updates
    so far changed (called once the queue of updates is drained, and every FLUSH_WAIT_S while
    it stays empty: a renderer may hold changes back to keep its own pace, unless `now`: the
    cell's thread is about to wait at a rank's prompt), `end` shows the end. `live_beside_input`:
    it may draw from another thread while the cell's thread waits in input() (a dashboard; not
    text, whose lines would land in the middle of what a person types)."""

    live_beside_input: bool

    def update(self, msg: dict[str, Any]) -> None: ...
    def flush(self, now: bool = False) -> None: ...
    def end(self, summary: Summary) -> None: ...


class JobHandle:
    """A job as the kernel sees it: its events, its summary once it has ended, and (for
    ``%%elastic --bg``) the notebook's handle on it: ``stop()``, ``wait()``, ``await job``,
    ``result``, ``logs()``."""

    def __init__(
        self, client: SupervisorClient, job_id: str, spec: JobSpec, session: str | None = None
    ) -> None:
        self.id = job_id
        self.run_dir = str(RunDir.of(spec.log_dir, job_id))
        # A session's cell: its ranks (their marker, their logs) are the session's.
        self.session = session
        self.ranks_run_dir = str(RunDir.of(spec.log_dir, session)) if session else self.run_dir
        self.spec = spec
        self.summary: Summary | None = None
        self.namespace: dict[str, Any] | None = None  # where --pull objects land
        self.widget: Any = None  # the dashboard that shows it, where there is one
        self._client = client
        self._queue = client.subscribe(job_id)
        # News taken while the cell's thread waited at a prompt, for it to deal with first.
        self._held_back: collections.deque[Any] = collections.deque()
        self._ended = threading.Event()  # followed to the end (summary or error known)
        self._background = False
        self._error: BaseException | None = None  # what a background follower ran into
        self._rendered_end = False
        self._pulled = False
        self._state = "starting"  # as the supervisor's updates say, until the summary
        self._prompts = RankPrompts(self._answer)  # the ranks waiting at a prompt
        self._conversing = False

    @classmethod
    def submit(cls, client: SupervisorClient, cell: Submission) -> JobHandle:
        """Start a job (or a cell on its session's ranks) and follow it from its first message.
        The id is the kernel's: the handle listens before any message can arrive, and an
        interrupt before the reply can still stop the job."""
        job = cls(client, cell.id, cell.spec, cell.session)
        try:
            client.submit(cell)
        except BaseException:
            client.unsubscribe(job.id)
            raise
        return job

    def __repr__(self) -> str:
        return f"<elastic_nb job {self.id} {self.state} run_dir={self.run_dir}>"

    def _repr_mimebundle_(self, **kwargs: Any) -> Any:
        """Shown as its dashboard where there is one, as its repr everywhere else."""
        if self.widget is None:
            return {"text/plain": repr(self)}
        data, metadata = self.widget._repr_mimebundle_(**kwargs)
        return {**data, "text/plain": repr(self)}, metadata

    @property
    def state(self) -> str:
        """starting, rendezvous, running, restarting; then the outcome."""
        return self.summary["outcome"] if self.summary else self._state

    # ---- the notebook's API -----------------------------------------------------------------

    def stop(self, *, reason: str = "handle") -> None:
        """Stop the job (every rank: SIGTERM, grace, SIGKILL); returns at once."""
        if self.summary is None:
            with contextlib.suppress(SupervisorDied, ElasticError):
                self._client.stop(self.id, reason=reason)

    def stacks(self) -> str:
        """Every live rank's Python stack, now (the dashboard shows them as an alert too)."""
        return self._client.stacks(self.id)

    def wait(self, timeout: float | None = None) -> Any:
        """Block until the job ends; return the cell's result or raise what the cell would
        (JobFailed, JobTimeout, JobStopped). --pull objects land in the notebook now.
        An interrupt stops waiting, not the job (job.stop() does that)."""
        deadline = math.inf if timeout is None else time.monotonic() + timeout
        # In slices, so that the main thread runs Python at least every WAKE_S: a SIGINT that
        # another thread of the kernel took only sets a flag the main thread acts on then.
        while not self._ended.wait(max(0.0, min(WAKE_S, deadline - time.monotonic()))):
            if time.monotonic() >= deadline:
                raise TimeoutError(f"job {self.id} is still running after {timeout:g} s")
        return self.conclude()

    def __await__(self) -> Any:
        return self._wait_async().__await__()

    async def _wait_async(self) -> Any:
        import asyncio

        await asyncio.get_running_loop().run_in_executor(None, self._ended.wait)
        return self.conclude()

    @property
    def result(self) -> Any:
        if not self._ended.is_set():
            raise RuntimeError(f"job {self.id} is still running: job.wait() or await job")
        return self.conclude()

    def logs(self, rank: int = 0, stream: str = "out", attempt: int | None = None) -> str:
        """One rank's whole log (the last attempt by default), from the run directory."""
        rd = RunDir(self.ranks_run_dir)
        attempts = rd.attempts()
        if attempt is None:
            attempt = attempts[-1] if attempts else 0
        path = rd.log(attempt, rank, stream)
        return path.read_text(errors="replace") if path.exists() else ""

    def conclude(self) -> Any:
        """What the cell gives the notebook: its result, or the error of its outcome."""
        if self._error is not None:
            raise self._error
        s = self.summary
        assert s is not None
        if s["outcome"] == "timeout":
            raise JobTimeout(s)
        if s["outcome"] in ("stopped", "interrupted"):
            raise JobStopped(s)
        if s["outcome"] != "succeeded":
            raise JobFailed(s)
        rd = RunDir(self.run_dir)
        if self.spec.pull and self.namespace is not None and not self._pulled:
            what = f"--pull from rank {self.spec.pull_rank}"
            self.namespace.update(_load(rd, rd.pulled(s["attempt"], self.spec.pull_rank), what))
            self._pulled = True
        if s["result"]:
            how, value = _load(rd, rd.result(s["attempt"]), "the cell's result")
            return value if how == "value" else _Text(value)
        return None

    # ---- following --------------------------------------------------------------------------

    def follow_in_background(self, renderer: Renderer) -> None:
        """Feed the renderer from a thread of its own; the cell returns at once.

        The thread runs in a copy of the cell's context: ipykernel keeps the parent message
        in a context variable, so what the renderer prints lands under the cell that started
        the job, not under whichever cell runs when the job ends.
        """

        def run() -> None:
            try:
                self.follow(renderer)
            except BaseException as e:  # kept for wait()/result: a thread cannot raise it
                self._error = e
            finally:
                self._ended.set()

        self._background = True
        context = contextvars.copy_context()
        threading.Thread(
            target=context.run, args=(run,), name=f"elastic_nb-job-{self.id}", daemon=True
        ).start()

    def follow(self, renderer: Renderer) -> Summary:
        """Feed the job's events to `renderer` until it ends; return its summary.

        A KeyboardInterrupt (the kernel's interrupt) stops the job, waits for it to be gone
        (at most `stop_timeout`, then kills its processes from here) and is re-raised. Any other
        error on the way (a renderer's) also stops the job before it propagates: a cell that
        raised never leaves its ranks running. However it ends, the renderer is told the end
        if it can still draw one.
        """
        try:
            summary = self._follow(renderer)
        except (KeyboardInterrupt, SupervisorDied):
            self._end_renderer(renderer)
            raise
        except BaseException:
            if self.summary is None:
                self._stop_and_wait("stopped", "the cell raised while following the job")
            raise
        finally:
            if not self._background:  # a background follower records its error first
                self._ended.set()
        return summary

    def _end_renderer(self, renderer: Renderer) -> None:
        """After the kernel ended the job itself (the supervisor was gone or too slow)."""
        if self.summary is not None and not self._rendered_end:
            with contextlib.suppress(Exception):
                renderer.end(self.summary)

    @property
    def stop_timeout(self) -> float:
        # The supervisor's teardown: SIGTERM, the job's grace, SIGKILL; usually well under 1 s.
        return max(STOP_TIMEOUT_S, self.spec.stop_grace + 2.0)

    def _follow(self, renderer: Renderer) -> Summary:
        interrupted = False
        deadline: float | None = None
        while self.summary is None:
            try:
                if deadline is not None and time.monotonic() > deadline:
                    why = f"the supervisor did not stop the job within {self.stop_timeout:g} s"
                    self._kill_here("interrupted", why)
                    print(
                        f"[elastic_nb] job {self.id}: {why}; the kernel killed its processes",
                        file=sys.stderr,
                    )
                    break
                with contextlib.suppress(queue.Empty):
                    self._handle(self._get(FLUSH_WAIT_S), renderer)
                if self.summary is None and self._queue.empty() and not self._held_back:
                    renderer.flush()  # and again while quiet: it may hold changes back
            except KeyboardInterrupt:
                if interrupted:
                    self._kill_here("interrupted", "interrupted twice")  # the user insists
                    break
                interrupted = True
                deadline = time.monotonic() + self.stop_timeout
                with contextlib.suppress(SupervisorDied):
                    self._client.send_stop(self.id, "interrupt")
        if interrupted:
            raise KeyboardInterrupt
        assert self.summary is not None
        return self.summary

    def _handle(self, msg: Any, renderer: Renderer | None) -> None:
        if msg is GONE:
            gone = self._client.gone_reason
            self._kill_here("failed", f"the supervisor is gone: {gone}")
            raise SupervisorDied(
                f"the elastic_nb supervisor (pid {self._client.pid}) is gone ({gone}) while job "
                f"{self.id} ran; the job's processes were killed. The next %%elastic cell starts "
                "a new one."
            )
        if msg["kind"] == protocol.kernel.UPDATE:
            self._state = msg.get("state", self._state)
            if renderer is not None:
                renderer.update(msg)
        elif msg["kind"] == protocol.kernel.PROMPT:
            self._prompts.add(msg)
            if not self._conversing:
                self._converse(renderer)
        elif msg["kind"] == protocol.kernel.END:
            self.summary = msg["summary"]
            if renderer is not None:
                self._rendered_end = True
                renderer.end(msg["summary"])

    def _converse(self, renderer: Renderer | None) -> None:
        """The ranks' prompts (pdb's, input()), asked in the cell's thread in the frontend's
        input box (rank_prompts.py) until none waits, the job's other news rendered meanwhile;
        an interrupt there stops the job, as anywhere in the cell."""
        if renderer is None:
            self._prompts.decline("the job is being stopped")
            return
        if self._background:
            self._prompts.decline("a --bg job's cell has returned: nothing can take input for it")
            return

        def take(seconds: float, until: Callable[[], bool]) -> None:
            deadline = time.monotonic() + seconds
            while self.summary is None and not until():
                left = deadline - time.monotonic()
                if left <= 0:
                    return
                with contextlib.suppress(queue.Empty):
                    self._handle(self._get(left), renderer)

        self._conversing = True
        try:
            self._prompts.converse(
                take, lambda: renderer.flush(now=True), lambda: self._beside_input(renderer)
            )
        finally:
            self._conversing = False

    def _beside_input(self, renderer: Renderer) -> contextlib.AbstractContextManager[None]:
        """The job's news while the cell's thread waits in input() (rank_prompts.beside_input):
        a dashboard draws it; text, and the supervisor's going, wait for the cell's thread."""

        def deal(msg: Any) -> None:
            if renderer.live_beside_input and msg is not GONE:
                self._handle(msg, renderer)
            else:
                self._held_back.append(msg)  # taken first by `_get` (GONE: it raises there)

        return beside_input(
            self._queue,
            deal,
            ends=lambda msg: msg is GONE or msg["kind"] == protocol.kernel.END,
            idle=renderer.flush if renderer.live_beside_input else None,
        )

    def _get(self, timeout: float) -> Any:
        """The job's next message: those held back while the cell's thread waited first."""
        if self._held_back:
            return self._held_back.popleft()
        return self._queue.get(timeout=timeout)

    def _answer(self, prompt: protocol.kernel.Prompt, text: str | None, why: str | None) -> None:
        with contextlib.suppress(Refused):  # the rank is gone, or no longer waits for it
            self._client.answer(prompt, text, why)

    def _stop_and_wait(self, outcome: str, reason: str) -> None:
        """Stop the job without a renderer; bounded, and the processes are gone afterwards."""
        with contextlib.suppress(SupervisorDied):
            self._client.send_stop(self.id, reason)
        deadline = time.monotonic() + self.stop_timeout
        with contextlib.suppress(SupervisorDied):
            while self.summary is None and time.monotonic() < deadline:
                with contextlib.suppress(queue.Empty):
                    self._handle(self._get(0.25), None)
        if self.summary is None:
            self._kill_here(outcome, reason)

    def _kill_here(self, outcome: str, reason: str) -> None:
        """Last resort from the kernel itself: kill every process carrying this job's marker,
        and give the cell back once they are gone."""
        procs.kill_job([self.session or self.id], signal.SIGKILL, wait_s=procs.KILL_WAIT_S)
        self.summary = protocol.records.summary(
            self.id,
            outcome,
            reason,
            cause="interrupted" if outcome == "interrupted" else None,
            world_size=self.spec.world_size,
            max_restarts=self.spec.max_restarts,
            run_dir=self.run_dir,
        )


class _Text(str):
    """Shown as itself, not as a quoted string: a result that travelled as its repr."""

    def __repr__(self) -> str:
        return str(self)


def _load(rd: RunDir, path: Path, what: str) -> Any:
    try:
        return pickle.loads(rd.read_private(path))
    except Exception as e:
        raise ElasticError(f"could not load {what} from {path}: {type(e).__name__}: {e}") from None
