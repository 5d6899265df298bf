"""The protocol between elastic_nb's processes: one module, one framing, one version.

Two channels speak it:

* kernel <-> supervisor, over a Unix socket in an owner-only directory;
* launcher -> supervisor, over a pipe (the launcher's stdout, set aside before torch loads).

A frame is one line of compact JSON (an object with a ``"kind"``), optionally followed by a raw
binary blob whose length the header gives as ``"blob"``: pushed objects travel that way, without
base64. Every message of the kernel channel is checked against `VERSION` at the handshake.

Kernel -> supervisor                      Supervisor -> kernel
  hello {version, kernel_pid}               hello {version, pid}
  submit {req, spec, cell} + blob           reply {req, ok, ...}   (to every request)
  stop {req, job, reason}                   update {job, ...}      (<= 10 per second per job)
  jobs {req}                                end {job, summary}     (once per job, last)
  status {req}
  stacks {req, job}                         (reply carries every live rank's stack)
  warm {req, on}                            (off: end the idle warm launcher now)

Launcher -> supervisor
  ready {pid}                               launcher is up, torch imported
  rendezvous {attempt, seconds}             agent finished a rendezvous
  start {attempt, rank, pid}                agent started one rank of an attempt
  exit {attempt, rank, pid, code}           a forked rank ended (its fork server reaps it at
                                            once: only the launcher learns how)
  exits {attempt, codes: {rank: code}}      agent closed an attempt (exit codes, -N = signal N)
  tick {t}                                  agent monitor loop is alive (every TICK_EVERY_S)
  result {ok, error?}                       elastic_launch returned or raised

Supervisor -> rank (the desync watch; a FIFO per rank, see rundir.RunDir.probe)
  "<n> status" or "<n> full"                the rank's flight recorder: each group's last
                                            collective, or every entry too; the rank answers
                                            into rank-R.probe.json, tagged "req": n
"""

from __future__ import annotations

import json
import signal
from collections.abc import Iterator
from typing import Any

__all__ = ["VERSION", "FrameDecoder", "ProtocolError", "encode"]

VERSION = 1

# kernel -> supervisor
HELLO = "hello"
SUBMIT = "submit"
STOP = "stop"
JOBS = "jobs"
STATUS = "status"
STACKS = "stacks"
WARM = "warm"
# supervisor -> kernel
REPLY = "reply"
UPDATE = "update"
END = "end"
# launcher -> supervisor
READY = "ready"
RENDEZVOUS = "rendezvous"
START = "start"
EXIT = "exit"
EXITS = "exits"
TICK = "tick"
RESULT = "result"

# The launcher reports its agent's monitor loop at most this often; the zombie watchdog's bound
# is built on it.
TICK_EVERY_S = 0.25

# The supervisor asks a rank for every thread's Python stack with this signal; the worker's
# faulthandler answers into the rank's .stacks file (no GIL needed: it works mid-collective).
STACK_SIGNAL = signal.SIGUSR1

# What a probe asks a rank's flight recorder for (elastic_nb/recorder.py answers).
PROBE_STATUS = "status"
PROBE_FULL = "full"

# A header line longer than this is a corrupt stream, not a message.
_MAX_HEADER = 16 * 1024 * 1024
_MAX_BLOB = 1 << 40

Message = dict[str, Any]


class ProtocolError(RuntimeError):
    """The other side sent something that is not a frame of this protocol."""


def encode(kind: str, blob: bytes | None = None, **fields: Any) -> bytes:
    header: Message = {"kind": kind, **fields}
    if blob is not None:
        header["blob"] = len(blob)
    line = json.dumps(header, separators=(",", ":"), default=str).encode() + b"\n"
    return line + blob if blob else line


class FrameDecoder:
    """Incremental decoder: feed bytes as they arrive, iterate complete (message, blob) pairs."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pending: Message | None = None  # header waiting for its blob

    def feed(self, data: bytes) -> Iterator[tuple[Message, bytes | None]]:
        self._buf += data
        while True:
            if self._pending is not None:
                size = self._pending["blob"]
                if len(self._buf) < size:
                    return
                blob = bytes(self._buf[:size])
                del self._buf[:size]
                msg, self._pending = self._pending, None
                yield msg, blob
                continue
            nl = self._buf.find(b"\n")
            if nl < 0:
                if len(self._buf) > _MAX_HEADER:
                    raise ProtocolError("header line too long")
                return
            line = bytes(self._buf[:nl])
            del self._buf[: nl + 1]
            if not line.strip():
                continue
            try:
                msg = json.loads(line)
            except ValueError as e:
                raise ProtocolError(f"not a frame: {line[:80]!r}") from e
            if not isinstance(msg, dict) or "kind" not in msg:
                raise ProtocolError(f"frame without a kind: {line[:80]!r}")
            if "blob" in msg:
                size = msg["blob"]
                if type(size) is not int or not 0 <= size <= _MAX_BLOB:
                    raise ProtocolError(f"bad blob size in {line[:80]!r}")
                self._pending = msg
                continue
            yield msg, None


def check_hello(msg: Message) -> None:
    if msg.get("kind") != HELLO:
        raise ProtocolError(f"expected hello, got {msg.get('kind')!r}")
    if msg.get("version") != VERSION:
        raise ProtocolError(
            f"protocol version {msg.get('version')} on the other side, {VERSION} here: "
            "restart the kernel after upgrading elastic_nb"
        )
