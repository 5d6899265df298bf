"""Files between the notebook's machine and a joined node.

* **Out** (`pack`, `unpack`): what a group's ranks read, sent once to each node as a tar: the
  run directory's inputs (spec, cell, how to run it, pushed objects) and the notebook's own
  modules the cell imports (they land in the per-job working directory, first on sys.path).
* **Back** (`Mirror` on the node, `NodeFiles` and `write_chunk` on the notebook's side):
  everything the node's ranks and launcher leave in their run directory (logs, records, stack
  dumps, flight recorders, results) is copied into the notebook's run directory as it grows, so
  that every reader there (the log tailer, the rank book, `%elastic logs`) reads one place, and
  a node's files are kept up to the moment it vanished. Rank numbers are global, so a rank's
  files sit where they would on one machine; a node's own files (its launcher's log) go under
  ``nodes/<node>/``. A node writes only the files of the ranks its launcher started (it says
  so before it sends any of theirs), its own folder, and, where it runs rank 0, the checkpoint
  records; at most `MAX_FILE` bytes of one file and `MAX_GROUP` of one group.
"""

from __future__ import annotations

import io
import os
import re
import stat
import tarfile
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath

from elastic_nb.common.rundir import CHECKPOINTS

__all__ = [
    "INPUTS",
    "MAX_FILE",
    "MAX_GROUP",
    "Mirror",
    "NodeFiles",
    "from_node",
    "owner",
    "pack",
    "unpack",
    "write_chunk",
]

# A run directory's files that come from the notebook (never sent back).
INPUTS = frozenset({"spec.json", "cell.py", "cell.json", "payload.pkl"})
CHUNK = 1 << 20  # bytes of one file in one message (the channel takes 2 MiB frames)
_ATTEMPT = re.compile(r"attempt-(\d+)")
# A rank's file in an attempt's folder: rank-3.out, rank-3.done.json, fr-rank-3 (its flight
# recorder).
_RANK_FILE = re.compile(r"(?:fr-)?rank-(\d+)(?:\..+)?")
# A node's files: a disk is not another machine's to fill (a result or a memory snapshot is a
# few GB at most; logs past this are a runaway loop).
MAX_FILE = 4 << 30  # bytes of one file
MAX_GROUP = 16 << 30  # bytes of one group's files from one node, rewrites counted
# Probe FIFOs and their answers are the node's own business (the probe's answer travels as one).
_LOCAL_SUFFIXES = (".probe", ".probe.json", ".tmp")


