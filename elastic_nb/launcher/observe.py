"""What the launcher tells the supervisor about torchelastic's agent: its events (each rank's
start, each rendezvous), its monitor loop's ticks (a tick that stops means a stuck agent), every
rank's exit code as the agent closes an attempt, and each forked rank's exit the moment it
happens. Installed once, in the launcher, before `elastic_launch` runs.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
from typing import Any

from elastic_nb import protocol
from elastic_nb.common.rundir import ATTEMPT_BASE_ENV, RUN_DIR_ENV, attempt_of
from elastic_nb.launcher.pipe import Channel

__all__ = ["observe_agent"]


class _EventHandler(logging.Handler):
    """torchelastic records agent events as JSON on the logger ``torchelastic-events-null``."""

    def __init__(self, channel: Channel) -> None:
        super().__init__(logging.INFO)
        self._channel = channel

    def emit(self, record: logging.LogRecord) -> None:
        try:
            event = json.loads(record.getMessage())
            md = event["metadata"]
            # In a multi-node round, torch counts from 0 from the round's first attempt on (the
            # launcher's environment names that attempt once it has a job).
            restarts = int(md.get("agent_restarts") or 0)
            attempt = restarts + int(os.environ.get(ATTEMPT_BASE_ENV) or 0)
            state = md.get("state")
            if state == "START" and md.get("global_rank") is not None:
                self._channel.send(
                    protocol.launcher.Start(
                        kind=protocol.launcher.START,
                        attempt=attempt,
                        rank=int(md["global_rank"]),
                        pid=int(md["worker_id"]),
                    )
                )
            elif state == "RENDEZVOUS":
                self._channel.send(
                    protocol.launcher.Rendezvous(
                        kind=protocol.launcher.RENDEZVOUS,
                        attempt=attempt,
                        seconds=(md.get("duration_ms") or 0) / 1000,
                    )
                )
        except Exception:
            self.handleError(record)


class _StripTraceback(logging.Filter):
    """MultiprocessContext._poll reports a failed rank with logger.exception; formatting that
    traceback imports torch._dynamo (about 1.2-1.8 s, measured 1.36 s -> 0.49 s from raise to
    ChildFailedError without it). The rank's traceback is in the run directory already."""

    def filter(self, record: logging.LogRecord) -> bool:
        record.exc_info = None
        record.exc_text = None
        return True


