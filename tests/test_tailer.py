"""The log tailer: every line counted, bounded batches, progress bars collapsed."""

from __future__ import annotations

from pathlib import Path

from elastic_nb.supervisor.tailer import LogTailer


def tailer_for(path: Path, max_lines: int = 5) -> LogTailer:
    t = LogTailer(max_lines=max_lines)
    t.follow(0, 1, {"out": path})
    return t


def test_lines_arrive_in_order_and_partial_lines_wait(tmp_path: Path) -> None:
    path = tmp_path / "rank-1.out"
    t = tailer_for(path)
    t.poll()
    assert t.take() == []  # no file yet
    path.write_bytes(b"one\ntw")
    t.poll()
    (batch,) = t.take()
    assert (batch.rank, batch.stream, batch.lines, batch.skipped) == (1, "out", ["one"], 0)
    with path.open("ab") as f:
        f.write(b"o\nthree")
    t.poll()
    assert t.take()[0].lines == ["two"]
    t.poll(final=True)
    assert t.take()[0].lines == ["three"]


def test_a_flood_is_bounded_and_counted(tmp_path: Path) -> None:
    path = tmp_path / "rank-1.out"
    path.write_bytes(b"".join(b"line %d\n" % i for i in range(100_000)))
    t = tailer_for(path, max_lines=5)
    t.poll()
    (batch,) = t.take()
    assert batch.lines == [f"line {i}" for i in range(99_995, 100_000)]
    assert batch.skipped == 99_995
    assert t.lines_total() == 100_000


def test_skips_accumulate_across_polls_until_taken(tmp_path: Path) -> None:
    path = tmp_path / "rank-1.out"
    t = tailer_for(path, max_lines=3)
    with path.open("ab") as f:
        for chunk in range(3):
            f.write(b"".join(b"%d-%d\n" % (chunk, i) for i in range(4)))
            f.flush()
            t.poll()
    (batch,) = t.take()
    assert batch.lines == ["2-1", "2-2", "2-3"] and batch.skipped == 9


def test_carriage_returns_collapse_to_the_last_state(tmp_path: Path) -> None:
    path = tmp_path / "rank-1.out"
    path.write_bytes(b"  0%|\r 50%|#####\r100%|##########\nwindows line\r\n 10%|#")
    t = tailer_for(path)
    t.poll()
    (batch,) = t.take()
    assert batch.lines == ["100%|##########", "windows line"]
    assert batch.progress is None  # an unfinished line without \r is not a progress bar
    with path.open("ab") as f:
        f.write(b"\r 20%|##")
    t.poll()
    (batch,) = t.take()
    assert batch.lines == [] and batch.progress == " 20%|##"
    t.poll()
    assert t.take() == []  # the same progress is not sent twice


def test_undecodable_bytes_do_not_break_the_stream(tmp_path: Path) -> None:
    path = tmp_path / "rank-1.out"
    path.write_bytes(b"ok \xff\xfe\n")
    t = tailer_for(path)
    t.poll()
    assert t.take()[0].lines == ["ok \ufffd\ufffd"]


WATCHDOG = (
    b"[rank0]:[E1123 10:00:05.123456789 ProcessGroupNCCL.cpp:632] [Rank 0] Watchdog caught "
    b"collective operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=8, "
    b"NumelOut=8, Timeout(ms)=5000) ran for 5002 milliseconds before timing out.\n"
)


def test_marked_lines_are_caught_even_in_a_flood_and_noise_is_not_activity(
    tmp_path: Path,
) -> None:
    path = tmp_path / "rank-0.err"
    flood = b"".join(b"step %d\n" % i for i in range(50_000))
    path.write_bytes(flood + WATCHDOG + flood)
    t = LogTailer(
        max_lines=5,
        marks=(b"Watchdog caught collective operation timeout",),
        noise=(b"ProcessGroupNCCL",),
    )
    t.follow(0, 0, {"err": path})
    t.poll()
    # Left out of the bounded batch, still seen: the watchdog's line is evidence, not a log tail.
    (marked,) = t.take_marked()
    assert marked[:3] == (0, 0, "err") and "SeqNum=7, OpType=ALLREDUCE" in marked[3]
    assert t.take_marked() == []
    assert t.lines_total() == 100_001 and t.activity_total() == 100_000
    with path.open("ab") as f:
        f.write(WATCHDOG.replace(b"Watchdog caught", b"[PG ID 0] failure"))  # noise only
    t.poll()
    assert t.take_marked() == [] and t.activity_total() == 100_000