def pack(files: dict[str, Path]) -> bytes:
    """A tar of `files` (name in the archive -> path here); directories are taken whole."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w") as tar:
        for name, path in files.items():
            if path.exists():
                tar.add(str(path), arcname=name, filter=_plain)
    return out.getvalue()


def _plain(info: tarfile.TarInfo) -> tarfile.TarInfo | None:
    if "__pycache__" in info.name or not (info.isfile() or info.isdir()):
        return None
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    return info


def unpack(blob: bytes, dest: dict[str, Path]) -> None:
    """Each member under the destination of its first path component (``run/spec.json`` ->
    ``dest["run"] / "spec.json"``); members elsewhere, absolute or climbing out, are refused."""
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r") as tar:
        for member in tar.getmembers():
            parts = PurePosixPath(member.name).parts
            if not parts or parts[0] not in dest or ".." in parts or member.name.startswith("/"):
                raise ValueError(f"unexpected file in a job's files: {member.name!r}")
            if not (member.isfile() or member.isdir()):
                raise ValueError(f"not a plain file in a job's files: {member.name!r}")
            target = dest[parts[0]].joinpath(*parts[1:])
            if member.isdir():
                target.mkdir(parents=True, exist_ok=True, mode=0o700)
                continue
            target.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
            source = tar.extractfile(member)
            assert source is not None
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "wb") as f:
                f.write(source.read())


@dataclass
class _Sent:
    inode: int
    size: int
    mtime: int


@dataclass
class Mirror:
    """A node's side: what grew in its run directories since the last sweep, sent in chunks.

    `roots`: a directory here -> (its group, the name the notebook's side knows it by: "" for
    the group's run directory, a session cell's id for that cell's); `renames`: a file's
    relative path -> where it goes instead (the launcher's log, under nodes/<node>/)."""

    send: Callable[[str, str, str, int, bytes], Awaitable[None]]  # group, root, path, offset, data
    # Whether a file (group, path) may go now: a rank's once the supervisor has heard that the
    # launcher started it (until then it waits for the next sweep).
    ready: Callable[[str, str], bool] = lambda group, rel: True
    roots: dict[Path, tuple[str, str]] = field(default_factory=dict)
    renames: dict[str, str] = field(default_factory=dict)
    _sent: dict[Path, _Sent] = field(default_factory=dict)

    async def sweep(
        self, group: str | None = None, only: Callable[[Path], bool] | None = None
    ) -> None:
        """Send what is new (of `group`'s directories alone, if given). `only`: just these
        files (a rank's, as it is seen gone)."""
        for top, (g, root) in list(self.roots.items()):
            if group is not None and g != group:
                continue
            for path in _files(top):
                if only is None or only(path):
                    await self._send_new(top, g, root, path)

    def drop(self, group: str) -> None:
        """The group has ended: its directories are no longer watched."""
        for top in [t for t, (g, _) in self.roots.items() if g == group]:
            del self.roots[top]
            for path in [p for p in self._sent if p.is_relative_to(top)]:
                del self._sent[path]

    async def _send_new(self, top: Path, group: str, root: str, path: Path) -> None:
        try:
            st = path.stat()
        except FileNotFoundError:
            return
        last = self._sent.get(path)
        mtime = st.st_mtime_ns
        if last is not None and (last.inode, last.size, last.mtime) == (
            st.st_ino,
            st.st_size,
            mtime,
        ):
            return
        rel = path.relative_to(top).as_posix()
        rel = self.renames.get(rel, rel)
        if not from_node(rel) or not self.ready(group, rel):
            return  # the notebook's side would refuse it (now)
        replaced = last is None or last.inode != st.st_ino or st.st_size < last.size
        offset = 0 if replaced else last.size  # type: ignore[union-attr]
        try:
            f = path.open("rb")
        except FileNotFoundError:
            return  # gone since its stat
        with f:
            f.seek(offset)
            first = True
            while True:
                data = f.read(CHUNK)
                if not data and not first:
                    break
                # The first chunk of a replaced file says so (-1): the notebook's copy restarts.
                await self.send(group, root, rel, -1 if replaced and first else offset, data)
                offset += len(data)
                first = False
                if len(data) < CHUNK:
                    break
        self._sent[path] = _Sent(st.st_ino, offset, mtime)


def _files(top: Path) -> list[Path]:
    """The files worth sending under `top` (its top level and its attempt folders), less the
    node's own business; which of them the notebook's side takes is `from_node`'s to say."""
    out: list[Path] = []
    try:
        entries = list(os.scandir(top))
    except FileNotFoundError:
        return out
    for e in entries:
        if e.is_dir(follow_symlinks=False):
            if e.name.startswith("attempt-"):
                out.extend(_files(Path(e.path)))
            continue
        if e.name.endswith(_LOCAL_SUFFIXES) or e.name.startswith("."):
            continue
        if stat.S_ISREG(e.stat(follow_symlinks=False).st_mode):
            out.append(Path(e.path))
    # A rank's done or failure record last: whoever reads it finds the rest of what the rank
    # left (its flight recorder, its last lines) already there.
    return sorted(out, key=lambda p: p.name.endswith((".done.json", ".failure.json")))


def from_node(rel: str) -> bool:
    """Whether a node may write this file of a run directory: its ranks' (in an attempt's
    folder), its own (under nodes/), the checkpoint records its rank 0 keeps; never what the
    notebook's side wrote there (the spec a later round's launcher here reads, the pushed
    objects ranks here unpickle, the supervisor's events and summary)."""
    parts = PurePosixPath(rel).parts
    if not parts or ".." in parts or rel.startswith("/"):
        return False
    if parts[-1].startswith(".") or parts[-1].endswith(_LOCAL_SUFFIXES):
        # Hidden names (this side's temporary files among them), and the probes' FIFOs and
        # answers, which the supervisor here opens: a node that wrote one could stall it.
        return False
    if _ATTEMPT.fullmatch(parts[0]):
        return len(parts) == 2
    return parts[0] == "nodes" or rel == CHECKPOINTS


def owner(rel: str) -> tuple[int, int] | None:
    """(attempt, rank) of a rank's file of a run directory (``attempt-2/rank-3.out``,
    ``attempt-2/fr-rank-3``); None for any other."""
    parts = PurePosixPath(rel).parts
    attempt = _ATTEMPT.fullmatch(parts[0]) if len(parts) == 2 else None
    rank = _RANK_FILE.fullmatch(parts[1]) if attempt else None
    return (int(attempt.group(1)), int(rank.group(1))) if attempt and rank else None


@dataclass
class NodeFiles:
    """The notebook's side: which files one node may write (`admit`), from what it has said."""

    own: str  # its folder under nodes/ ("<number>-<name>")
    ranks: dict[str, set[tuple[int, int]]] = field(default_factory=dict)  # group -> started
    taken: dict[str, int] = field(default_factory=dict)  # group -> bytes written

    def started(self, group: str, attempt: int, rank: int) -> None:
        self.ranks.setdefault(group, set()).add((attempt, rank))

    def admit(self, group: str, rel: str, offset: int, size: int) -> None:
        """Raises ValueError (saying why) where the node may not write `size` bytes of `rel`
        at `offset` (-1: the whole file); counts them where it may."""
        if not from_node(rel):
            raise ValueError(f"a file it may not write: {rel!r}")
        parts = PurePosixPath(rel).parts
        mine = self.ranks.get(group, set())
        if parts[0] == "nodes":
            theirs = len(parts) < 3 or parts[1] != self.own
        elif rel == CHECKPOINTS:
            theirs = not any(rank == 0 for _, rank in mine)  # rank 0 keeps them
        else:
            theirs = owner(rel) not in mine
        if theirs:
            raise ValueError(f"{rel!r}, a file of a rank (or node) its launcher did not start")
        if (size if offset < 0 else offset + size) > MAX_FILE:
            raise ValueError(f"{rel!r} past {MAX_FILE >> 30} GiB: the rest is not written")
        taken = self.taken.get(group, 0) + size
        if taken > MAX_GROUP:
            raise ValueError(f"group {group}'s files past {MAX_GROUP >> 30} GiB: not written")
        self.taken[group] = taken


# Opened without following a link, and without waiting for a reader where something other than a
# regular file sits at the path (a FIFO would block the supervisor's event loop in open()).
_OPEN = os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC


def write_chunk(top: Path, rel: str, offset: int, data: bytes) -> None:
    """The notebook's side: a chunk of a node's file into the run directory `top`, into regular
    files only, and growing a file only from its end (a chunk far beyond it would make a sparse
    file whose hole every reader here would read). Files are the user's alone (results are
    unpickled: rundir.RunDir.read_private checks it)."""
    if not from_node(rel):
        raise ValueError(f"a node sent a file it may not write: {rel!r}")
    parts = PurePosixPath(rel).parts
    path = top.joinpath(*parts)
    path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
    if offset < 0:
        # A whole file (a record, a result): replaced at once, as the rank wrote it (a link or
        # anything else at its path is replaced, never followed).
        tmp = path.with_name(f".{path.name}.mirror.tmp")
        with _regular(tmp, rel) as f:
            f.truncate()
            f.write(data)
        os.replace(tmp, path)
        return
    with _regular(path, rel) as f:
        end = os.fstat(f.fileno()).st_size
        if offset > end:
            raise ValueError(f"a node sent {rel!r} from byte {offset}, past its end ({end})")
        f.seek(offset)
        f.write(data)


def _regular(path: Path, rel: str) -> io.BufferedRandom:
    try:
        fd = os.open(path, _OPEN, 0o600)
    except OSError as e:  # ELOOP: a link; ENXIO: a FIFO nobody reads
        raise ValueError(f"a node sent {rel!r}, which is not a regular file here: {e}") from e
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise ValueError(f"a node sent {rel!r}, which is not a regular file here")
    return os.fdopen(fd, "r+b")
