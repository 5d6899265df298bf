"""The rank's side of the process that writes its async saves (writer_main.py is what runs in it):
started by the rank at its first async save, it lives as long as the rank (or until
`Checkpoints.close`).

Why a process: a thread writing beside training shares the rank's GIL, and DCP's writer holds it
while it serializes (torch.save into a Python stream, item by item). As a thread of the rank
(commit b0c2b45, P14 on 2 ranks and 2 cores), the step was 1.40x slower beside a nice-0 writer,
1.15x (1.27x in make bench) beside a nice-10 one, 1.27x beside a nice-19 one, which starved while
holding the GIL. A process has a GIL of its own; what it still takes from training is a share of
the cores and of what writing costs besides (the page cache's, the disk's), which its nice value
(`NICE`) and the share of its time it writes (`DUTY`) bound.

What crosses to it is only the writing. DCP plans and commits in the rank, as `dcp.save` does
(its collectives on the checkpoint's group, `.metadata` by the coordinator): the StorageWriter
made by `storage_writer` hands DCP's `write_data` over to this process. Its staging copies exactly
the tensors this rank's final plan writes (DCP spreads a replicated state over the ranks: on N
ranks each copies 1/N of a DDP model) into shared memory (a memfd, mapped by both processes and
kept from one save to the next); the training thread goes on once that copy is made. The writer
makes tensors over the same memory and writes them with DCP's own FileSystemWriter (FsspecWriter
for a URL), in the files and format `dcp.save` writes.

torch.distributed.checkpoint's own process option (AsyncCheckpointerType.PROCESS,
_async_process_executor.py) was measured too, and not kept: see benchmarks/README.md (P14).
"""

from __future__ import annotations

import contextlib
import functools
import io
import mmap
import os
import select
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from elastic_nb.checkpoint import writer_main
from elastic_nb.checkpoint.writer_main import recv, send, tensor_at

__all__ = ["DUTY", "NICE", "Handover", "WriterProcess", "crc32_off", "storage_writer"]

# The writer's nice value while it writes. Where training keeps every core busy, Linux gives a
# nice-19 process about 1.5% of a core it shares with a nice-0 one (weights 15 and 1024), so the
# write waits for the moments training leaves a core idle (its collectives, its data loading, the
# GPU's work); where cores are idle, it writes at full speed. The next save waits for this one,
# and a rank waiting there leaves its core to the writer, so a starved write never falls more
# than one save behind. Where other processes keep the cores busy too, a waiting rank gives the
# writer back a nice-0 priority (`hurry`) where it may (root, or CAP_SYS_NICE).
NICE = 19
# The share of its time the writer spends writing while training goes on: after each item it
# pauses three times as long as the item took. Niced alone, this writer still slowed P14's steps
# 1.43x here (a plain nice-19 process writing the same 600 MB, 1.2x: what writing costs the page
# cache and the disk is not the writer's to be niced); pausing so, 1.05x in the same run (P14:
# 1.04x and 1.07x). A save then takes about four times as long as its write; a rank that waits
# for it lifts the pauses (`hurry`). benchmarks/README.md has every design measured.
DUTY = 0.25
_EXIT_POLL_S = 0.2
_ALIGN = 64  # each tensor's place in the shared memory starts on a cache line
# The writer's command line (not `-m`: runpy would find the module imported already, by this one).
_MAIN = f"import sys; from {writer_main.__name__} import main; main(*sys.argv[1:])"


