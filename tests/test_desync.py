"""The desync verdict from flight-recorder histories: real gloo dumps (recorded by
tests/data/fr/record.py in torch's pickled format, the one NCCL writes on a timeout) and
hand-made histories for the shapes a 2-rank recording cannot show."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from elastic_nb.common.rundir import RunDir
from elastic_nb.protocol.rank_probes import HOLD_FOR_EVIDENCE_S
from elastic_nb.supervisor.forensics import stacks
from elastic_nb.supervisor.forensics.collectives import (
    History,
    Op,
    find_certain,
    history,
    read_nccl_dump,
    stalled,
)
from elastic_nb.supervisor.forensics.desync import desync_verdict
from tests.kernel import wait_for

pytestmark = pytest.mark.unit

DATA = Path(__file__).parent / "data" / "fr"
_spec = importlib.util.spec_from_file_location("record", DATA / "record.py")
assert _spec is not None and _spec.loader is not None
record = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(record)
CELL = record.CELL


def recorded(scenario: str, left: tuple[int, ...] = ()) -> dict[int, History]:
    out = {}
    for rank in (0, 1):
        dump = read_nccl_dump(RunDir(DATA), DATA / scenario / f"fr-rank-{rank}")
        assert dump is not None
        out[rank] = history(rank, dump, CELL, left=rank in left)
    return out


def lines(scenario: str) -> list[str]:
    return record.SCENARIOS[scenario].splitlines()


def test_a_rank_that_skipped_backward_and_left_is_named_with_ddps_all_reduce() -> None:
    hs = recorded("ddp_skip", left=(1,))
    # The recording holds what the verdict reads: DDP's all-reduces, issued from backward().
    assert hs[1].last == {"0": 7} and hs[0].last == {"0": 8}
    assert hs[0].in_flight("0") == Op("0", 8, "all_reduce", False, line=9, backward=True)
    d = desync_verdict({}, CELL, lines("ddp_skip"), hs)
    assert d is not None and d.certain and d.behind == [1] and d.waiting == [0]
    assert d.text == (
        "rank 1 left the cell after 7 collectives (its last: all_reduce #7, cell line 9: "
        "loss.backward()); rank 0 waits in all_reduce #8 (cell line 9: loss.backward(): "
        "DDP's gradient all-reduce)"
    )
    assert d.notes == {1: "left the cell early"}  # the chip's words; the count is the text's
    assert d.hint is not None and "join()" in d.hint and "drop_last" in d.hint


def test_the_same_ranks_alive_are_not_certain() -> None:
    # Rank 1 has not left: it could still come (it is merely behind), so nothing is certain.
    assert find_certain(recorded("ddp_skip")) is None


def test_two_ranks_in_different_ops_at_the_same_number() -> None:
    hs = recorded("mismatch")
    d = desync_verdict({}, CELL, lines("mismatch"), hs)
    assert d is not None and d.certain and d.behind == [1]
    assert d.text == (
        "rank 1 never entered all_reduce #2: it waits in barrier #2 (cell line 7: "
        "dist.barrier()); rank 0 waits in all_reduce #2 (cell line 6: dist.all_reduce(x))"
    )


def test_a_slow_rank_is_no_desync() -> None:
    hs = recorded("slow")
    assert hs[0].in_flight("0") is not None and hs[1].last == {"0": 1}
    assert find_certain(hs) is None


def test_pg_status_keys_are_not_group_names_and_never_blame() -> None:
    # torch keys pg_status by a per-process backend counter: on rank 1, "0" is the NCCL
    # backend of a subgroup rank 0 is not in (found in review: a correct program was blamed).
    left = {"final": True, "seqs": {"0": 3}, "dump": {"pg_status": {}, "entries": []}}
    busy = {
        "seqs": {"0": 3, "1@nccl": 40},
        "nccl": {"pg_status": {"0": {"last_enqueued_collective": "40"}}, "entries": []},
    }
    hs = {0: history(0, left, CELL, left=True), 1: history(1, busy, CELL)}
    assert hs[1].last == {"0": 3, "1@nccl": 40}
    assert find_certain(hs) is None


def test_a_leaver_that_cannot_say_what_it_ran_blames_nobody() -> None:
    # A torch without the CPU flight recorder: no dump, no counts.
    unknown = history(1, {"final": True, "groups": {}, "seqs": {}, "dump": None}, CELL, left=True)
    waiter = history(0, {"seqs": {"0": 4}}, CELL)
    assert not unknown.known and find_certain({0: waiter, 1: unknown}) is None


def test_status_only_looks_are_enough_to_be_certain() -> None:
    # What the watch sees every second: each group's last number, no entries.
    leaver = History(1, last={"0": 23}, left=True, known=True)
    waiter = History(0, last={"0": 24}, known=True)
    f = find_certain({0: waiter, 1: leaver})
    assert f is not None and f.kind == "left" and f.culprits == [1]
    assert [(w.rank, w.seq, w.op) for w in f.waiters] == [(0, 24, None)]


def test_four_ranks_rank_2_leaves_and_every_waiter_is_listed() -> None:
    def waiting(rank: int, seq: int) -> History:
        op = Op("0", seq, "all_reduce", done=False, line=7)
        return History(rank, last={"0": seq}, ops={("0", seq): op}, known=True)

    last = Op("0", 5, "all_reduce", done=True, line=7)
    hs = {
        0: waiting(0, 6),
        1: waiting(1, 6),
        2: History(2, last={"0": 5}, ops={("0", 5): last}, left=True, known=True),
        3: waiting(3, 6),
    }
    cell = ["import torch.distributed as dist"] * 6 + ["dist.all_reduce(x)"]
    d = desync_verdict({}, CELL, cell, hs)
    assert d is not None and d.behind == [2] and d.waiting == [0, 1, 3]
    assert d.text == (
        "rank 2 left the cell after 5 collectives (its last: all_reduce #5, cell line 7: "
        "dist.all_reduce(x)); ranks 0, 1, 3 wait in all_reduce #6 (cell line 7: "
        "dist.all_reduce(x))"
    )
    assert d.hint is not None and "finished the cell" in d.hint


def test_a_leaver_outside_the_group_is_no_culprit() -> None:
    # Ranks 0 and 2 run collectives in a group of their own after rank 1 finished.
    leaver = History(1, last={"0": 3}, members={"0": [0, 1, 2]}, left=True, known=True)
    a = History(0, last={"0": 3, "1": 4}, members={"0": [0, 1, 2], "1": [0, 2]}, known=True)
    b = History(2, last={"0": 3, "1": 3}, members={"0": [0, 1, 2], "1": [0, 2]}, known=True)
    assert find_certain({0: a, 1: leaver, 2: b}) is None
    # ...but in the default group, once one of them goes past rank 1's last, it is certain.
    a.last["0"] = 4
    f = find_certain({0: a, 1: leaver, 2: b})
    assert f is not None and f.group == "0" and f.culprits == [1]
    assert [w.rank for w in f.waiters] == [0]


def test_a_leaver_whose_record_is_unreadable_blames_nobody() -> None:
    unknown = History(1, left=True)  # its recorder could not be read: last says nothing
    waiter = History(0, last={"0": 9}, known=True)
    assert find_certain({0: waiter, 1: unknown}) is None


def test_the_earliest_of_two_leavers_is_named() -> None:
    hs = {
        0: History(0, last={"0": 7}, known=True),
        1: History(1, last={"0": 5}, left=True, known=True),
        2: History(2, last={"0": 6}, left=True, known=True),
    }
    f = find_certain(hs)
    assert f is not None and f.culprits == [1] and f.culprit_seqs == {1: 5}


def test_stalled_pairs_are_the_ones_worth_a_full_look() -> None:
    def h(rank: int, seq: int) -> History:
        return History(rank, last={"0": seq}, known=True)

    before = {0: h(0, 4), 1: h(1, 4), 2: h(2, 3)}
    assert stalled(before, {0: h(0, 4), 1: h(1, 4), 2: h(2, 3)}) == [0, 1]
    assert stalled(before, {0: h(0, 5), 1: h(1, 4), 2: h(2, 3)}) == []  # rank 0 moved on
    assert stalled({}, before) == []


def test_the_records_elastic_nb_writes_parse_like_torchs_dumps() -> None:
    # recorder.py's shape: torch's JSON dump (strings in pg_status) plus c10d's group members.
    rec = {
        "groups": {"0": [0, 1], "1": [0]},
        "seqs": {"0": 12, "1": 0},
        "dump": {
            # Keyed by a per-process backend counter, not by name: never read.
            "pg_status": {"0": {"last_enqueued_collective": "99"}, "1": {}},
            "pg_config": {"": {"name": "", "ranks": "[]"}},
            "entries": [
                {
                    "process_group": ["0", "default_pg"],
                    "collective_seq_id": 12,
                    "profiling_name": "gloo:all_gather",
                    "state": "scheduled",
                    "retired": False,
                    "is_p2p": False,
                },
                {"process_group": ["0", ""], "collective_seq_id": 1, "is_p2p": True},
            ],
        },
    }
    h = history(0, rec, CELL)
    assert h.known and h.last == {"0": 12} and h.members == {"0": [0, 1], "1": [0]}
    assert h.in_flight("0") == Op("0", 12, "all_gather", False)


def test_a_collective_in_flight_says_how_long_its_timeout_has_left() -> None:
    """The entry's creation and its group's timeout, against when the rank took the record:
    both on the rank's clock (the supervisor adds what was left to when the answer came)."""
    entry = {
        "process_group": ["0", "default_pg"],
        "collective_seq_id": 3,
        "profiling_name": "gloo:all_reduce",
        "state": "scheduled",
        "retired": False,
        "is_p2p": False,
        "time_created_ns": 1_000_000_095_000_000_000,
        "timeout_ms": 30_000,
    }
    h = history(0, {"time": 1_000_000_100.0, "dump": {"entries": [entry]}}, CELL)
    op = h.waiting_in()
    assert op is not None and op.timeout_left == pytest.approx(25.0)
    untimed = {k: v for k, v in entry.items() if k != "timeout_ms"}
    op = history(0, {"time": 1.0, "dump": {"entries": [untimed]}}, CELL).waiting_in()
    assert op is not None and op.timeout_left is None


