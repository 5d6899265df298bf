"""The supervisor's rooms, each below the job that uses them: the rank book, the reporter, the
summary's cause, and the teardown of a real process tree."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import anyio
import pytest

from elastic_nb.common import procs, protocol
from elastic_nb.common.rundir import RunDir, write_json
from elastic_nb.supervisor.forensics.stacks import Desync
from elastic_nb.supervisor.processes.process_tree import ProcessTree
from elastic_nb.supervisor.ranks.log_tailer import LogTailer
from elastic_nb.supervisor.ranks.rank_book import RankBook
from elastic_nb.supervisor.runs.reporter import Reporter
from elastic_nb.supervisor.runs.summary import cause, closing_alerts


def test_new_failures_come_in_the_order_they_happened(tmp_path: Path) -> None:
    """Rank 1 timed out, and its peer error then reached rank 0: one poll reads both, and the
    job must act on rank 1's timeout first (its diagnosis takes the stacks)."""
    rd = RunDir(str(tmp_path))
    book = RankBook(rd)
    r0, r1 = book.add(0, 0, pid=101, started_at=1.0), book.add(0, 1, pid=102, started_at=1.0)
    rd.attempt(0).mkdir(parents=True)
    write_json(rd.failure(0, 0), {"rank": 0, "time": 5.2, "type": "RuntimeError", "message": "x"})
    write_json(rd.failure(0, 1), {"rank": 1, "time": 5.0, "type": "RuntimeError", "message": "y"})
    assert book.new_failures(0) == [r1, r0]
    assert book.new_failures(0) == []  # read once


def test_the_rank_book_meets_records_exits_and_blame(tmp_path: Path) -> None:
    rd = RunDir(str(tmp_path))
    book = RankBook(rd)
    r0, r1 = book.add(0, 0, pid=101, started_at=1.0), book.add(0, 1, pid=102, started_at=1.0)
    assert book.of(0) == [r0, r1] and book.of(1) == []
    assert book.chip(r1, None)["state"] == "running"
    # A pidfd fired before the launcher said how rank 1 ended: EXITS makes it judgeable.
    r1.died_at = 2.0
    assert book.record_exits(0, {0: 0, 1: -9}) == [r1]
    assert (r0.exit_code, r1.exit_code) == (0, -9)
    assert book.report_exit(0, 1, 3) is None  # the first word stands
    # A done record is read once; a rank that left early gets the desync verdict's words.
    rd.attempt(0).mkdir(parents=True)
    write_json(rd.done(0, 0), {"rank": 0, "attempt": 0, "time": 1.5})
    book.read_records(r0)
    assert r0.done is not None and r0.failure is None
    desync = Desync(
        behind=[0], waiting=[1], text="…", notes={0: "left the cell after 3 collectives"}
    )
    assert book.blame(0, desync) == [r0]
    r0.died_at = 1.6
    chip = book.chip(r0, None)
    assert (chip["state"], chip["label"]) == ("failed", "left the cell after 3 collectives")
    book.zombies.add((0, 1))
    assert book.chip(r1, None)["state"] == "zombie"


def test_the_end_waits_for_the_launchers_last_word_on_how_its_ranks_ended(tmp_path: Path) -> None:
    """The teardown can see the launcher gone while what it said last (each forked rank's exit
    status) is still in its pipe: hear_out holds the end until that is taken in and every rank
    watcher has seen its rank gone; without it the verdict said "its exit status never came"."""
    book = RankBook(RunDir(str(tmp_path)))
    # A fork server stand-in: it reaps its child at once, so only its word says how it ended.
    server = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import subprocess; p = subprocess.Popen(['sleep', '60']); print(p.pid, flush=True);"
            " p.wait(); input()",
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert server.stdout is not None
    pid = int(server.stdout.readline())
    r = book.add(0, 0, pid=pid, started_at=time.time())
    heard = anyio.Event()

    async def main() -> None:
        async def watch() -> None:
            r.died_at, r.gone_at = await book.wait_exit(r, forked=True)

        async def launcher_speaks_late() -> None:
            os.kill(pid, signal.SIGKILL)
            await anyio.sleep(0.3)  # the word arrives after the rank is gone
            book.report_exit(0, 0, -signal.SIGKILL)
            heard.set()

        async with anyio.create_task_group() as tg:
            tg.start_soon(watch)
            tg.start_soon(launcher_speaks_late)
            await book.hear_out(heard)
            assert r.died_at is not None and r.exit_code == -signal.SIGKILL
            tg.cancel_scope.cancel()
        # Never heard (a launcher that survived): bounded.
        started = time.monotonic()
        await book.hear_out(anyio.Event(), wait_s=0.2)
        assert time.monotonic() - started < 5

    try:
        anyio.run(main)
        assert r.gone_at is not None and r.died_at < r.started_at + 60
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        server.kill()
        server.wait()


