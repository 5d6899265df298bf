"""A rank group's memory readings (rank_group.RankGroup samples them once a second): each live
rank's host memory and GPU share as the site it runs at reads them, without asking the rank, and
its CUDA allocator's figures, asked of the rank only where its machine has GPUs (a CPU rank pays
nothing); and what %elastic status prints of them."""

from __future__ import annotations

import time

import anyio

from elastic_nb import protocol
from elastic_nb.common.host_memory import MemoryLimit
from elastic_nb.common.rank_state import RankState
from elastic_nb.supervisor.processes.site import Site
from elastic_nb.supervisor.ranks.memory_watch import MemoryWatch

__all__ = ["memory_figures", "read_memory"]

CUDA_WAIT_S = 0.5  # for a rank's allocator figures (its probe thread answers in milliseconds)


async def read_memory(
    site: Site, attempt: int, ranks: list[RankState]
) -> tuple[list[protocol.records.MemorySample], MemoryLimit | None]:
    """A sample of each of `ranks`, live at `site`, and the limit their host memory is under."""
    reading = site.read_memory(ranks)
    cuda = await _cuda_memory(site, ranks) if reading.gpus else {}
    t = time.time()
    samples = [
        protocol.records.MemorySample(
            attempt=attempt,
            rank=r.rank,
            t=t,
            rss=reading.rss.get(r.rank),
            cuda=cuda.get(r.rank),
            gpu=reading.gpu.get(r.rank),
            limit=reading.limit.limit if reading.limit else None,
        )
        for r in ranks
    ]
    return samples, reading.limit


async def _cuda_memory(
    site: Site, ranks: list[RankState]
) -> dict[int, protocol.records.CudaMemory | None]:
    """Each rank's CUDA allocator figures, asked all at once (None: no CUDA in it yet)."""
    out: dict[int, protocol.records.CudaMemory | None] = {}

    async def ask(r: RankState) -> None:
        answer = await site.probe(r, protocol.rank_probes.PROBE_MEMORY, CUDA_WAIT_S)
        out[r.rank] = (answer or {}).get("cuda")

    async with anyio.create_task_group() as tg:
        for r in ranks:
            tg.start_soon(ask, r)
    return out


def memory_figures(memory: MemoryWatch, attempt: int) -> dict[str, protocol.kernel.RankMemory]:
    """Each rank's latest memory sample in `attempt`, its peak and its growth per minute (host
    memory): what %elastic status prints."""
    return {
        str(rank): protocol.kernel.RankMemory(
            sample=s,
            rss_peak=memory.rss_peak(attempt, rank),
            growth=memory.growth(attempt, rank, "rss"),
        )
        for rank, s in sorted(memory.latest(attempt).items())
    }