@pytest.mark.parametrize("rec", [None, {}, {"dump": None}, {"error": "x"}, {"dump": "garbage"}])
def test_nothing_readable_is_nothing_known(rec: dict | None) -> None:
    assert not history(0, rec, CELL).known


def test_a_truncated_dump_reads_as_none(tmp_path: Path) -> None:
    p = tmp_path / "fr-rank-0"
    p.write_bytes((DATA / "mismatch" / "fr-rank-0").read_bytes()[:100])
    assert read_nccl_dump(RunDir(tmp_path), p) is None
    assert read_nccl_dump(RunDir(tmp_path), tmp_path / "absent") is None


# ---- NCCL: entries as torch's flight recorder documents them (scheduled/started/completed) ---


def nccl_entry(seq: int, op: str, state: str, group: str = "0") -> dict:
    return {
        "record_id": seq,
        "pg_id": 0,
        "process_group": (group, "default_pg"),
        "collective_seq_id": seq,
        "p2p_seq_id": 0,
        "op_id": seq,
        "profiling_name": f"nccl:{op}",
        "time_created_ns": 1_000 * seq,
        "input_sizes": [[8]],
        "input_dtypes": ["Float"],
        "output_sizes": [[8]],
        "output_dtypes": ["Float"],
        "state": state,
        "time_discovered_started_ns": None,
        "time_discovered_completed_ns": None,
        "retired": state == "completed",
        "timeout_ms": 5000,
        "is_p2p": False,
        "frames": [],
    }


