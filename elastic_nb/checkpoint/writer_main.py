"""The writer process's side of an async save (writer.py is the rank's): what runs in the process
(`main`: take a request, write its items with DCP's own writer, pausing after each, answer), and
the messages between the two (a length, then a pickle; file descriptors ride on the length)."""

from __future__ import annotations

import contextlib
import io
import math
import mmap
import os
import pickle
import socket
import struct
import threading
import time
import traceback
from typing import Any

__all__ = ["main", "recv", "send", "tensor_at"]

_HEADER = struct.Struct("!Q")


def tensor_at(buffer: mmap.mmap, offset: int, dtype: Any, shape: tuple[int, ...]) -> Any:
    """A tensor over `buffer` at `offset`, with a storage of its own size (torch.save writes a
    tensor's whole storage)."""
    import torch

    return torch.frombuffer(buffer, dtype=dtype, count=math.prod(shape), offset=offset).view(shape)


# Set when the rank waits for the write in flight (`WriterProcess.hurry`), until the reply.
_HURRY = threading.Event()


class _Staged:
    """The part of a SavePlanner DCP's write_data uses: each write item's data. DCP asks for an
    item right before it writes it, so the time since the last ask is the last item's write:
    the pause after it (`DUTY`) is taken here."""

    def __init__(self, data: dict[Any, Any], duty: float) -> None:
        self._data = data
        self._pause = (1 - duty) / duty
        self._last: float | None = None

    def resolve_data(self, item: Any) -> Any:
        if self._last is not None:
            _HURRY.wait((time.perf_counter() - self._last) * self._pause)
        self._last = time.perf_counter()
        return self._data[item.index]


def _write(request: dict[str, Any], buffer: mmap.mmap | None, duty: float) -> list[Any]:
    import torch
    from torch.distributed.checkpoint import FileSystemWriter

    kind, path, fsync = request["target"]
    writer: Any
    if kind == "fsspec":
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        writer = FsspecWriter(path, sync_files=fsync)
    else:
        writer = FileSystemWriter(path, sync_files=fsync)
    plan = request["plan"]
    data: dict[Any, Any] = {}
    for item, how in zip(plan.items, request["items"], strict=True):
        if how[0] == "bytes":
            data[item.index] = io.BytesIO(how[1])
        elif how[0] == "empty":
            data[item.index] = torch.empty(how[2], dtype=how[1])
        else:
            assert buffer is not None
            data[item.index] = tensor_at(buffer, how[1], how[2], how[3])
    written = writer.write_data(plan, _Staged(data, duty))
    return list(written.value())


def _exit_with(alive_r: int) -> None:
    """The rank keeps the pipe's other end open: a byte is a hurry, end of file the rank's death
    (or close), and a write of a rank that died is of no use to anyone."""
    while os.read(alive_r, 1):
        _HURRY.set()
    os._exit(0)


def main(sock: str, alive: str, nice: str, duty: str) -> None:
    threading.Thread(target=_exit_with, args=(int(alive),), daemon=True).start()
    # What a write needs is imported before the writer is niced: niced on a machine whose cores
    # other processes keep busy, the import's few seconds of CPU would take minutes to get.
    import torch.distributed.checkpoint
    import torch.distributed.checkpoint._fsspec_filesystem  # noqa: F401
    from torch.serialization import set_crc32_options

    set_crc32_options(False)  # this thread writes only checkpoints: see crc32_off
    os.setpriority(os.PRIO_PROCESS, 0, int(nice))
    conn = socket.socket(fileno=int(sock))
    buffer: mmap.mmap | None = None
    while True:
        try:
            request, fds = recv(conn)
        except EOFError:
            return
        if _HURRY.is_set():  # the rank waits for this save already (its hurry came first)
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, 0, 0)
        if fds:
            buffer = mmap.mmap(fds[0], request["size"])  # the last one's tensors are gone
            for fd in fds:
                os.close(fd)
        try:
            reply: tuple[Any, ...] = ("ok", _write(request, buffer, float(duty)))
        except Exception as e:
            traceback.print_exc()
            reply = ("error", f"{type(e).__name__}: {e}")
        # Niced again before the reply, so that the next save starts niced.
        _HURRY.clear()
        os.setpriority(os.PRIO_PROCESS, 0, int(nice))
        send(conn, reply)


# -- messages: a length, then a pickle; file descriptors ride on the length ---------------------


def send(sock: socket.socket, message: Any, fds: list[int] | tuple[()] = ()) -> None:
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    header = _HEADER.pack(len(data))
    sent = socket.send_fds(sock, [header], list(fds)) if fds else 0
    sock.sendall(header[sent:] + data)


def recv(sock: socket.socket) -> tuple[Any, list[int]]:
    header, fds, _, _ = socket.recv_fds(sock, _HEADER.size, 4)
    if not header:
        raise EOFError
    header += _read(sock, _HEADER.size - len(header))
    return pickle.loads(_read(sock, _HEADER.unpack(header)[0])), fds


def _read(sock: socket.socket, n: int) -> bytes:
    out = bytearray(n)
    view, got = memoryview(out), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if not k:
            raise EOFError
        got += k
    return bytes(out)
