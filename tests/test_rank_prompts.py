"""Which ranks a line typed at a rank prompt goes to, and what the prompt says of the ranks that
wait for them (kernel/rank_prompts.py)."""

from __future__ import annotations

import pytest

from elastic_nb import protocol
from elastic_nb.kernel.rank_prompts import addressed, waiting_words

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("line", "ranks", "command"),
    [
        ("p loss", [0, 1, 2], "p loss"),  # no address: the ranks the prompt asked
        ("@1 p loss", [1], "p loss"),
        ("@2,0 c", [0, 2], "c"),
        ("@ 1 , 2   pp x", [1, 2], "pp x"),
        ("@1", [1], ""),  # an empty command: pdb repeats the last one on that rank
        ("p {'@1': 1}", [0, 1, 2], "p {'@1': 1}"),  # an @ inside the command is the command's
    ],
)
def test_a_line_goes_to_the_ranks_it_names(line: str, ranks: list[int], command: str) -> None:
    assert addressed(line, [0, 1, 2], [0, 1, 2]) == (ranks, command)


def test_a_rank_that_does_not_wait_is_refused_by_name() -> None:
    with pytest.raises(ValueError, match="rank 3 is not at a prompt; waiting: 0, 1"):
        addressed("@1,3 c", [0, 1], [0, 1])


def _wait(rank: int, op: str, expires: float | None) -> protocol.records.Waiting:
    return protocol.records.Waiting(rank=rank, op=op, expires=expires)


@pytest.mark.parametrize(
    ("waits", "words"),
    [
        ([], ""),
        (
            [_wait(0, "all_reduce #4", 1298.0)],
            " · rank 0 waits in all_reduce #4: times out in 4:58",
        ),
        ([_wait(0, "barrier #2", 1042.4)], " · rank 0 waits in barrier #2: times out in 42 s"),
        # the first to time out is named, with every rank that waits
        (
            [_wait(2, "all_reduce #4", 1600.0), _wait(0, "all_reduce #4", 1090.0)],
            " · ranks 0,2 wait in all_reduce #4: times out in 1:30",
        ),
        ([_wait(0, "all_reduce #4", None)], " · rank 0 waits in all_reduce #4"),
        (
            [_wait(0, "all_reduce #4", 999.0)],
            " · rank 0 waits in all_reduce #4: its timeout has run out",
        ),
    ],
)
def test_the_prompt_says_who_waits_and_how_long_their_timeout_has(
    waits: list[protocol.records.Waiting], words: str
) -> None:
    assert waiting_words(waits, now=1000.0) == words