def nccl_dump(*entries: dict, ranks: str = "[0, 1]") -> dict:
    last = max(e["collective_seq_id"] for e in entries)
    return {
        "nccl": {
            "version": "2.10",
            "pg_config": {"0": {"name": "0", "desc": "default_pg", "ranks": ranks}},
            "pg_status": {"0": {"last_enqueued_collective": str(last)}},
            "entries": list(entries),
        }
    }


def test_an_async_nccl_rank_waits_in_its_oldest_unfinished_collective() -> None:
    # Rank 0's CPU ran ahead and enqueued #6 while the GPU waits in #5; rank 1 never issued #5.
    r0 = nccl_dump(
        nccl_entry(4, "all_reduce", "completed"),
        nccl_entry(5, "all_reduce", "started"),
        nccl_entry(6, "all_reduce", "scheduled"),
    )
    r1 = nccl_dump(nccl_entry(4, "all_reduce", "completed"))
    hs = {0: history(0, r0, CELL), 1: history(1, r1, CELL)}
    assert hs[0].in_flight("0@nccl") == Op("0@nccl", 5, "all_reduce", False)
    assert hs[0].members == {"0@nccl": [0, 1]}
    assert find_certain(hs) is None  # rank 1 may still come: a slow rank, not yet certain
    sleeping = (
        f'Current thread 0x1 (most recent call first):\n  File "{CELL}", line 9 in <module>\n'
    )
    where = {
        0: stacks.where_from_dump(0, sleeping.replace("line 9", "line 7"), CELL, "p0"),
        1: stacks.where_from_dump(1, sleeping, CELL, "p1"),
    }
    d = desync_verdict(where, CELL, [], hs)
    assert d is not None and not d.certain and d.behind == [1]
    assert d.text.startswith("rank 1 never entered all_reduce #5 (cell line 7)")
    # ...and once rank 1 has left the cell, it is certain.
    hs[1].left = True
    f = find_certain(hs)
    assert f is not None and f.culprits == [1] and [w.seq for w in f.waiters] == [5]