class Handover:
    """The moment the training thread may go on with a save in flight: the state it passed to
    save() has been copied. If it stops waiting before (an interrupt), the save fails rather than
    write tensors training changed meanwhile."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._abandoned = False

    def staged(self) -> None:
        """The copy is made (called by the thread that made it)."""
        with self._lock:
            if self._abandoned:
                raise RuntimeError(
                    "elastic_nb.checkpoint: the save was interrupted while its state was copied"
                )
            self._done.set()

    def release(self) -> None:
        """Whatever happened, the training thread waits no longer (the save's thread, last)."""
        self._done.set()

    def wait(self) -> None:
        try:
            self._done.wait()
        except BaseException:
            with self._lock:
                self._abandoned = not self._done.is_set()
            raise


class WriterProcess:
    """The rank's side: the writer process, the socket to it, and the shared memory the staged
    tensors lie in. One save at a time (the package's commit thread)."""

    def __init__(self) -> None:
        self._proc: subprocess.Popen[bytes] | None = None
        self._sock: socket.socket | None = None
        self._alive_w: int | None = None  # its closing tells the writer that this rank is gone
        self._memfd: int | None = None
        self._map: mmap.mmap | None = None
        self._size = 0
        self._send_fd = False  # the writer has yet to map the current shared memory
        # hurry() comes from the training thread: the pipe's fd must not be closed (and its
        # number reused) under it by the save thread
        self._lock = threading.Lock()

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    def write(
        self, target: tuple[str, str, bool], plan: Any, planner: Any, handover: Handover
    ) -> list[Any]:
        """DCP's write_data for this rank's final `plan`: copy what it writes, release the
        training thread, have the writer write it; its WriteResults."""
        import torch

        if not plan.items:  # DCP gave this rank nothing to write (another holds every replica)
            handover.staged()
            return []
        self._ensure_started()
        data = [planner.resolve_data(item) for item in plan.items]
        places: list[int | None] = []
        offset = 0
        for value in data:
            if isinstance(value, torch.Tensor) and value.numel():
                places.append(offset)
                offset += -(-value.numel() * value.element_size() // _ALIGN) * _ALIGN
            else:
                places.append(None)
        self._reserve(offset)
        items: list[tuple[Any, ...]] = []
        with torch.no_grad():
            for value, place in zip(data, places, strict=True):
                if isinstance(value, io.BytesIO):
                    items.append(("bytes", value.getvalue()))
                elif place is None:  # an empty tensor: nothing to copy
                    items.append(("empty", value.dtype, tuple(value.shape)))
                else:
                    self._view(place, value.dtype, tuple(value.shape)).copy_(value.detach())
                    items.append(("shared", place, value.dtype, tuple(value.shape)))
        del data
        handover.staged()
        request = {"target": target, "plan": plan, "items": items, "size": self._size}
        assert self._sock is not None and self._proc is not None
        try:
            fds = [self._memfd] if self._send_fd and self._memfd is not None else []
            send(self._sock, request, fds)
            self._send_fd = False
            # A rank that ends with this save in flight waits for it (its exit joins this
            # thread, once its main thread has stopped): that is a wait too.
            exiting = False
            while not select.select([self._sock], [], [], _EXIT_POLL_S)[0]:
                if not exiting and not threading.main_thread().is_alive():
                    exiting = True
                    self.hurry()
            reply, _ = recv(self._sock)
        except (OSError, EOFError) as e:
            code = self._proc.poll()
            self._stop()
            raise RuntimeError(
                f"elastic_nb.checkpoint: the process writing this rank's async saves (pid "
                f"{self.pid}) is gone (exit code {code}): {type(e).__name__}: {e}"
            ) from None
        if reply[0] != "ok":
            raise RuntimeError(f"elastic_nb.checkpoint: the writer process failed: {reply[1]}")
        return list(reply[1])

    def hurry(self) -> None:
        """The rank waits for the write in flight: the writer writes without pausing until it
        replies, and at nice 0 where this process may raise a priority (Linux lets only root or
        CAP_SYS_NICE do so; elsewhere the write goes on niced). The writer writes in its main
        thread, whose id is its pid (setpriority sets one thread's)."""
        with self._lock:
            if self._proc is None or self._proc.poll() is not None or self._alive_w is None:
                return
            with contextlib.suppress(OSError):
                os.write(self._alive_w, b"!")
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, self._proc.pid, 0)

    def close(self) -> None:
        """End the writer (it exits once its socket closes) and free the shared memory."""
        self._stop()
        if self._map is not None:
            with contextlib.suppress(BufferError):  # a staged tensor still alive: GC frees it
                self._map.close()
            self._map = None
        if self._memfd is not None:
            os.close(self._memfd)
            self._memfd = None
        self._size = 0

    def _ensure_started(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            return
        self._stop()
        mine, theirs = socket.socketpair()
        alive_r, alive_w = os.pipe()
        # elastic_nb where this rank found it (a rank may have it on sys.path only); no CUDA in
        # the writer (DCP's loader would create a context on a GPU to copy CPU tensors).
        root = str(Path(__file__).resolve().parent.parent.parent)
        path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
        env = {**os.environ, "PYTHONPATH": path, "CUDA_VISIBLE_DEVICES": "", "OMP_NUM_THREADS": "1"}
        try:
            args = (theirs.fileno(), alive_r, NICE, DUTY)
            self._proc = subprocess.Popen(
                [sys.executable, "-c", _MAIN, *map(str, args)],
                pass_fds=(theirs.fileno(), alive_r),
                env=env,
                stdin=subprocess.DEVNULL,
            )
        finally:
            theirs.close()
            os.close(alive_r)
        with self._lock:
            self._sock, self._alive_w = mine, alive_w
        self._send_fd = True  # a new writer maps the shared memory anew

    def _stop(self) -> None:
        with self._lock:
            if self._sock is not None:
                self._sock.close()
                self._sock = None
            if self._alive_w is not None:
                os.close(self._alive_w)
                self._alive_w = None
        if self._proc is not None:
            # At nice 0 where this process may raise a priority (see hurry): niced 19 on a busy
            # machine, the writer waited over a second for the CPU its exit takes.
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, self._proc.pid, 0)
            try:
                self._proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()

    def _reserve(self, size: int) -> None:
        """Shared memory for `size` bytes: the current one where it is large enough."""
        if size <= self._size:
            return
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()
        if self._memfd is not None:
            os.close(self._memfd)
        self._memfd = os.memfd_create("elastic_nb-checkpoint", os.MFD_CLOEXEC)
        os.ftruncate(self._memfd, size)
        self._map = mmap.mmap(self._memfd, size)
        self._size, self._send_fd = size, True

    def _view(self, offset: int, dtype: Any, shape: tuple[int, ...]) -> Any:
        assert self._map is not None
        return tensor_at(self._map, offset, dtype, shape)


def storage_writer(
    path: str,
    *,
    url: bool,
    fsync: bool,
    process: WriterProcess | None = None,
    handover: Handover | None = None,
) -> Any:
    """DCP's writer for `path` (FsspecWriter for a URL, as DCP's _storage_utils.py picks), whose
    records carry no CRC32 (`crc32_off`). With `process`, DCP's write_data is done by that
    process (an async save), and `handover` is released once the state is copied."""
    from torch.distributed.checkpoint import FileSystemWriter

    base: type = FileSystemWriter
    if url:
        from torch.distributed.checkpoint._fsspec_filesystem import FsspecWriter

        base = FsspecWriter

    class Writer(base):
        def write_data(self, plan: Any, planner: Any) -> Any:
            import torch

            if process is None:
                with crc32_off():
                    return super().write_data(plan, planner)
            assert handover is not None
            target = ("fsspec" if url else "file", str(self.path), fsync)
            done: torch.futures.Future[list[Any]] = torch.futures.Future()
            done.set_result(process.write(target, plan, planner, handover))
            return done

    return Writer(path, sync_files=fsync)


@contextlib.contextmanager
def crc32_off() -> Iterator[None]:
    """torch.save without the CRC32 of each record, in this thread, for as long as this lasts.

    DCP writes each tensor with torch.save into the rank's file (filesystem.py, _write_item),
    and torch.save computes a CRC32 of every byte by default: half its time on P14's model here
    (600 MB a rank: 0.67 s with it, 0.32 s without, one process). Nothing reads it back:
    torch.load never checks it (torch is built with MINIZ_DISABLE_ZIP_READER_CRC32_CHECKS; a
    flipped byte in a record loads silently either way), and DCP reads each record with
    torch.load; only unzip-style tools would check it. DCP's writes must run in this thread:
    FileSystemWriter's default thread_count of 1 does; a writer with more threads writes their
    records with a CRC32, as before.

    torch 2.13 keeps the option per thread (its config module holds a user's settings in a
    ContextVar: torch/utils/_config_module.py); torch 2.11 keeps it for the whole process, where
    turning it off would take the CRC32 from another thread's torch.save meanwhile (a user's
    own): there this leaves it on (`_crc32_is_per_thread`)."""
    from torch.serialization import get_crc32_options, set_crc32_options

    if not _crc32_is_per_thread():
        yield
        return
    before = get_crc32_options()
    set_crc32_options(False)
    try:
        yield
    finally:
        set_crc32_options(before)


@functools.cache
def _crc32_is_per_thread() -> bool:
    """Whether a thread's set_crc32_options is its own: a thread of its own flips it, and this
    one reads it meanwhile (the probe puts it back before it ends)."""
    from torch.serialization import get_crc32_options, set_crc32_options

    here = get_crc32_options()
    flipped, read = threading.Event(), threading.Event()

    def probe() -> None:
        set_crc32_options(not here)
        flipped.set()
        read.wait()
        set_crc32_options(here)

    thread = threading.Thread(target=probe, name="elastic_nb-crc32-probe")
    thread.start()
    flipped.wait()
    mine = get_crc32_options()
    read.set()
    thread.join()
    return mine == here


# -- the writer process -----------------------------------------------------------------------
