"""Each rank's memory over time: what its site reads once a second (the host memory it holds,
NVML's figure for its GPU) and what its CUDA allocator answers. The samples the dashboard draws,
each rank's peaks, how fast it grows, and an alert when the ranks near a limit: their host memory
against their cgroup's limit (or the machine's), a GPU's against its total.

Once per crossing, not a flood: an alert fires when a figure reaches NEAR of its limit, and again
only after it fell back below CLEAR; once per limit, whatever the number of ranks under it (the
host's, each GPU's), naming the rank that grows fastest.
"""

from __future__ import annotations

from collections import deque

from elastic_nb.common.host_memory import MemoryLimit
from elastic_nb.common.report import rate, size
from elastic_nb.protocol.records import MemoryPeak, MemorySample

__all__ = ["SAMPLE_S", "MemoryWatch", "Peaks"]

SAMPLE_S = 1.0  # one sample per rank per second
KEEP = 300  # samples per rank: the last five minutes
NEAR, CLEAR = 0.90, 0.85
GROWTH_S = 60.0  # the growth rate is taken over the last minute
MIN_SPAN_S = 3.0  # of samples, at least, for a rate


class Peaks:
    """Each rank's highest figures over a stretch of samples (a job; a session cell's run)."""

    def __init__(self) -> None:
        self._by_rank: dict[int, MemoryPeak] = {}

    def add(self, s: MemorySample) -> None:
        p = self._by_rank.setdefault(
            s["rank"], MemoryPeak(rss=None, cuda=None, gpu=None, gpu_index=None)
        )
        p["rss"] = _max(p["rss"], s["rss"])
        if s["cuda"] is not None:
            p["cuda"] = _max(p["cuda"], s["cuda"]["peak"])
        if s["gpu"] is not None:
            p["gpu"] = _max(p["gpu"], s["gpu"]["process"])
            p["gpu_index"] = s["gpu"]["index"]

    def record(self) -> dict[str, MemoryPeak]:
        return {str(rank): p.copy() for rank, p in sorted(self._by_rank.items())}


