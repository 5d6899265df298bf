"""A checkpoint directory: where a notebook's is (`default_directory`), its files (a local path or
an fsspec URL), which ranks share it (found by a probe, never assumed), and its steps: which are
committed, what is removed, which are kept.

    step-000000001200-3f9a1c2e/   a DCP checkpoint (.metadata, __R_0.distcp, ...) and COMMITTED
    step-000000001300-77b0e4d1/   no COMMITTED: being written, or left by a rank that died; never
                                  loaded, and removed by the next save or load
    .removing-<token>-step-.../   a step being removed (one beyond keep, or uncommitted)
    .probe-<rank>-<token>         a probe's file, there for the moment of the probe

A step's directory carries a random suffix: saving a step again (after a failure, or a step a
resumed run saves once more) never writes into files an earlier attempt left.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import secrets
import shutil
import threading
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from elastic_nb.common.spec import CHECKPOINT_DIR_ENV

if TYPE_CHECKING:
    from elastic_nb.checkpoint.ranks import Ranks

COMMITTED = "COMMITTED"
log = logging.getLogger(__name__)
_STEP = re.compile(r"^step-(\d+)-([0-9a-f]+)$")
_PROBE = ".probe-"
_REMOVING = ".removing-"
# What this process's threads are removing (_REMOVING directories), so that clean() leaves them.
_BEING_REMOVED: set[str] = set()
_REMOVERS: set[threading.Thread] = set()


def wait_removals() -> None:
    """Wait until the steps this process removed are gone from the disk (P14 times a save
    apart from the removal of the step before it)."""
    for remover in list(_REMOVERS):
        remover.join()


def step_name(step: int, nonce: str) -> str:
    return f"step-{step:012d}-{nonce}"


@dataclass(frozen=True)
class Layout:
    """Which ranks see the same checkpoint directory, as the probe found."""

    shared: bool  # every rank sees every rank's files
    leader: int  # the lowest rank that sees what this rank sees: it lists, cleans and commits
    groups: tuple[tuple[int, ...], ...]  # the ranks, by the storage they see


def layout(views: list[list[int]], rank: int, root: str) -> Layout:
    """What a probe found, for `rank`: `views[r]` lists the ranks whose probe file rank r saw.
    They must fall into groups of ranks that each see exactly their group (itself included):
    anything else is storage that one rank sees and another does not see back (a cache out of
    date, a mount on one node only), which no layout describes."""
    for r, view in enumerate(views):
        if r not in view or any(views[s] != view for s in view):
            raise RuntimeError(
                f"elastic_nb.checkpoint: the ranks disagree about who shares {root} "
                f"(the probe files each rank saw: {dict(enumerate(views))}); give every rank "
                "a directory on the same storage, or one of its own per node"
            )
    groups = tuple(sorted({tuple(v) for v in views}))
    return Layout(len(groups) == 1, min(views[rank]), groups)


class Directory:
    """One rank's view of a checkpoint directory. Only a leader lists, cleans and commits, and
    never while a step of its job is being written."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.fs: Any = None  # an fsspec filesystem, for a URL
        if "://" in root:
            # The storage DCP's FsspecWriter/FsspecReader use (torch/distributed/checkpoint/
            # _fsspec_filesystem.py); torch depends on fsspec.
            from fsspec.core import url_to_fs

            self.fs, _ = url_to_fs(root)

    def path(self, *names: str) -> str:
        if self.fs is not None:
            return "/".join([self.root.rstrip("/"), *names])
        return os.path.join(self.root, *names)

    # -- steps ----------------------------------------------------------------------------

    def committed(self) -> list[tuple[int, str, dict[str, Any]]]:
        """(step, name, what its COMMITTED says) of every committed step, oldest first."""
        found = []
        for name in self._listdir():
            m = _STEP.match(name)
            raw = self._read(self.path(name, COMMITTED)) if m else None
            if m and raw is not None:
                with contextlib.suppress(ValueError):
                    found.append((int(m.group(1)), name, json.loads(raw)))
        found.sort(key=lambda e: (e[0], e[2].get("time", 0.0)))
        return found

    def tidy(self) -> list[tuple[int, str, dict[str, Any]]]:
        """`clean()`, then the committed steps: what a leader does before a save or a load. A
        failure to remove is only logged (the next tidy tries again); one to list is raised."""
        try:
            self.clean()
        except OSError as e:
            log.warning("elastic_nb.checkpoint: could not clean %s: %s", self.root, e)
        return self.committed()

    def commit(self, name: str, marker: dict[str, Any], *, fsync: bool) -> None:
        self._write(self.path(name, COMMITTED), json.dumps(marker).encode(), fsync=fsync)

    def clean(self, keep: int | None = None) -> None:
        """Remove what no load may read (uncommitted steps, an older copy of a step saved again,
        probe files a killed rank left) and all but the `keep` newest steps. A step loses its
        COMMITTED before its files, so no reader ever sees half of one."""
        newest_copy = {step: name for step, name, _ in self.committed()}  # the latest commit wins
        kept = set(newest_copy.values())
        if keep is not None:
            kept -= {newest_copy[s] for s in sorted(newest_copy)[:-keep]}
        for name in self._listdir():
            if _STEP.match(name) and name not in kept:
                self._remove(self.path(name, COMMITTED))
                self.remove_step(name)
            elif name.startswith(_REMOVING) and self.path(name) not in _BEING_REMOVED:
                self.remove_step(name)  # what a process that died while removing it left
            elif name.startswith(_PROBE):
                self._remove(self.path(name))

    def remove_step(self, name: str) -> None:
        """Remove an uncommitted step. On a local disk its directory is renamed away at once and
        its files removed by a thread: unlinking a GB-sized step took 0.2 s of a 1.5 s save here
        (P14). A URL's files are removed here (a rename copies on an object store)."""
        if self.fs is not None:
            with contextlib.suppress(FileNotFoundError):
                self.fs.rm(self.path(name), recursive=True)
            return
        doomed = self.path(f"{_REMOVING}{secrets.token_hex(4)}-{name}")
        try:
            os.rename(self.path(name), doomed)
        except FileNotFoundError:
            return
        _BEING_REMOVED.add(doomed)

        def remove() -> None:
            shutil.rmtree(doomed, ignore_errors=True)
            _BEING_REMOVED.discard(doomed)
            _REMOVERS.discard(threading.current_thread())

        # Not a daemon: a process that ends meanwhile finishes it first (Python joins it at
        # exit); one killed leaves the rest to the next clean().
        remover = threading.Thread(target=remove, name="elastic_nb-checkpoint-rm")
        _REMOVERS.add(remover)
        remover.start()

    def size(self, name: str) -> int:
        if self.fs is not None:
            return int(self.fs.du(self.path(name)))
        total = 0
        for parent, _, files in os.walk(self.path(name)):
            for file in files:
                with contextlib.suppress(OSError):
                    total += os.path.getsize(os.path.join(parent, file))
        return total

    # -- who shares it --------------------------------------------------------------------

    def probe(self, ranks: Ranks) -> Layout:
        """Every rank writes a random token file into its directory and looks for every other
        rank's; the ranks then compare what each saw."""
        token, error = secrets.token_hex(8), None
        mine = self.path(f"{_PROBE}{ranks.rank}-{token}")
        try:
            if self.fs is not None:
                self.fs.makedirs(self.root, exist_ok=True)
            else:
                os.makedirs(self.root, exist_ok=True)
            self._write(mine, token.encode())
        except OSError as e:
            error = f"rank {ranks.rank} cannot write {self.root}: {e}"
        try:
            tokens = ranks.all_gather((token, error))
            errors = [e for _, e in tokens if e]
            if errors:
                raise OSError("elastic_nb.checkpoint: " + "; ".join(errors))

            def seen() -> list[int]:
                return [
                    r
                    for r, (t, _) in enumerate(tokens)
                    if self._read(self.path(f"{_PROBE}{r}-{t}")) == t.encode()
                ]

            visible = seen()
            if len(visible) < ranks.world:
                # A network filesystem may answer from its cache of the directory for a moment
                # after another node created a file (NFS attribute caching): one more look
                # before concluding that the storage is not shared.
                time.sleep(0.2)
                visible = seen()
            views = ranks.all_gather(visible)
        finally:
            self._remove(mine)
        return layout(views, ranks.rank, self.root)

    # -- files ----------------------------------------------------------------------------

    def _listdir(self) -> list[str]:
        if self.fs is not None:
            if not self.fs.exists(self.root):
                return []
            return [p.rstrip("/").rpartition("/")[2] for p in self.fs.ls(self.root, detail=False)]
        try:
            return os.listdir(self.root)
        except FileNotFoundError:
            return []

    def _write(self, path: str, data: bytes, *, fsync: bool = False) -> None:
        """All or nothing: a reader never sees half of it (a rename here; one PUT on an object
        store). `fsync`: on disk, the rename included, before this returns."""
        if self.fs is not None:
            self.fs.pipe_file(path, data)
            return
        tmp = f"{path}.tmp-{secrets.token_hex(4)}"
        with open(tmp, "wb") as f:
            f.write(data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)
        if fsync:
            folder = os.open(os.path.dirname(path), os.O_RDONLY)
            try:
                os.fsync(folder)
            finally:
                os.close(folder)

    def _read(self, path: str) -> bytes | None:
        try:
            if self.fs is not None:
                return bytes(self.fs.cat_file(path))
            with open(path, "rb") as f:
                return f.read()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def _remove(self, path: str) -> None:
        """Tolerates a file already gone: another rank of the same storage may clean too."""
        with contextlib.suppress(FileNotFoundError):
            if self.fs is not None:
                self.fs.rm_file(path)
            else:
                os.remove(path)


# Overrides the default directory of every rank it is given to (`--env` on the magic, or the
# kernel's own environment).
DIRECTORY_ENV = CHECKPOINT_DIR_ENV


def default_directory() -> str:
    """One directory per notebook: `<notebook's directory>/.elastic_nb_checkpoints/<notebook
    name>`, beside the notebook as Jupyter's `.ipynb_checkpoints` is (and so, on a cluster, on
    the storage the notebook is on). $ELASTIC_NB_CHECKPOINT_DIR wins.

    Ranks inherit the kernel's environment and working directory. Jupyter gives a kernel the
    notebook's path in JPY_SESSION_NAME (relative to the server's root, or absolute) and starts it
    in the notebook's directory; without it (a terminal, a script) the name is `default`.
    """
    if os.environ.get(DIRECTORY_ENV):
        return os.environ[DIRECTORY_ENV]
    session = os.environ.get("JPY_SESSION_NAME", "")
    base, name = os.getcwd(), "default"
    if session:
        base = os.path.dirname(session) if os.path.isabs(session) else base
        name = os.path.splitext(os.path.basename(session))[0] or name
    return os.path.join(base, ".elastic_nb_checkpoints", name)
