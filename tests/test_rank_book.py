"""The rank book, below the job that uses it: where a rank's records, its exit (seen by its site,
said by its launcher) and a desync verdict's blame meet."""

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

from elastic_nb.common.rank_state import RankState
from elastic_nb.common.rundir import RunDir, write_json
from elastic_nb.supervisor.forensics.desync import Desync
from elastic_nb.supervisor.processes.launcher_pool import LauncherPool
from elastic_nb.supervisor.processes.local_site import LocalSite
from elastic_nb.supervisor.ranks.rank_book import RankBook
from tests.fake_site import FakeSite

pytestmark = pytest.mark.unit


def test_new_failures_come_in_the_order_they_happened(tmp_path: Path) -> None:
    """Rank 1 timed out, and its peer error then reached rank 0: one poll reads both, and the
    job must act on rank 1's timeout first (its diagnosis takes the stacks)."""
    rd = RunDir(str(tmp_path))
    book, site = RankBook(rd), FakeSite(rd)
    r0 = book.add(0, 0, pid=101, started_at=1.0, site=site)
    r1 = book.add(0, 1, pid=102, started_at=1.0, site=site)
    rd.attempt(0).mkdir(parents=True)
    write_json(rd.failure(0, 0), {"rank": 0, "time": 5.2, "type": "RuntimeError", "message": "x"})
    write_json(rd.failure(0, 1), {"rank": 1, "time": 5.0, "type": "RuntimeError", "message": "y"})
    assert book.new_failures(0) == [r1, r0]
    assert book.new_failures(0) == []  # read once


def test_the_rank_book_meets_records_exits_and_blame(tmp_path: Path) -> None:
    rd = RunDir(str(tmp_path))
    book, site = RankBook(rd), FakeSite(rd)
    r0 = book.add(0, 0, pid=101, started_at=1.0, site=site)
    r1 = book.add(0, 1, pid=102, started_at=1.0, site=site)
    assert book.of(0) == [r0, r1] and book.of(1) == []
    assert book.chip(r1, None)["state"] == "running"
    # Seen gone before the launcher said how rank 1 ended: EXITS makes it judgeable.
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


class _SeenGone(LocalSite):
    """This machine, which says when it has seen a rank gone (its pidfd readable): the test's
    launcher speaks only after that, whatever the scheduler does meanwhile."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.seen_gone = anyio.Event()

    async def wait_gone(self, r: RankState) -> tuple[float, float]:
        gone = await super().wait_gone(r)
        self.seen_gone.set()
        return gone


def test_the_end_waits_for_the_launchers_last_word_on_how_its_ranks_ended(tmp_path: Path) -> None:
    """The teardown can see the launcher gone while what it said last (each forked rank's exit
    status) is still in its pipe: hear_out holds the end until that is taken in and every rank
    watcher has seen its rank gone; without it the verdict said "its exit status never came"."""
    rd = RunDir(str(tmp_path))
    site = _SeenGone(rd, LauncherPool(str(tmp_path / "pool")), list, lambda: None)
    book = RankBook(rd)
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
    r = book.add(0, 0, pid=pid, started_at=time.time(), site=site)
    heard = anyio.Event()

    async def main() -> None:
        async def watch() -> None:
            r.died_at, r.gone_at = await book.wait_exit(r, forked=True)

        async def launcher_speaks_late() -> None:
            os.kill(pid, signal.SIGKILL)
            await site.seen_gone.wait()  # the word arrives after the rank is seen gone
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
