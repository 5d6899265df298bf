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

    def before(self, t: float) -> dict[str, Any] | None:
        """The newest step committed before `t` (a failure's time)."""
        earlier = [s for s in self.saved if s["time"] <= t]
        return earlier[-1] if earlier else None


def cost_words(log: CheckpointLog, failed_at: float, who: str) -> str | None:
    """What a failure at `failed_at` costs, for a restart's words: None when the run saved no
    checkpoint at all (it does not use them)."""
    if not log.saved:
        return None
    last = log.before(failed_at)
    if last is None:
        return f"no checkpoint was saved before {who} failed: the next attempt starts over"
    ago = failed_at - last["time"]
    return (
        f"the last checkpoint is step {last['step']}, saved {duration(ago)} before {who} "
        f"failed (about {duration(ago)} of work to redo)"
    )
