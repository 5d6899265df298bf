"""Which ranks a line typed at a rank prompt goes to (kernel/rank_prompts.py)."""

from __future__ import annotations

import pytest

from elastic_nb.kernel.rank_prompts import addressed

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