def test_the_reporter_sends_one_update_per_flush_and_keeps_a_diary(tmp_path: Path) -> None:
    sent: list[tuple[str, dict[str, Any]]] = []

    async def send(kind: str, **fields: Any) -> None:
        sent.append((kind, fields))

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
    kind, update = sent[0]
    assert kind == protocol.UPDATE and update["job"] == "cafe0001"
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
    from elastic_nb.supervisor.forensics.verdict import RankState

    ok, bad = RankState(0, 0, exit_code=-signal.SIGTERM), RankState(0, 1, exit_code=-11)
    summary = {"outcome": "succeeded", "failure": None}
    alerts = closing_alerts(summary, [ok, bad], [{"pid": 7, "cmd": "sleep 300"}])
    assert [a["kind"] for a in alerts] == ["leftovers", "exit_after_done"]
    assert "7 (sleep 300)" in alerts[0]["title"] and alerts[1]["rank"] == 1


# A launcher stand-in that ignores SIGTERM, with a marked child that ignores it too and escapes
# into a session of its own: only the marker finds it, only SIGKILL ends them.
STUBBORN = """
import os, signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen([sys.executable, "-c",
    "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)"],
    start_new_session=True)
print(child.pid, flush=True)
time.sleep(60)
"""


def test_the_process_tree_goes_sigterm_grace_sigkill_and_leaves_nothing() -> None:
    job_id = f"test{os.getpid()}"
    proc = subprocess.Popen(
        [sys.executable, "-c", STUBBORN],
        env={**os.environ, procs.MARKER: job_id},
        stdout=subprocess.PIPE,
        start_new_session=True,
    )
    assert proc.stdout is not None
    child = int(proc.stdout.readline())
    signals: list[str] = []

    async def main() -> list[int]:
        tree = ProcessTree(job_id, proc, orphans=list)
        return await tree.stop(0.5, lambda name, _: signals.append(name))

    started = time.monotonic()
    survivors = anyio.run(main)
    assert survivors == []
    assert signals == ["SIGTERM", "SIGKILL"]  # SIGTERM was ignored: the grace, then SIGKILL
    assert time.monotonic() - started < 5
    assert proc.poll() == -signal.SIGKILL
    assert not procs.job_processes([job_id])
    state = procs.proc_state(child)
    assert state is None or state[0] == "Z"  # gone, or dead awaiting its new parent's reaping


def test_a_stack_dump_is_read_whole_when_its_rank_pauses_in_the_middle(tmp_path: Path) -> None:
    """faulthandler writes a dump thread by thread; a rank descheduled between two (a loaded
    machine) left the file still for a poll, and the supervisor took the first thread alone
    (a helper's) for the rank's stack. The dump is whole when it ends as the file says."""
    from elastic_nb.supervisor.forensics.verdict import RankState
    from elastic_nb.supervisor.ranks.evidence import EvidenceCollector

    rd = RunDir(str(tmp_path))
    rd.attempt(0).mkdir(parents=True)
    path, cell = rd.stacks(0, 0), str(rd.cell)
    end = '  File "<string>", line 1 in <module>'
    path.write_text(f"{protocol.STACKS_END_MARK}{end}\n")
    rank = subprocess.Popen(
        [sys.executable, "-c", _PAUSING_DUMPER.format(path=str(path), cell=cell, end=end)],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert rank.stdout is not None and rank.stdout.readline() == "armed\n"
        r = RankState(0, 0, pid=rank.pid, started_at=time.time())
        where = anyio.run(EvidenceCollector(rd, "x = 1\n")._where, [r])[0]
        assert where.how == "live" and where.frames[0].file == cell, where
    finally:
        rank.kill()
        rank.wait()


_PAUSING_DUMPER = """
import signal, time
def dump(*_):
    with open({path!r}, "a") as f:
        f.write("Thread 0x00007f0000000001 (most recent call first):\\n")
        f.write('  File "/x/recorder.py", line 75 in _read\\n\\n')
        f.flush()
        time.sleep(0.3)  # descheduled between two threads
        f.write("Current thread 0x00007f0000000002 (most recent call first):\\n")
        f.write('  File "{cell}", line 9 in <module>\\n{end}\\n')
signal.signal(signal.SIGUSR1, dump)
print("armed", flush=True)
while True:
    time.sleep(0.05)
"""
