"""What a joined node may write into the notebook's run directory (supervisor/nodes/files.py):
its ranks' files, its own, the checkpoint records; never the notebook's own files there (the spec
a later round's launcher reads, the pushed objects ranks unpickle, the supervisor's records).
The channel's whole path, from a real agent, is tests/test_multinode.py's."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import anyio
import pytest

from elastic_nb.supervisor.nodes.files import Mirror, from_node, write_chunk

pytestmark = pytest.mark.unit

THE_NODES = [
    "attempt-0/rank-3.stdout",
    "attempt-12/rank-0.result.pkl",
    "attempt-1/fr-rank-2",
    "nodes/2-gpu-b/launcher.log",
    "checkpoints.jsonl",
]
THE_NOTEBOOKS = [
    "spec.json",
    "payload.pkl",
    "cell.py",
    "cell.json",
    "events.jsonl",
    "summary.json",
    "attempt-0/sub/rank-0.stdout",  # no deeper than an attempt's own files
    "attempt-x/rank-0.stdout",
    "../evil",
    "attempt-0/../spec.json",
    "/etc/passwd",
    "",
    # What the supervisor here opens or writes for itself: a probe's FIFO (a write to it blocked
    # the supervisor until someone read it), a probe's answer, temporary and hidden names.
    "attempt-0/rank-0.probe",
    "attempt-0/rank-0.probe.json",
    "attempt-0/rank-0.result.pkl.tmp",
    "attempt-0/.rank-0.result.pkl.mirror.tmp",
    "nodes/1-b/.hidden",
]


@pytest.mark.parametrize("rel", THE_NODES)
def test_a_nodes_own_files_are_written(tmp_path: Path, rel: str) -> None:
    assert from_node(rel)
    write_chunk(tmp_path, rel, -1, b"whole")
    write_chunk(tmp_path, rel, 5, b" and more")
    assert (tmp_path / rel).read_bytes() == b"whole and more"


@pytest.mark.parametrize("rel", THE_NOTEBOOKS)
def test_the_notebooks_own_files_are_refused_and_left_alone(tmp_path: Path, rel: str) -> None:
    (tmp_path / "spec.json").write_text("the notebook's")
    assert not from_node(rel)
    with pytest.raises(ValueError, match="a node sent a file it may not write"):
        write_chunk(tmp_path, rel, -1, b"a node's")
    assert (tmp_path / "spec.json").read_text() == "the notebook's"
    assert not (tmp_path.parent / "evil").exists()


def test_a_nodes_mirror_sends_only_what_the_notebook_takes(tmp_path: Path) -> None:
    """The node's side sends its ranks' files, its launcher's log (renamed under nodes/), and
    never what it received from the notebook or wrote for itself alone."""
    top = tmp_path / "run"
    (top / "attempt-0").mkdir(parents=True)
    (top / "attempt-0" / "rank-1.stdout").write_text("hello")
    (top / "attempt-0" / "rank-1.probe.json").write_text("{}")  # the node's own business
    (top / "launcher.log").write_text("launcher")
    (top / "spec.json").write_text("{}")  # received from the notebook
    (top / "events.jsonl").write_text("{}")  # no node writes these: never sent
    sent: list[tuple[str, int, bytes]] = []

    async def send(group: str, root: str, rel: str, offset: int, data: bytes) -> None:
        sent.append((rel, offset, data))

    mirror = Mirror(
        send, roots={top: ("g1", "")}, renames={"launcher.log": "nodes/1-b/launcher.log"}
    )
    anyio.run(mirror.sweep)
    assert sorted(sent) == [
        ("attempt-0/rank-1.stdout", -1, b"hello"),
        ("nodes/1-b/launcher.log", -1, b"launcher"),
    ]
    sent.clear()
    with (top / "attempt-0" / "rank-1.stdout").open("a") as f:
        f.write(" world")
    anyio.run(mirror.sweep)
    assert sent == [("attempt-0/rank-1.stdout", 5, b" world")]


def test_a_chunk_past_the_end_of_a_file_is_refused(tmp_path: Path) -> None:
    """A file grows only from its end: a chunk at 2**35 would make a sparse file whose hole the
    log tailer read for 90 s, the event loop stalled (issue 33)."""
    write_chunk(tmp_path, "attempt-1/rank-1.stdout", -1, b"abc")
    with pytest.raises(ValueError, match="from byte 34359738368, past its end"):
        write_chunk(tmp_path, "attempt-1/rank-1.stdout", 2**35, b"xy")
    assert (tmp_path / "attempt-1" / "rank-1.stdout").stat().st_size == 3
    write_chunk(tmp_path, "attempt-1/rank-1.stdout", 3, b"def")  # from its end: taken
    assert (tmp_path / "attempt-1" / "rank-1.stdout").read_bytes() == b"abcdef"


def test_only_regular_files_are_written_and_nothing_waits(tmp_path: Path) -> None:
    """A FIFO, a link or a directory where a rank's file goes is refused at once: a write into
    a FIFO nobody reads would block the supervisor's event loop in open(), a link would write
    wherever it points. A whole file replaces what is there."""
    attempt = tmp_path / "attempt-0"
    attempt.mkdir()
    os.mkfifo(attempt / "rank-0.stdout")
    outside = tmp_path / "outside"
    outside.write_bytes(b"untouched")
    (attempt / "rank-1.stdout").symlink_to(outside)
    (attempt / "rank-2.stdout").mkdir()
    refused: list[str] = []

    def write_all() -> None:
        for rank in (0, 1, 2):
            with pytest.raises(ValueError, match="not a regular file here") as e:
                write_chunk(tmp_path, f"attempt-0/rank-{rank}.stdout", 0, b"a node's")
            refused.append(str(e.value))

    writer = threading.Thread(target=write_all, daemon=True)
    writer.start()
    writer.join(10)
    assert len(refused) == 3, refused  # all three at once, none blocked
    assert outside.read_bytes() == b"untouched"
    write_chunk(tmp_path, "attempt-0/rank-1.stdout", -1, b"whole")
    assert (attempt / "rank-1.stdout").read_bytes() == b"whole"
    assert not (attempt / "rank-1.stdout").is_symlink() and outside.read_bytes() == b"untouched"


def test_a_ranks_file_waits_until_its_start_has_been_said(tmp_path: Path) -> None:
    """The node's side holds a rank's files until the supervisor has heard that the launcher
    started it (else it would refuse them), then sends them whole."""
    top = tmp_path / "run"
    (top / "attempt-0").mkdir(parents=True)
    (top / "attempt-0" / "rank-1.out").write_text("early")
    sent: list[str] = []
    told: set[str] = set()

    async def send(group: str, root: str, rel: str, offset: int, data: bytes) -> None:
        sent.append(f"{rel} {offset} {data.decode()}")

    mirror = Mirror(send, lambda group, rel: rel in told, roots={top: ("g1", "")})
    anyio.run(mirror.sweep)
    assert sent == []
    told.add("attempt-0/rank-1.out")
    anyio.run(mirror.sweep)
    assert sent == ["attempt-0/rank-1.out -1 early"]
