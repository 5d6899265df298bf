"""The log tailer: every line counted, bounded batches, progress bars collapsed."""

from __future__ import annotations

from pathlib import Path

import pytest

from elastic_nb.supervisor.ranks.log_tailer import LogTailer
from tests.nccl import watchdog_line

pytestmark = pytest.mark.unit


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


WATCHDOG = (watchdog_line(seq=7, timeout_ms=5000, ran_ms=5002) + "\n").encode()


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


def test_a_huge_line_is_cut_and_counted_the_file_keeps_it(tmp_path: Path) -> None:
    path = tmp_path / "rank-1.out"
    t = LogTailer(max_lines=5, max_chars=10)
    t.follow(0, 1, {"out": path})
    with path.open("ab") as f:
        f.write(b"short\n" + b"x" * 100)
        f.flush()
        t.poll()  # the huge line is unfinished: only its head is held
        assert len(t._streams[(0, 1, "out")].partial) <= 11
        f.write(b"y" * 5_000_000 + b"\n\xc3\xa9" * 3 + b"\n")  # then 3 lines of "é"
    t.poll()
    (batch,) = t.take()
    assert batch.lines == [
        "short",
        f"xxxxxxxxxx… 5,000,090 characters not shown (full log: {path})",
        "é",
        "é",
        "é",
    ]
    assert path.stat().st_size == 6 + 5_000_100 + 1 + 9


def test_a_huge_line_in_one_read_and_an_unfinished_one_at_the_end(tmp_path: Path) -> None:
    path = tmp_path / "rank-1.out"
    path.write_bytes("é".encode() * 30 + b"\n" + b"z" * 25)
    t = LogTailer(max_chars=10)
    t.follow(0, 1, {"out": path})
    t.poll(final=True)
    (batch,) = t.take()
    assert batch.lines == [
        f"{'é' * 10}… 20 characters not shown (full log: {path})",
        f"{'z' * 10}… 15 characters not shown (full log: {path})",
    ]


def test_a_progress_bar_of_200_000_updates_is_its_last_state(tmp_path: Path) -> None:
    path = tmp_path / "rank-1.out"
    t = LogTailer(max_chars=50)
    t.follow(0, 1, {"out": path})
    with path.open("ab") as f:
        for chunk in range(4):
            f.write(
                b"".join(
                    b"\r%6d/200000 |%s" % (i, b"#" * (i // 10_000))
                    for i in range(chunk * 50_000, (chunk + 1) * 50_000)
                )
            )
            f.flush()
            t.poll()
            s = t._streams[(0, 1, "out")]
            assert len(s.partial) < 100  # the bar's last state, not its history
        (batch,) = t.take()
        assert batch.lines == [] and batch.progress == "199999/200000 |" + "#" * 19
        f.write(b"\r" + b"#" * 80 + b"\r")  # a state longer than the cap, then a return
        f.flush()
        t.poll()
        assert t.take()[0].progress == "#" * 50 + f"… 30 characters not shown (full log: {path})"
        f.write(b"done\n")
    t.poll()
    (batch,) = t.take()
    assert batch.lines == ["done"] and batch.progress is None


def test_a_log_that_grew_by_much_is_read_over_several_polls(tmp_path: Path) -> None:
    """One poll reads 16 MiB at most (a node's 4 GiB log would have stalled the supervisor's
    event loop for a whole read); every line still arrives, the last poll reads the rest."""
    path = tmp_path / "rank-1.out"
    line = b"x" * 1023 + b"\n"
    path.write_bytes(line * (40 * 1024))  # 40 MiB
    t = tailer_for(path, max_lines=10)
    polls = 0
    seen = 0
    while True:
        t.poll()
        polls += 1
        got = sum(len(b.lines) + b.skipped for b in t.take())
        if not got:
            break
        assert got <= 16 * 1024, got
        seen += got
    assert polls == 4 and seen == 40 * 1024, (polls, seen)