def test_two_nccl_ranks_in_different_ops_at_the_same_number() -> None:
    hs = {
        0: history(0, nccl_dump(nccl_entry(5, "all_reduce", "started")), CELL),
        1: history(1, nccl_dump(nccl_entry(5, "broadcast", "scheduled")), CELL),
    }
    f = find_certain(hs)
    assert f is not None and f.kind == "mismatch" and f.culprits == [1]
    d = desync_verdict({}, CELL, [], hs)
    assert d is not None and d.text.startswith("rank 1 never entered all_reduce #5: it waits in")


def test_gloo_and_nccl_numbers_of_one_group_never_mix() -> None:
    # One process group with both backends: each numbers its own collectives.
    def record(gloo_last: int, *nccl: dict) -> dict:
        return {"seqs": {"0": gloo_last}, **nccl_dump(*nccl)}

    leaver = history(1, record(3, nccl_entry(9, "all_reduce", "completed")), CELL, left=True)
    waiter = history(0, record(3, nccl_entry(10, "all_reduce", "started")), CELL)
    assert leaver.last == {"0": 3, "0@nccl": 9}
    f = find_certain({0: waiter, 1: leaver})
    assert f is not None and f.group == "0@nccl" and f.culprit_seqs == {1: 9}
    d = desync_verdict({}, CELL, [], {0: waiter, 1: leaver})
    assert d is not None and d.text == (
        "rank 1 left the cell after 9 collectives (its last: all_reduce #9); "
        "rank 0 waits in all_reduce #10"
    )


def test_a_dump_someone_else_wrote_is_not_unpickled(tmp_path: Path) -> None:
    p = tmp_path / "fr-rank-0"
    p.write_bytes((DATA / "mismatch" / "fr-rank-0").read_bytes())
    assert read_nccl_dump(RunDir(tmp_path), p) is not None
    link = tmp_path / "fr-rank-1"
    link.symlink_to(p)
    assert (
        read_nccl_dump(RunDir(tmp_path), link) is None
    )  # never follow a link planted in the run directory


@pytest.mark.parametrize("dump", sorted(p.relative_to(DATA) for p in DATA.glob("*/fr-rank-*")))
def test_torchs_own_dumps_read_as_plain_data(dump: Path) -> None:
    """torch writes its dumps with no global in them: read without being able to run code, each
    is what an unrestricted unpickler makes of it."""
    import pickle

    read = read_nccl_dump(RunDir(DATA), DATA / dump)
    assert read == {"nccl": pickle.loads((DATA / dump).read_bytes())}