class MemoryWatch:
    def __init__(self) -> None:
        self._series: dict[tuple[int, int], deque[MemorySample]] = {}
        self._rss_peak: dict[tuple[int, int], int] = {}
        self.peaks = Peaks()  # over the group's life
        self._followers: list[Peaks] = []
        self._armed: dict[str, bool] = {}  # per limit: "host", "gpu <index>"

    def add(self, s: MemorySample) -> None:
        key = (s["attempt"], s["rank"])
        self._series.setdefault(key, deque(maxlen=KEEP)).append(s)
        if s["rss"] is not None:
            self._rss_peak[key] = max(self._rss_peak.get(key, 0), s["rss"])
        for p in (self.peaks, *self._followers):
            p.add(s)

    def follow(self) -> Peaks:
        """Peaks from now on, until `unfollow`."""
        p = Peaks()
        self._followers.append(p)
        return p

    def unfollow(self, p: Peaks) -> None:
        if p in self._followers:
            self._followers.remove(p)

    def forget(self, attempt: int) -> None:
        """An attempt is over: its series go (their peaks stay)."""
        for key in [k for k in self._series if k[0] <= attempt]:
            del self._series[key]

    def recent(self, attempt: int) -> list[MemorySample]:
        """Every sample kept of the attempt's ranks, oldest first."""
        found = [s for (a, _), q in self._series.items() if a == attempt for s in q]
        return sorted(found, key=lambda s: s["t"])

    def latest(self, attempt: int) -> dict[int, MemorySample]:
        return {rank: q[-1] for (a, rank), q in self._series.items() if a == attempt and q}

    def rss_peak(self, attempt: int, rank: int) -> int | None:
        return self._rss_peak.get((attempt, rank))

    def growth(self, attempt: int, rank: int, what: str) -> float | None:
        """Bytes per minute over the last minute (`what`: "rss", or "gpu": NVML's share, else
        the allocator's reserved memory); None over less than MIN_SPAN_S of samples."""
        q = self._series.get((attempt, rank))
        if not q:
            return None
        last = q[-1]
        first = next(s for s in q if s["t"] >= last["t"] - GROWTH_S)
        span = last["t"] - first["t"]
        a, b = _figure(first, what), _figure(last, what)
        if span < MIN_SPAN_S or a is None or b is None:
            return None
        return (b - a) / span * 60.0

    def alerts(self, attempt: int, limit: MemoryLimit | None) -> list[tuple[int, str]]:
        """(rank, title) of each limit the attempt's ranks have just come near."""
        out: list[tuple[int, str]] = []
        latest = self.latest(attempt)
        if limit is not None and latest and self._crossed("host", limit.used / limit.limit):
            # The rank that grows fastest is the likely cause; else the one holding the most.
            def weight(rank: int) -> tuple[float, int]:
                return (self.growth(attempt, rank, "rss") or 0.0, latest[rank]["rss"] or 0)

            rank = max(latest, key=weight)
            held = latest[rank]["rss"]
            title = (
                f"rank {rank}: {limit.used / limit.limit:.0%} of the host memory its ranks may "
                f"use ({size(limit.used)} of {size(limit.limit)}: {limit.what})"
                f"{_rate(self.growth(attempt, rank, 'rss'))}"
                + (f"; rank {rank} holds {size(held)}" if held is not None else "")
            )
            out.append((rank, title))
        for index, (used, total, ranks) in sorted(_gpus(latest).items()):
            if not self._crossed(f"gpu {index}", used / total):
                continue

            # Ranks sharing a GPU cross its limit together: one alert, naming the rank that
            # grows fastest (else the one holding the most of it).
            def on_gpu(rank: int) -> tuple[float, int]:
                return (self.growth(attempt, rank, "gpu") or 0.0, _figure(latest[rank], "gpu") or 0)

            rank = max(ranks, key=on_gpu)
            title = (
                f"rank {rank}: {used / total:.0%} of GPU {index} ({size(used)} of {size(total)})"
                f"{_rate(self.growth(attempt, rank, 'gpu'))}"
            )
            if len(ranks) > 1:
                title += f"; ranks {', '.join(map(str, ranks))} share GPU {index}"
                if (held := _figure(latest[rank], "gpu")) is not None:
                    title += f", rank {rank} holds {size(held)}"
            out.append((rank, title))
        return out

    def _crossed(self, key: str, fraction: float) -> bool:
        """True once when `fraction` reaches NEAR; armed again below CLEAR."""
        armed = self._armed.get(key, True)
        if armed and fraction >= NEAR:
            self._armed[key] = False
            return True
        if not armed and fraction < CLEAR:
            self._armed[key] = True
        return False


def _gpus(latest: dict[int, MemorySample]) -> dict[int, tuple[int, int, list[int]]]:
    """Each GPU the ranks use: (used, total, its ranks). NVML's account of the device (every
    process on it, the same figure in each of its ranks' samples), else what the ranks'
    allocators hold of it, summed (torch's device index: where each rank sees a different
    CUDA_VISIBLE_DEVICES, two GPUs of the same index would count as one; NVML is there
    wherever NVIDIA's driver is, so this is the rare case)."""
    found: dict[int, tuple[int, int, list[int]]] = {}
    for rank, s in sorted(latest.items()):
        if s["gpu"] is not None and s["gpu"]["total"]:
            index, used, total = s["gpu"]["index"], s["gpu"]["used"], s["gpu"]["total"]
        elif s["cuda"] is not None and s["cuda"]["total"]:
            index, total = s["cuda"]["device"], s["cuda"]["total"]
            used = s["cuda"]["reserved"] + (found[index][0] if index in found else 0)
        else:
            continue
        found[index] = (used, total, [*found.get(index, (0, 0, []))[2], rank])
    return found


def _figure(s: MemorySample, what: str) -> int | None:
    if what == "rss":
        return s["rss"]
    if s["gpu"] is not None:
        return s["gpu"]["process"]
    return s["cuda"]["reserved"] if s["cuda"] is not None else None


def _rate(per_minute: float | None) -> str:
    words = rate(per_minute)
    return f", {words}" if words else ""


def _max(a: int | None, b: int | None) -> int | None:
    return b if a is None else a if b is None else max(a, b)
