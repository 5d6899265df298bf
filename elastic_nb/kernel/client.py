"""The kernel's side of the supervisor: a transport. Start it, send it requests, and hand each
job's messages to whoever subscribed to that job.

The supervisor is started on first use, in its own session (so the kernel's interrupt never
reaches it), with a listening socket the kernel created in an owner-only directory. The kernel
keeps one connection open for its whole life: that connection is the supervisor's lifeline.
A reader thread turns frames into replies and per-job queues (`subscribe`); the cell's thread
waits on its job's queue (handle.JobHandle follows it), so an interrupt lands in the cell, which
forwards it as a stop. When the connection breaks, every queue gets `GONE`.
"""

from __future__ import annotations

import contextlib
import os
import queue
import secrets
import socket
import subprocess
import sys
import threading
import typing
from pathlib import Path
from typing import Any, TypeVar

from elastic_nb import protocol
from elastic_nb.common import modules
from elastic_nb.common.errors import Refused, SupervisorDied
from elastic_nb.common.registry import runtime_dir
from elastic_nb.common.spec import JobSpec
from elastic_nb.common.submission import Submission

__all__ = [
    "GONE",
    "SupervisorClient",
    "current_client",
    "get_client",
    "shutdown_client",
    "start_in_background",
]

HELLO_TIMEOUT_S = 30.0
REQUEST_TIMEOUT_S = 30.0
GONE = object()  # put on every queue when the supervisor's connection breaks
SLOW_DISK_BYTES_PER_S = 20e6  # a --push payload's write, at a slow disk's pace, adds to SUBMIT's


def _kernel_id() -> str | None:
    """This kernel's id as Jupyter knows it (its connection file is kernel-ID.json), so that the
    JupyterLab panel can name the notebook a supervisor's jobs run for."""
    try:
        from ipykernel.connect import get_connection_file

        name = Path(get_connection_file()).name
    except Exception:  # not an ipykernel, or not started by a connection file
        return None
    if name.startswith("kernel-") and name.endswith(".json"):
        return name[len("kernel-") : -len(".json")]
    return None


R = TypeVar("R")