class _Payload:
    """What a forged dump holds: unpickling it touches `path` (any callable would do)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return (Path.touch, (self.path,))


def test_a_forged_dump_runs_nothing(tmp_path: Path) -> None:
    """A joined machine mirrors its ranks' dumps into the run directory (issue 33: one that
    forged rank 0's ran its code in the supervisor within a second, the desync watch read it):
    a dump that names any callable is not read, and nothing in it ran."""
    import pickle

    marker = tmp_path / "ran"
    for forged in (
        _Payload(marker),
        {"entries": [_Payload(marker)], "version": "2.10"},  # deep inside a plausible dump
    ):
        p = tmp_path / "attempt-0" / "fr-rank-0"
        p.parent.mkdir(exist_ok=True)
        p.write_bytes(pickle.dumps(forged))
        assert read_nccl_dump(RunDir(tmp_path), p) is None
        assert not marker.exists()
        pickle.loads(p.read_bytes())  # the payload works: unrestricted, it would have run
        assert marker.exists()
        marker.unlink()


def test_a_rank_that_timed_out_waiting_for_the_leaver_still_points_at_it() -> None:
    # gloo retires the op a rank timed out in: its last word still says it waited in #11.
    timed_out = Op("0", 11, "all_reduce", done=True)
    waiter = History(0, last={"0": 11}, ops={("0", 11): timed_out}, final=True, known=True)
    leaver = History(1, last={"0": 10}, left=True, final=True, known=True)
    f = find_certain({0: waiter, 1: leaver})
    assert f is not None and f.culprits == [1] and [w.rank for w in f.waiters] == [0]
    # A live rank whose #11 is done without rank 1 shows rank 1 was no member of that group.
    waiter.final = False
    assert find_certain({0: waiter, 1: leaver}) is None


def test_a_rank_without_a_fifo_runs_on_without_probes(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from elastic_nb.rank import recorder

    taken = tmp_path / "rank-0.probe"
    taken.write_text("not a fifo")  # mkfifo fails here as on a file system without FIFOs
    with open(tmp_path / "rank-0.stacks", "a") as stacks:
        recorder.serve_probes(taken, tmp_path / "rank-0.probe.json", CELL, stacks)
    assert "no desync probes for this rank" in capsys.readouterr().err


# A rank whose collective timed out (rank/recorder.hold_for_evidence), in a process of its own:
# its probe thread serves the FIFO, the main thread holds for the error given, then says how long
# it held and whether it was released.
_HOLDER = """
import json, sys, time
from pathlib import Path
from elastic_nb.rank import recorder
d = Path(sys.argv[1])
with open(d / "rank-0.stacks", "a") as stacks:
    assert recorder.serve_probes(d / "rank-0.probe", d / "rank-0.probe.json", "cell.py", stacks)
    t0 = time.monotonic()
    recorder.hold_for_evidence(RuntimeError(sys.argv[2]))
    print(json.dumps({"held": time.monotonic() - t0, "released": recorder._released.is_set()}))
"""
TIMED_OUT_ERROR = "[unbound_buffer.cc:78] Timed out waiting 3000ms for recv operation to complete"


def _holder(tmp_path: Path, error: str) -> subprocess.Popen[str]:
    env = {**os.environ, "WORLD_SIZE": "2"}
    return subprocess.Popen(
        [sys.executable, "-c", _HOLDER, str(tmp_path), error],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_a_rank_whose_collective_timed_out_holds_its_exit_until_released(tmp_path: Path) -> None:
    p = _holder(tmp_path, TIMED_OUT_ERROR)
    # The supervisor's release, as LocalSite sends a probe (the FIFO's write end; opening it
    # waits for the probe thread's read end).
    fifo = tmp_path / "rank-0.probe"
    assert wait_for(fifo.exists, timeout=30)
    fd = os.open(fifo, os.O_WRONLY)
    os.write(fd, b"7 release\n")
    os.close(fd)
    out, _ = p.communicate(timeout=HOLD_FOR_EVIDENCE_S)
    said = json.loads(out)
    assert said["released"] and said["held"] < HOLD_FOR_EVIDENCE_S
    assert json.loads((tmp_path / "rank-0.probe.json").read_text())["req"] == 7


@pytest.mark.parametrize(
    "error, holds",
    [(TIMED_OUT_ERROR, True), ("rank 1 ran out of patience", False)],
    ids=["timed out", "another error"],
)
def test_without_a_release_a_timed_out_rank_goes_after_the_bound(
    tmp_path: Path, error: str, holds: bool
) -> None:
    out, _ = _holder(tmp_path, error).communicate(timeout=HOLD_FOR_EVIDENCE_S + 30)
    said = json.loads(out)
    assert not said["released"]
    assert (said["held"] >= HOLD_FOR_EVIDENCE_S) == holds
