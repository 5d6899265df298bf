"""A session's rank: the worker bootstrap's preparation once, then a loop of cells.

torchelastic calls `serve(run_dir, env, start_env)` in each rank of a session (``%elastic up``),
as it calls `bootstrap.bootstrap` for a one-off job. The rank prepares itself exactly as a one-off
rank does, connects to the session's Unix socket (the supervisor's private channel, in the
owner-only socket directory: no cell ever travels through torch's unauthenticated TCPStore),
says who it is, and runs the cells it is sent, one at a time, in one ``__main__`` that lives as
long as the rank: names a cell defines stay defined for the next.

Each cell has a run directory of its own (its source, how to run it, pushed objects); the rank
leaves its outcome there as a one-off rank would (failure or done record, rank 0's result, the
``--pull`` objects) and then says ``ran``. A cell that raises does not end the rank: the loop
goes on with the next cell.

Interrupting a cell: the supervisor sends ``interrupt`` for it; a reader thread (the main thread
is inside the cell) signals the main thread with SIGINT, whose handler raises KeyboardInterrupt
only while that cell runs. A rank stuck in C++ (a collective) cannot take it; the supervisor
then ends the group and torchelastic restarts it.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import socket
import sys
import threading
from collections.abc import Iterator
from typing import Any

from elastic_nb import protocol
from elastic_nb.common.rundir import RunDir
from elastic_nb.common.spec import JobSpec
from elastic_nb.rank import bootstrap
from elastic_nb.rank.notebook_input import written

__all__ = ["serve"]


def serve(run_dir: str, env: dict[str, str], start_env: dict[str, str]) -> bool:
    """Run the session's cells in this rank until the supervisor says bye (or goes)."""
    me = bootstrap.prepare(run_dir, env, start_env)
    bootstrap.refuse_a_bad_fork()  # before any cell: this rank's restarts would all fail alike
    channel = _Channel(os.environ[protocol.sessions.SESSION_SOCKET_ENV])
    channel.send(
        protocol.sessions.RankHello(
            kind=protocol.sessions.RANK_HELLO, rank=me.rank, attempt=me.attempt, pid=os.getpid()
        )
    )
    while True:
        msg = channel.next()
        if msg is None or msg["kind"] != protocol.sessions.RUN:
            return True  # bye, or the supervisor is gone
        cell = msg["cell"]
        ok = _run_one(channel, RunDir(msg["run_dir"]), cell, me)
        sys.stdout.flush()
        sys.stderr.flush()
        channel.send(
            protocol.sessions.Ran(
                kind=protocol.sessions.RAN, cell=cell, ok=ok, out=written(1), err=written(2)
            )
        )


def _run_one(channel: _Channel, crd: RunDir, cell: str, me: bootstrap.Rank) -> bool:
    """One cell, its records in its own run directory (as a job's rank leaves them). True if it
    finished; a cell that raised leaves the rank in the loop."""
    crd.attempt(me.attempt).mkdir(exist_ok=True)
    meta = json.loads(crd.cell_meta.read_text())
    spec = JobSpec.from_json(crd.spec.read_text())
    sys.argv = [str(crd.cell)]
    around = channel.running(cell)
    error = bootstrap.run_cell(
        crd, meta, spec, me.attempt, me.rank, me.namespace, around, final=False
    )
    return error is None


class _Channel:
    """The rank's end of the session socket: a reader thread queues the cells to run and acts
    on interrupts at once (the main thread may be deep in a cell); the main thread sends."""

    def __init__(self, path: str) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.connect(path)
        self._conn = protocol.connection.Connection(sock, protocol.sessions.session_order)
        self._lock = threading.Lock()  # `_current` and `_cancelled`, between the two threads
        self._current: str | None = None  # the cell the main thread runs
        self._cancelled: set[str] = set()  # interrupted before they started
        self._queue: queue.Queue[protocol.sessions.Run | protocol.sessions.Bye | None] = (
            queue.Queue()
        )
        self._main = threading.main_thread().ident
        signal.signal(signal.SIGINT, self._on_sigint)
        threading.Thread(target=self._read, name="elastic_nb-session", daemon=True).start()

    def send(self, msg: protocol.sessions.RankNews) -> None:
        self._conn.send(msg)

    def next(self) -> protocol.sessions.Run | protocol.sessions.Bye | None:
        """The next message for the main thread (a cell to run, or bye); None: the supervisor
        is gone."""
        return self._queue.get()

    @contextlib.contextmanager
    def running(self, cell: str) -> Iterator[None]:
        with self._lock:
            if cell in self._cancelled:
                self._cancelled.discard(cell)
                raise KeyboardInterrupt
            self._current = cell
        try:
            yield
        finally:
            with self._lock:
                self._current = None

    def _on_sigint(self, signum: int, frame: Any) -> None:
        # Only a cell is interruptible: between cells the loop must go on.
        if self._current is not None:
            raise KeyboardInterrupt

    def _read(self) -> None:
        try:
            for msg, _ in self._conn:
                if msg["kind"] == protocol.sessions.INTERRUPT:
                    self._interrupt(msg["cell"])
                else:
                    self._queue.put(msg)
        except (OSError, protocol.wire.ProtocolError):
            pass
        self._queue.put(None)

    def _interrupt(self, cell: str) -> None:
        with self._lock:
            if self._current == cell:
                assert self._main is not None
                signal.pthread_kill(self._main, signal.SIGINT)
            else:
                self._cancelled.add(cell)  # not started yet (or already over: then harmless)
