"""What makes a step count, once its files are written: every rank's outcome is compared, the
leaders write COMMITTED and keep the last K, and rank 0 records the save for the supervisor.

The record: when ELASTIC_NB_RUN_DIR is set (in every rank of a job: its run directory), rank 0
appends one JSON line to <run dir>/RECORD_FILE per committed save and per load, so that the
dashboard and the failure report can say "resumed from step 1200, saved 14 s before rank 2
failed". The fields are listed in `saved` and in the package's `Checkpoints.load`.
"""

from __future__ import annotations

import json
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

from elastic_nb.checkpoint.directory import Directory, Layout
from elastic_nb.checkpoint.ranks import Ranks
from elastic_nb.common.rundir import CHECKPOINTS as RECORD_FILE
from elastic_nb.common.rundir import RUN_DIR_ENV

log = logging.getLogger(__name__)


def record(event: dict[str, Any]) -> None:
    run_dir = os.environ.get(RUN_DIR_ENV)
    if not run_dir:
        return
    try:
        # One write of one short line in append mode: two writers' lines never interleave.
        with open(os.path.join(run_dir, RECORD_FILE), "a") as f:
            f.write(json.dumps(event) + "\n")
    except OSError as e:
        log.warning("elastic_nb.checkpoint: could not record %s in %s: %s", event, run_dir, e)


@dataclass
class Commit:
    """The end of one save. An async save runs it in the package's thread once DCP's save
    returned there; nothing else uses the checkpoint's group meanwhile (a save, a load and
    wait() first wait for it)."""

    directory: Directory
    ranks: Ranks
    layout: Layout
    step: int
    name: str
    started: float  # when save() was called (time.time())
    async_save: bool
    keep: int | None
    fsync: bool
    returned: float | None = None  # when save() gave control back to training (async)

    def after(self, error: BaseException | None) -> None:
        """An async save's commit: its error is logged here too, as the rank's code sees it
        only at its next save, load or wait()."""
        try:
            self(error)
        except Exception:
            log.exception("elastic_nb.checkpoint: step %d was not saved", self.step)
            raise

    def __call__(self, error: BaseException | None) -> None:
        leader = self.ranks.rank == self.layout.leader
        if error is not None and leader:
            self.directory.remove_step(self.name)  # the next save or load would remove it too
        # A step counts only once every rank has written its part: DCP's coordinator writes
        # .metadata after gathering every rank's write results (state_dict_saver.py,
        # _save_state_dict), but without shared storage each node's copy is written alone.
        if not self.ranks.all_ok(error is None):
            if error is not None:
                raise error
            raise RuntimeError(
                f"elastic_nb.checkpoint: step {self.step} was not saved: another rank failed to "
                "write its part (its log says why)"
            )
        committed = time.time()
        size, failed = 0, None
        if leader:
            try:
                size = self.directory.size(self.name)
                marker = {"step": self.step, "time": committed, "bytes": size}
                marker.update(world_size=self.ranks.world, shared=self.layout.shared)
                self.directory.commit(self.name, marker, fsync=self.fsync)
                self.directory.clean(self.keep)
            except OSError as e:
                failed = e
            else:
                if self.ranks.rank == 0:  # the lowest rank leads its view of the directory
                    # Said as it counts (a load takes it from here), not after the ranks have
                    # compared their commits: a peer lost meanwhile fails that comparison, and
                    # the next attempt resumes from a step the notebook was never told of.
                    self.saved(committed, size)
        if not self.ranks.all_ok(failed is None):
            raise RuntimeError(
                f"elastic_nb.checkpoint: step {self.step} was written but not committed"
                + (f": {failed}" if failed else " on every node (see the other ranks' logs)")
            )

    def saved(self, committed: float, size: int) -> None:
        returned = self.returned if self.returned is not None else committed
        record(
            {
                "event": "saved",
                "step": self.step,
                "time": committed,  # when the step was committed (time.time())
                "path": self.directory.path(self.name),  # rank 0's copy
                "bytes": size,  # of rank 0's copy: the whole step when storage is shared
                "seconds": committed - self.started,  # save() called -> committed
                "async": self.async_save,
                "blocked_s": returned - self.started,  # training waited this long
                "overlapped_s": committed - returned if self.async_save else None,
                "world_size": self.ranks.world,
                "shared": self.layout.shared,
            }
        )