class SupervisorClient:
    def __init__(self) -> None:
        self._subscribers: dict[str, queue.Queue[Any]] = {}  # job id -> its messages
        self._alive = True
        self.gone_reason = "it exited"  # what broke the connection, once it has broken
        self._start()

    # ---- lifecycle --------------------------------------------------------------------------

    def _start(self) -> None:
        stem = runtime_dir() / f"sup-{os.getpid()}-{secrets.token_hex(3)}"
        self.socket_path = f"{stem}.sock"
        self.log_path = f"{stem}.log"
        self._proc: subprocess.Popen[bytes] | None = None
        try:
            self._spawn()
            self._connect()
        except BaseException:
            # An interrupt or a failure half-way must not leave a supervisor without its kernel
            # connection: it would live as long as the kernel.
            self._alive = False
            if self._proc is not None and self._proc.poll() is None:
                self._proc.kill()
                self._proc.wait()
            raise

    def _spawn(self) -> None:
        """The kernel binds the socket and hands the listening fd over: no race to connect."""
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            listener.bind(self.socket_path)
            os.chmod(self.socket_path, 0o600)
            listener.listen(16)
            with open(self.log_path, "ab") as log:
                self._proc = subprocess.Popen(
                    [
                        sys.executable,
                        "-m",
                        modules.SUPERVISOR,
                        "--listen-fd",
                        str(listener.fileno()),
                        "--kernel-pid",
                        str(os.getpid()),
                        "--log",
                        self.log_path,
                        *(["--kernel-id", kid] if (kid := _kernel_id()) else []),
                    ],
                    pass_fds=[listener.fileno()],
                    stdin=subprocess.DEVNULL,
                    stdout=log,
                    stderr=log,
                    start_new_session=True,
                )
        finally:
            listener.close()

    def _connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._conn = protocol.connection.Connection(sock, protocol.kernel.kernel_news)
        sock.connect(self.socket_path)  # queued in the backlog until the supervisor accepts
        sock.settimeout(HELLO_TIMEOUT_S)
        self._conn.send(
            protocol.kernel.Hello(
                kind=protocol.kernel.HELLO,
                version=protocol.wire.VERSION,
                role=protocol.kernel.ROLE_KERNEL,
                kernel_pid=os.getpid(),
            )
        )
        first = None
        with contextlib.suppress(OSError):
            first = self._conn.receive()
        if first is None:
            raise SupervisorDied(
                f"the elastic_nb supervisor did not start; its log says:\n{self._log_tail()}"
            )
        hello = first[0]
        if hello["kind"] != protocol.kernel.HELLO:
            raise SupervisorDied(f"the elastic_nb supervisor said {hello['kind']!r} first")
        if hello.get("error"):
            raise SupervisorDied(str(hello.get("error")))
        protocol.kernel.check_hello(hello)
        self.pid = hello.get("pid", 0)
        sock.settimeout(None)
        self._reader = threading.Thread(target=self._read, name="elastic_nb-client", daemon=True)
        self._reader.start()

    @property
    def alive(self) -> bool:
        return self._alive

    def close(self) -> None:
        """Closing the lifeline makes the supervisor stop every job and exit."""
        self._break()
        self._conn.close()
        if self._proc is not None:
            with contextlib.suppress(subprocess.TimeoutExpired):
                self._proc.wait(timeout=10)

    def _log_tail(self, n: int = 20) -> str:
        with contextlib.suppress(OSError):
            return "\n".join(Path(self.log_path).read_text(errors="replace").splitlines()[-n:])
        return ""

    # ---- frames -----------------------------------------------------------------------------

    def _read(self) -> None:
        try:
            for msg, _ in self._conn:
                self._dispatch(msg)
        except protocol.wire.ProtocolError as e:
            # The stream cannot be trusted past this point: drop it (the supervisor then stops
            # this kernel's jobs and exits) and say why, rather than go silent.
            self.gone_reason = f"it sent a frame the kernel could not read ({e})"
            self._break()
        except OSError as e:
            self.gone_reason = f"its connection failed ({e})"
        finally:
            self._alive = False
            if self._proc is not None:
                with contextlib.suppress(subprocess.TimeoutExpired):
                    self._proc.wait(timeout=1)  # reap it
            self._conn.requests.close()
            for q in [*self._subscribers.values()]:
                q.put(GONE)

    def _dispatch(self, msg: protocol.kernel.KernelNews) -> None:
        if msg["kind"] == protocol.kernel.REPLY:
            self._conn.requests.reply(msg["req"], msg)
        elif msg["kind"] != protocol.kernel.HELLO:  # an update, a rank's prompt, the end
            q = self._subscribers.get(msg["job"])
            if q is not None:
                q.put(msg)

    def _send(self, msg: protocol.kernel.Request, blob: bytes | None = None) -> None:
        if not self._alive:
            raise SupervisorDied(f"the elastic_nb supervisor is gone: {self.gone_reason}")
        try:
            self._conn.send(msg, blob)
        except OSError as e:
            self._break()
            raise SupervisorDied(f"the elastic_nb supervisor is gone ({e})") from None
        except BaseException:
            # Interrupted half-way through a frame: the stream is corrupt from here on.
            # Dropping the connection makes the supervisor stop this kernel's jobs and
            # exit; the next %%elastic cell starts a new one.
            self._break()
            raise

    def _break(self) -> None:
        """Give up on this supervisor without waiting for it (see close)."""
        self._alive = False
        self._conn.shutdown()

    def next_req(self) -> int:
        """The number of the next request (its reply carries it back)."""
        return self._conn.requests.number()

    def send(self, msg: protocol.kernel.Request) -> None:
        """Fire and forget (a stop while the cell is being interrupted)."""
        self._send(msg)

    def request(
        self,
        msg: protocol.kernel.Request,
        reply: type[R],
        blob: bytes | None = None,
        timeout: float = REQUEST_TIMEOUT_S,
    ) -> R:
        """Send a request (numbered by `next_req`) and wait for its reply; returns the reply's
        data (of the type `reply`, which protocol.kernel.REPLIES names for the request), or
        raises Refused with the supervisor's reason."""
        kind = msg["kind"]
        assert protocol.kernel.REPLIES[kind] is reply, f"{kind} is answered with another type"
        try:
            answer = self._conn.requests.ask(msg["req"], lambda: self._send(msg, blob), timeout)
        except TimeoutError:
            # A supervisor that does not answer cannot be trusted with the next job either.
            self._break()
            raise SupervisorDied(
                f"the elastic_nb supervisor did not answer {kind!r} in {timeout:g} s; it was "
                "told to stop its jobs and a new one starts with the next %%elastic cell"
            ) from None
        except protocol.connection.Gone:
            raise SupervisorDied(
                f"the elastic_nb supervisor is gone: {self.gone_reason}; its log says:\n"
                f"{self._log_tail()}"
            ) from None
        assert answer["kind"] == protocol.kernel.REPLY
        if not answer["ok"]:
            raise Refused(kind, str(answer.get("error")))
        return typing.cast(
            R, protocol.wire.check_reply(protocol.kernel.REPLIES, kind, answer["data"])
        )

    # ---- requests ---------------------------------------------------------------------------

    def subscribe(self, job_id: str) -> queue.Queue[Any]:
        """The queue that gets every UPDATE, PROMPT and END of the job (and GONE if the connection
        breaks); subscribe before submitting, so that no message can come first."""
        q: queue.Queue[Any] = queue.Queue()
        self._subscribers[job_id] = q
        if not self._alive:
            q.put(GONE)
        return q

    def unsubscribe(self, job_id: str) -> None:
        self._subscribers.pop(job_id, None)

    def submit(self, cell: Submission) -> None:
        """Start a job (or run a cell on its session's ranks). An interrupt that lands before
        the reply still stops it."""
        try:
            # Writing a large --push payload to disk is part of the request: its time is not
            # the supervisor's slowness (a minute more per 10 GB at a slow disk's pace).
            timeout = REQUEST_TIMEOUT_S + len(cell.payload or b"") / SLOW_DISK_BYTES_PER_S
            submit = cell.request(self.next_req())
            self.request(submit, protocol.kernel.Submitted, cell.payload, timeout=timeout)
        except KeyboardInterrupt:
            with contextlib.suppress(SupervisorDied):
                self.send_stop(cell.id, "interrupt")
            raise

    def up(self, session_id: str, spec: JobSpec) -> protocol.kernel.SessionUp:
        """Start a session (subscribe to `session_id` first: its updates and end come as a
        job's). An interrupt that lands before the reply still ends it."""
        up = protocol.kernel.Up(
            kind=protocol.kernel.UP,
            req=self.next_req(),
            session=session_id,
            spec=spec.to_dict(),
            env=dict(os.environ),
        )
        try:
            return self.request(up, protocol.kernel.SessionUp)
        except KeyboardInterrupt:
            with contextlib.suppress(SupervisorDied):
                self.send(
                    protocol.kernel.Down(
                        kind=protocol.kernel.DOWN, req=self.next_req(), session=session_id
                    )
                )
            raise

    def down(self, session_id: str) -> None:
        down = protocol.kernel.Down(
            kind=protocol.kernel.DOWN, req=self.next_req(), session=session_id
        )
        self.request(down, protocol.kernel.Done)

    def session(self, session_id: str) -> protocol.kernel.SessionState:
        return self.request(
            protocol.kernel.SessionInfo(
                kind=protocol.kernel.SESSION, req=self.next_req(), session=session_id
            ),
            protocol.kernel.SessionState,
        )

    def stop(self, job_id: str | None = None, reason: str = "user") -> list[str]:
        stop = protocol.kernel.Stop(
            kind=protocol.kernel.STOP, req=self.next_req(), job=job_id, reason=reason
        )
        return self.request(stop, protocol.kernel.Stopping)["stopping"]

    def send_stop(self, job_id: str, reason: str) -> None:
        """Stop a job without waiting for the answer (the cell is being interrupted)."""
        self.send(
            protocol.kernel.Stop(
                kind=protocol.kernel.STOP, req=self.next_req(), job=job_id, reason=reason
            )
        )

    def answer(self, prompt: protocol.kernel.Prompt, text: str | None, why: str | None) -> None:
        """The notebook's answer to a rank's prompt: the line typed, or None and why."""
        answer = protocol.kernel.Input(
            kind=protocol.kernel.INPUT,
            req=self.next_req(),
            job=prompt["job"],
            attempt=prompt["attempt"],
            rank=prompt["rank"],
            ask=prompt["ask"],
            text=text,
            why=why,
        )
        self.request(answer, protocol.kernel.Done)

    def stacks(self, job_id: str | None = None) -> str:
        """Every rank's stack, now, of the job (the latest running one by default)."""
        msg = protocol.kernel.Stacks(kind=protocol.kernel.STACKS, req=self.next_req(), job=job_id)
        return self.request(msg, protocol.kernel.StackText)["text"]

    def keep_warm(self, on: bool) -> None:
        warm = protocol.kernel.Warm(kind=protocol.kernel.WARM, req=self.next_req(), on=on)
        self.request(warm, protocol.kernel.Done)

    def jobs(self) -> list[protocol.kernel.JobRow]:
        jobs = protocol.kernel.Jobs(kind=protocol.kernel.JOBS, req=self.next_req())
        return self.request(jobs, protocol.kernel.JobList)["jobs"]

    def status(self) -> protocol.kernel.SupervisorStatus:
        status = protocol.kernel.Status(kind=protocol.kernel.STATUS, req=self.next_req())
        return self.request(status, protocol.kernel.SupervisorStatus)

    def nodes(self) -> protocol.kernel.MachineList:
        nodes = protocol.kernel.Nodes(kind=protocol.kernel.NODES, req=self.next_req())
        return self.request(nodes, protocol.kernel.MachineList)

    def join(self, host: str | None, port: int, new_token: bool) -> protocol.kernel.JoinLine:
        return self.request(
            protocol.kernel.Join(
                kind=protocol.kernel.JOIN,
                req=self.next_req(),
                host=host,
                port=port,
                new_token=new_token,
            ),
            protocol.kernel.JoinLine,
        )


_client: SupervisorClient | None = None
_client_lock = threading.Lock()


def current_client() -> SupervisorClient | None:
    """This kernel's supervisor if it is running; never starts one."""
    with _client_lock:
        return _client if _client is not None and _client.alive else None


def get_client() -> SupervisorClient:
    """This kernel's supervisor, started on first use and again if it died."""
    global _client
    with _client_lock:
        if _client is None or not _client.alive:
            _client = SupervisorClient()
        return _client


def start_in_background() -> None:
    """Start this kernel's supervisor now, without waiting for it: its zygote imports torch
    and forks a warm launcher while the user writes the first cell (%load_ext). A failure is
    left for the first cell, which starts the supervisor again and says why it cannot."""

    def start() -> None:
        with contextlib.suppress(Exception):
            get_client()

    threading.Thread(target=start, name="elastic_nb-start", daemon=True).start()


def shutdown_client() -> None:
    global _client
    with _client_lock:
        if _client is not None:
            _client.close()
            _client = None
