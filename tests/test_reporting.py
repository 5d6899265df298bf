"""What the supervisor tells: the reporter's updates and diary, the summary's cause class and the
alerts that close a job."""

from __future__ import annotations

import signal
from pathlib import Path
from typing import Any

import anyio
import pytest

from elastic_nb import protocol
from elastic_nb.supervisor.ranks.log_tailer import LogTailer
from elastic_nb.supervisor.runs.reporter import Reporter
from elastic_nb.supervisor.runs.summary import cause, closing_alerts

pytestmark = pytest.mark.unit


def test_the_reporter_sends_one_update_per_flush_and_keeps_a_diary(tmp_path: Path) -> None:
    sent: list[dict[str, Any]] = []

    async def send(msg: Any) -> None:
        sent.append(dict(msg))

    async def main() -> None:
        report = Reporter("cafe0001", send)
        report.open(tmp_path / "events.jsonl")
        report.set_state("running")
        report.chip(0, {"state": "running"})
        report.chip(0, {"state": "done"})  # the latest wins
        report.alert("hang", "warning", "quiet", rank=1)
        await report.flush(0, LogTailer())
        await report.flush(0, LogTailer())  # nothing new: nothing sent
        report.close()

    anyio.run(main)
    assert len(sent) == 1
    update = sent[0]
    assert update["kind"] == protocol.kernel.UPDATE and update["job"] == "cafe0001"
    assert update["state"] == "running" and update["ranks"] == {"0": {"state": "done"}}
    assert [a["title"] for a in update["alerts"]] == ["quiet"]
    diary = (tmp_path / "events.jsonl").read_text()
    assert '"event": "state"' in diary and '"event": "alert"' in diary


@pytest.mark.parametrize(
    ("outcome", "failure", "zombie", "expected"),
    [
        ("failed", {"cause": "oom"}, False, "oom"),
        ("timeout", None, False, "deadline"),
        ("interrupted", None, False, "interrupted"),
        ("failed", None, True, "zombie"),
        ("failed", None, False, "launcher"),
        ("succeeded", None, False, None),
    ],
)
def test_every_cause_class(outcome: str, failure: Any, zombie: bool, expected: Any) -> None:
    assert cause(outcome, failure, zombie) == expected


def test_closing_alerts_name_leftovers_and_a_rank_that_broke_after_finishing() -> None:
    from elastic_nb.common.rank_state import RankState

    ok, bad = RankState(0, 0, exit_code=-signal.SIGTERM), RankState(0, 1, exit_code=-11)
    summary = {"outcome": "succeeded", "failure": None}
    alerts = closing_alerts(summary, [ok, bad], [{"pid": 7, "cmd": "sleep 300"}])
    assert [a["kind"] for a in alerts] == ["leftovers", "exit_after_done"]
    assert "7 (sleep 300)" in alerts[0]["title"] and alerts[1]["rank"] == 1
