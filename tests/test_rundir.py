"""The run directory: what is unpickled from it must be the user's own."""

from __future__ import annotations

import os
import pickle
from pathlib import Path

import pytest

from elastic_nb.common.rundir import RunDir

pytestmark = pytest.mark.unit


@pytest.fixture
def rd(tmp_path: Path) -> RunDir:
    shared = tmp_path / "shared"  # a --log-dir anyone may write to, like /tmp
    shared.mkdir()
    shared.chmod(0o1777)
    rd = RunDir(shared / "cafe0001")
    rd.path.mkdir(mode=0o700)
    rd.attempt(0).mkdir(mode=0o700)
    rd.result(0).write_bytes(pickle.dumps(("value", 42)))
    return rd


def test_our_own_files_load(rd: RunDir) -> None:
    assert pickle.loads(rd.read_private(rd.result(0))) == ("value", 42)


@pytest.mark.parametrize("where", ["run dir", "attempt dir", "file"])
def test_what_others_may_write_is_refused(rd: RunDir, where: str) -> None:
    target = {"run dir": rd.path, "attempt dir": rd.attempt(0), "file": rd.result(0)}[where]
    target.chmod(0o777 if target.is_dir() else 0o666)
    with pytest.raises(PermissionError, match="others may write to it"):
        rd.read_private(rd.result(0))


def test_a_planted_link_is_not_followed(rd: RunDir, tmp_path: Path) -> None:
    elsewhere = tmp_path / "elsewhere.pkl"
    elsewhere.write_bytes(pickle.dumps("planted"))
    os.replace(rd.result(0), tmp_path / "moved")
    rd.result(0).symlink_to(elsewhere)
    with pytest.raises(OSError):
        rd.read_private(rd.result(0))


def test_a_new_run_directory_and_every_folder_made_above_it_are_the_owners_alone(
    tmp_path: Path,
) -> None:
    """A first job makes ~/.cache/elastic_nb/runs/ too: made with Path.mkdir's default mode
    (0755 under the usual umask), every local user could list the jobs (issue 33)."""
    old = os.umask(0o022)  # the usual umask, whatever this process had
    try:
        rd = RunDir(tmp_path / "cache" / "elastic_nb" / "runs" / "cafe0002")
        rd.create("{}", "print(1)\n", {}, None)
    finally:
        os.umask(old)
    made = [tmp_path / "cache", tmp_path / "cache" / "elastic_nb", rd.path.parent, rd.path]
    assert {str(d): oct(d.stat().st_mode & 0o777) for d in made} == {str(d): "0o700" for d in made}
    with pytest.raises(FileExistsError):  # a job's directory is new, never another's
        rd.create("{}", "print(1)\n", {}, None)


def test_a_record_larger_than_any_of_ours_is_not_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from elastic_nb.common import rundir

    monkeypatch.setattr(rundir, "MAX_RECORD", 100)
    path = tmp_path / "rank-1.done.json"
    path.write_text('{"ok": true}')
    assert rundir.read_json(path) == {"ok": True}
    path.write_text('{"ok": "' + "x" * 100 + '"}')
    assert rundir.read_json(path) is None
