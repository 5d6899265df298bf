"""The checkpoints a rank group's cells saved and loaded, as rank 0 of `elastic_nb.checkpoint`
records them in the run directory (one JSON line each, `RunDir.checkpoints`), followed by the
supervisor: the latest saved step for the dashboard's header and `%elastic session`, and the words
of what a failure cost ("the last checkpoint: step 1200, saved 14 s before rank 2 failed") and of
a resume ("resumed from step 1200: about 14 s of work redone").
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from elastic_nb.common.report import duration

__all__ = ["CheckpointLog", "cost_words"]


class CheckpointLog:
    def __init__(self, path: Path) -> None:
        self._path = path
        self._offset = 0
        self._partial = b""
        self.saved: list[dict[str, Any]] = []  # every committed save, oldest first
        self.loaded: list[dict[str, Any]] = []

    @property
    def latest(self) -> dict[str, Any] | None:
        return self.saved[-1] if self.saved else None

    def poll(self) -> list[dict[str, Any]]:
        """The records appended since the last poll (a stat when nothing was)."""
        try:
            if os.stat(self._path).st_size <= self._offset:
                return []
            with open(self._path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except OSError:
            return []
        self._offset += len(data)
        *lines, self._partial = (self._partial + data).split(b"\n")
        records = []
        for line in lines:
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict) and record.get("event") in ("saved", "loaded"):
                    records.append(record)
                    (self.saved if record["event"] == "saved" else self.loaded).append(record)
        return records


def cost_words(log: CheckpointLog, failed_at: float, who: str, lost: bool = False) -> str | None:
    """What a failure at `failed_at` costs, for a restart's words: None when the run saved no
    checkpoint at all (it does not use them). `lost`: `who` went with its machine, known alive
    until `failed_at` (when it was last heard from) and maybe a little longer.

    A save can be committed after the failure: an async save in flight when a rank raised is
    finished as that rank exits (elastic_nb.checkpoint), and it is the step the next attempt
    resumes from. Its state is the one training had when save() returned (`overlapped_s`
    before the commit)."""
    latest = log.latest
    if latest is None:
        return None
    if latest["time"] > failed_at and lost:
        # Every rank wrote its part of it: the machine was there when it was committed.
        return (
            f"the last checkpoint is step {latest['step']}, saved as {who} was last heard from "
            "(little or no work to redo)"
        )
    if latest["time"] > failed_at:
        state_at = latest["time"] - (latest.get("overlapped_s") or 0.0)
        redo = duration(max(0.0, failed_at - state_at))
        return (
            f"the last checkpoint is step {latest['step']}, in flight when {who} failed and "
            f"committed as it exited (about {redo} of work to redo)"
        )
    ago = failed_at - latest["time"]
    return (
        f"the last checkpoint is step {latest['step']}, saved {duration(ago)} before {who} "
        f"failed (about {duration(ago)} of work to redo)"
    )
