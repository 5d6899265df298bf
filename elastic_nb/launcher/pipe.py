"""The launcher's frames to the supervisor, on the pipe that was its stdout (set aside before
torch loaded: nothing torch or C++ prints can corrupt it)."""

from __future__ import annotations

import os
import threading
import time

from elastic_nb import protocol

__all__ = ["Channel"]


class Channel:
    """Frames to the supervisor. Written from the agent's thread and from logging handlers."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._lock = threading.Lock()
        self._last_tick = 0.0

    def send(self, msg: protocol.launcher.LauncherNews) -> None:
        data = protocol.wire.encode(msg)
        with self._lock:
            try:
                while data:
                    data = data[os.write(self._fd, data) :]
            except BrokenPipeError:
                pass  # the supervisor is gone; our parent-death signal ends us

    def tick(self) -> None:
        now = time.monotonic()
        if now - self._last_tick >= protocol.launcher.TICK_EVERY_S:
            self._last_tick = now
            self.send(protocol.launcher.Tick(kind=protocol.launcher.TICK, t=time.time()))
