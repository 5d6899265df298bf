"""Which ranks a line typed at a rank prompt goes to, what the prompt says of the ranks that
wait for them (kernel/rank_prompts.py), and their chips (supervisor/runs/prompts.py)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import anyio
import pytest

from elastic_nb import protocol
from elastic_nb.common.rundir import RunDir
from elastic_nb.kernel.rank_prompts import addressed, waiting_words
from elastic_nb.supervisor.ranks.rank_book import RankBook
from elastic_nb.supervisor.runs.prompts import GroupPrompts, Prompts
from elastic_nb.supervisor.runs.reporter import Reporter

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


def test_a_waiting_rank_that_stops_at_a_prompt_of_its_own_keeps_its_paused_chip(
    tmp_path: Path,
) -> None:
    """Rank 0 waited in a collective for rank 1 (its chip said so); rank 1 went on, and rank 0
    is now at a prompt of its own: the next look finds it waiting for nobody, but its chip
    stays 'paused', not the book's 'running'. A rank that simply stops waiting gets the book's
    chip back. The chips are read as the dashboard gets them: in the next update."""
    rd = RunDir(tmp_path)
    sent: list[dict[str, Any]] = []

    async def send(msg: Any) -> None:
        sent.append(dict(msg))

    report = Reporter("cafe0001", send)

    class Group(GroupPrompts):
        teardown_at = None

        def __init__(self) -> None:
            self.book, self.prompts = RankBook(rd), Prompts(rd)
            self._asker = lambda: report  # the hook that names who follows the group's ranks

    async def shown() -> dict[int, protocol.records.Chip]:
        """Each rank's chip on the dashboard: the latest of every update, this one flushed."""
        await report.flush(0, None)
        chips: dict[int, protocol.records.Chip] = {}
        for m in sent:
            chips.update({int(rank): chip for rank, chip in m.get("ranks", {}).items()})
        return chips

    async def main() -> None:
        g = Group()
        site: Any = None
        r0, r1 = g.book.add(0, 0, 100, 0.0, site), g.book.add(0, 1, 101, 0.0, site)
        wait = protocol.records.Waiting(rank=0, op="all_reduce #1", expires=None)
        g.show_waits(0, {0: (wait, [1])})
        assert (await shown())[0]["state"] == "waiting"
        # Rank 0 at a prompt of its own: paused, and its chip says so (GroupPrompts' prompt)
        g.prompts.paused[(0, 0)] = protocol.rank_probes.InputAsked(
            ask=1, prompt="(Pdb) ", out=0, err=0, t=0.0, post_mortem=False, line=8
        )
        paused = g.book.chip(r0, None)
        paused["state"], paused["label"] = "paused", "paused at line 8"
        report.chip(0, paused)
        g.show_waits(0, {})
        assert (await shown())[0] == paused and g.prompts.waits == {}
        barrier = protocol.records.Waiting(rank=1, op="barrier #2", expires=None)
        g.show_waits(0, {1: (barrier, [0])})
        g.show_waits(0, {})
        chips = await shown()
        assert chips[1] == g.book.chip(r1, None)  # waiting for nobody: the book's again
        assert chips[0] == paused

    anyio.run(main)