def observe_agent(channel: Channel) -> None:
    from torch.distributed.elastic import events, metrics
    from torch.distributed.elastic.multiprocessing.api import MultiprocessContext

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_StripTraceback())

    # Create the events logger the way torch does (it caches it), then make sure INFO passes
    # whatever LOGLEVEL the user gave the ranks.
    events_logger = events._get_or_create_logger("null")
    events_logger.setLevel(logging.INFO)
    events_logger.addHandler(_EventHandler(channel))

    class _Ticks(metrics.MetricHandler):
        # The agent's monitor loop puts metrics on every pass: a tick that stops means a stuck agent.
        def emit(self, metric_data: Any) -> None:
            channel.tick()

    metrics.configure(_Ticks(), group="torchelastic")

    # Every attempt ends in MultiprocessContext.close(), after torch has joined the ranks: the
    # one place where all exit codes are known (a ChildFailedError lists only one rank).
    original_close = MultiprocessContext._close

    def _close(self: Any, death_sig: signal.Signals, timeout: int = 30) -> None:
        original_close(self, death_sig, timeout)
        if self._pc is None or getattr(self, "_elastic_nb_reported", False):
            return
        self._elastic_nb_reported = True
        codes = {}
        for local_rank, proc in enumerate(self._pc.processes):
            env = self.envs[local_rank]
            codes[env["RANK"]] = proc.exitcode
        attempt = attempt_of(self.envs[0])
        channel.send(
            protocol.launcher.Exits(kind=protocol.launcher.EXITS, attempt=attempt, codes=codes)
        )

    MultiprocessContext._close = _close  # type: ignore[method-assign]
    _report_forked_exits(channel, MultiprocessContext)

    # The agent's own failure (its rendezvous refused a state, its store went away) is said
    # before torch ends the ranks with SIGTERM: they did not fail, the agent did.
    from torch.distributed.elastic.agent.server.api import SimpleElasticAgent
    from torch.distributed.elastic.multiprocessing.api import SignalException

    original_invoke_run = SimpleElasticAgent._invoke_run

    def _invoke_run(self: Any, role: str = "default") -> Any:
        try:
            return original_invoke_run(self, role)
        except SignalException:
            raise  # the supervisor (or a user) stopped it: nothing of its own failed
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            channel.send(
                protocol.launcher.AgentFailed(
                    kind=protocol.launcher.AGENT_FAILED, error=error, t=time.time()
                )
            )
            raise

    SimpleElasticAgent._invoke_run = _invoke_run  # type: ignore[method-assign]

    hold = os.environ.get("ELASTIC_NB_TEST_HOLD_BEFORE_SET")
    if hold:
        # Tests only: widen the window of torch's agent deadlock, between reading every rank's
        # return value and Event.set() in MultiprocessContext._poll (TORCH_FACTS.md), and say
        # when it opens (a file in the run directory) so that a test's ranks can die inside it.
        original_is_done = MultiprocessContext._is_done

        def _is_done(self: Any) -> bool:
            done = original_is_done(self)
            if done:
                run_dir = os.environ[RUN_DIR_ENV]
                open(os.path.join(run_dir, "test-agent-read-results"), "w").close()
                time.sleep(float(hold))
            return done

        MultiprocessContext._is_done = _is_done  # type: ignore[method-assign]


def _report_forked_exits(channel: Channel, context: Any) -> None:
    """Say how each forked rank ended, as soon as it has.

    A rank forked by the fork server is that server's child: the server reaps it at once and
    writes its status to a socket this process reads (multiprocessing/popen_forkserver.py,
    Popen.poll), once. The supervisor, which reads a dead child's status from /proc while it is
    a zombie, never sees it. A thread per attempt waits on the ranks' sentinels and reads each
    status the moment it is there; torch's own polls take it from the Popen afterwards. One lock
    per Popen keeps the two from reading the socket at the same time.
    """
    import multiprocessing.popen_forkserver as popen_forkserver
    from multiprocessing.connection import wait

    original_poll = popen_forkserver.Popen.poll
    making = threading.Lock()

    def poll(self: Any, flag: int = os.WNOHANG) -> Any:
        lock = self.__dict__.get("_elastic_nb_lock")
        if lock is None:
            with making:
                lock = self.__dict__.setdefault("_elastic_nb_lock", threading.Lock())
        with lock:
            return original_poll(self, flag)

    popen_forkserver.Popen.poll = poll  # type: ignore[method-assign]

    def watch(attempt: int, ranks: dict[int, Any]) -> None:
        pending = {p.sentinel: (rank, p) for rank, p in ranks.items()}
        while pending:
            try:
                ready = wait(list(pending), timeout=5)
            except (OSError, ValueError):
                return  # the attempt was closed, and its sentinels with it
            for sentinel in ready:
                rank, p = pending.pop(sentinel)
                channel.send(
                    protocol.launcher.Exit(
                        kind=protocol.launcher.EXIT,
                        attempt=attempt,
                        rank=rank,
                        pid=p.pid,
                        code=p.exitcode,
                    )
                )

    original_start = context._start

    def _start(self: Any) -> None:
        original_start(self)
        if self.start_method != "forkserver":
            return  # spawned ranks are this process's children: the supervisor sees them die
        attempt = attempt_of(self.envs[0])
        ranks = {int(self.envs[i]["RANK"]): p for i, p in enumerate(self._pc.processes)}
        threading.Thread(target=watch, args=(attempt, ranks), daemon=True).start()

    context._start = _start
