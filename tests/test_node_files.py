"""What a joined node may write into the notebook's run directory (supervisor/nodes/files.py):
its ranks' files, its own, the checkpoint records; never the notebook's own files there (the spec
a later round's launcher reads, the pushed objects ranks unpickle, the supervisor's records).
The channel's whole path, from a real agent, is tests/test_multinode.py's."""

from __future__ import annotations

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
