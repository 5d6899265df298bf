"""`elastic-nb join`'s token: from --token, or from $ELASTIC_NB_TOKEN (which, unlike a command
line, other users of the machine cannot read); none at all is a clear error that joins nothing.
A real agent's join is tests/test_multinode.py's."""

from __future__ import annotations

import pytest

from elastic_nb.cli import TOKEN_ENV, main

pytestmark = pytest.mark.unit


def test_join_without_a_token_says_where_one_comes_from(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    with pytest.raises(SystemExit) as exited:
        main(["join", "127.0.0.1:1"])
    assert exited.value.code == 2
    assert f"a token is needed: --token TOKEN or ${TOKEN_ENV}" in capsys.readouterr().err


@pytest.mark.parametrize("where", ["env", "flag"])
def test_join_reads_the_token_from_the_environment_or_the_flag(
    where: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """A token that is none is refused before anything connects, wherever it came from."""
    argv = ["join", "127.0.0.1:1"]
    if where == "env":
        monkeypatch.setenv(TOKEN_ENV, "not-a-token")
    else:
        monkeypatch.delenv(TOKEN_ENV, raising=False)
        argv += ["--token", "not-a-token"]
    assert main(argv) == 2
    assert "the token is not one elastic_nb made" in capsys.readouterr().err


def test_no_token_begins_like_an_option() -> None:
    """The join line is `elastic-nb join HOST:PORT --token TOKEN`: a token that began with "-"
    (1 in 64 of base64's) was read by argparse as an option, and the join failed at once with
    "--token: expected one argument" (it did so in a full run). 2,000 new keys: without the
    rule, some 31 of them would begin so."""
    from elastic_nb.supervisor.nodes.channel import Keys

    tokens = [Keys.new().token() for _ in range(2000)]
    assert not [t for t in tokens if t.startswith("-")]
    assert len({t[0] for t in tokens}) == 63  # every other first character still comes
