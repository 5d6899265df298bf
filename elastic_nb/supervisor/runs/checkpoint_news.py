"""What a rank group says of the checkpoints its cells save and load (the records rank 0 adds to
the run directory: ranks.checkpoint_log): a save goes to the dashboards' headers, a resume is
said with what the failure before it cost."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from elastic_nb.common.report import checkpoint_words, duration
from elastic_nb.supervisor.ranks.checkpoint_log import CheckpointLog
from elastic_nb.supervisor.runs.reporter import Reporter

__all__ = ["latest_checkpoint", "tell"]


def tell(
    records: Iterable[dict[str, Any]],
    report: Reporter,
    followers: list[Reporter],
    last_failure: tuple[float, str, bool] | None,
) -> None:
    """`records` (new since the last look) as events of the group's (`report`), and to those who
    follow its ranks; `last_failure`: the latest failure that ended an attempt (when, who)."""
    for record in records:
        fields = {k: v for k, v in record.items() if k != "event"}
        report.event(f"checkpoint.{record['event']}", **fields)
        if record["event"] == "saved":
            for follower in followers:
                follower.checkpoint(record)
        elif record.get("step") is not None:
            title = resume_words(record, last_failure)
            for follower in followers:
                follower.alert("checkpoint", "info", title)


def resume_words(loaded: dict[str, Any], last_failure: tuple[float, str, bool] | None) -> str:
    """'resumed from step 1200, saved 14 s before rank 2 failed: about 14 s of work
    redone (loaded in 0.4 s, from rank 0's copy)'."""
    saved_at = loaded.get("saved_time")
    words = f"resumed from step {loaded['step']}"
    if saved_at is not None and last_failure is not None and saved_at <= last_failure[0]:
        lost = duration(last_failure[0] - saved_at)
        words += f", saved {lost} before {last_failure[1]} failed: about {lost} of work redone"
    elif saved_at is not None:
        words += f", saved {duration(max(0.0, loaded['time'] - saved_at))} earlier"
    source = loaded.get("from")
    how = f"loaded in {duration(loaded['seconds'])}"
    if source and source != "shared":
        how += f", from {source}'s copy"
    if loaded.get("saved_world_size") not in (None, loaded.get("world_size")):
        how += f"; saved by {loaded['saved_world_size']} ranks, loaded by {loaded['world_size']}"
    return f"{words} ({how})"


def latest_checkpoint(log: CheckpointLog) -> dict[str, Any] | None:
    """The latest saved checkpoint, with its words (%elastic session, the summary)."""
    latest = log.latest
    return {**latest, "words": checkpoint_words(latest)} if latest else None
