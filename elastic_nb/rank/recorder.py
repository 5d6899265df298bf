"""A rank's collectives, read from torch's flight recorder, for the supervisor's desync verdict.

torch records every collective of every process group, gloo and NCCL alike, in a ring buffer
(``TORCH_FR_BUFFER_SIZE``, 2,000 entries by default). A rank leaves its record in the run
directory when it ends (`write_final`), and while the cell runs a thread of the rank answers the
supervisor's probes (`serve_probes`): the main thread may be blocked in a collective, but c10d
releases the GIL there, so a Python thread can still read the recorder.

torch keeps two recorders, the CPU one (gloo) and, in builds with NCCL, NCCL's: a record holds
both. It keeps torch's own dump format (entries trimmed to the fields the verdict reads, their
frames to those down to the cell's), so that the supervisor reads it and the dumps NCCL writes
on a timeout with one parser (`supervisor.desync.history`). Added from c10d's own registry: the
members of every group (gloo's ``pg_config`` lists none) and each group's collective count by
its name (``seqs``: the dump's ``pg_status`` is keyed by a per-process backend counter, which
names different groups on different ranks).

Imported in every rank before torch (by the worker): torch is read only if the cell loaded it.
"""

from __future__ import annotations

import contextlib
import faulthandler
import json
import os
import pickle
import sys
import threading
import time
from pathlib import Path
from typing import Any, TextIO

from elastic_nb.common.rundir import write_json
from elastic_nb.protocol.rank_probes import (
    HOLD_FOR_EVIDENCE_S,
    PROBE_ANSWER,
    PROBE_FULL,
    PROBE_MEMORY,
    PROBE_RELEASE,
    PROBE_STACKS,
    TIMED_OUT,
)
from elastic_nb.rank import notebook_input
from elastic_nb.rank.memory import cuda_memory

__all__ = ["serve_probes", "snapshot", "write_final"]

# Entry fields the verdict reads (supervisor/desync.py) and, for a rank waiting for one at a
# prompt, when its timeout runs out (supervisor/runs/prompts.py); the rest (sizes, dtypes, ...)
# stays out.
_FIELDS = (
    "process_group",
    "collective_seq_id",
    "profiling_name",
    "state",
    "retired",
    "is_p2p",
    "time_created_ns",
    "timeout_ms",
)
_MAX_FRAMES = 8  # innermost frames kept per entry, down to the cell's own


def snapshot(cell: str, full: bool, frames: bool = False) -> dict[str, Any]:
    """Each group's members and collective count, from c10d's registry: cheap enough to ask
    every second. With `full`, what the flight recorders hold too, the CPU one (gloo) as
    ``dump``, NCCL's as ``nccl``: tens of milliseconds for a full buffer, asked for only when a
    desync is suspected or certain. `frames`: each entry's Python stack too, where that is
    cheap (see `_read`)."""
    record: dict[str, Any] = {"time": time.time(), "groups": {}, "seqs": {}, "dump": None}
    if "torch.distributed" not in sys.modules:
        return record  # the cell never loaded it: no collective to speak of
    from torch._C import _distributed_c10d

    c10d: Any = _distributed_c10d  # its flight recorder's functions vary with the build

    record["groups"], record["seqs"] = _groups()
    if not full or not hasattr(c10d, "_dump_fr_trace_json"):  # a torch without the recorder
        return record
    record["dump"] = _read(c10d._dump_fr_trace_json, c10d._dump_fr_trace, cell, frames)
    torch = sys.modules["torch"]
    # NCCL records into a flight recorder of its own (built only with NCCL). Asked only once
    # CUDA is up: nothing here may initialise it.
    if hasattr(c10d, "_dump_nccl_trace_json") and torch.cuda.is_initialized():
        record["nccl"] = _read(c10d._dump_nccl_trace_json, c10d._dump_nccl_trace, cell, frames)
    return record


def _read(as_json: Any, as_pickle: Any, cell: str, frames: bool) -> dict[str, Any]:
    if frames and "torch._inductor" in sys.modules:
        # With stacks, each entry says which cell line issued it (DDP's all-reduces included:
        # they are issued from backward()). Symbolising imports torch._inductor, 1.5 s the
        # first time: only where the cell has paid for that already, and only in the record a
        # rank leaves (a probe's answer must come in milliseconds; live ranks' stacks say
        # where they are).
        dump = pickle.loads(as_pickle(True, True, False))
    else:
        dump = json.loads(as_json(True, False))
    dump["entries"] = [_trim(e, cell) for e in dump.get("entries", ())]
    record: dict[str, Any] = dump
    return record


def write_final(path: Path, cell: str) -> None:
    """The rank's whole history, as it leaves the cell (finished or raised)."""
    try:
        write_json(path, {**snapshot(cell, full=True, frames=True), "final": True})
    except Exception as e:  # forensics must never change the outcome
        sys.stderr.write(f"elastic_nb: could not record this rank's collectives: {e!r}\n")


_serving = threading.Event()  # the probe thread listens: the supervisor can reach this rank
_released = threading.Event()  # the supervisor has taken the evidence (PROBE_RELEASE)


def hold_for_evidence(error: BaseException) -> None:
    """A collective of this rank timed out while the others wait, in a collective or elsewhere:
    stay until the supervisor has taken every rank's stack and flight recorder (it releases the
    rank), `HOLD_FOR_EVIDENCE_S` at most. Once this rank exits, torch's agent ends the others at
    its next monitor tick, and with them where they were; a loaded machine's supervisor could
    see this rank's failure after that."""
    if (
        _serving.is_set()
        and int(os.environ.get("WORLD_SIZE", "1")) > 1
        and TIMED_OUT.search(str(error))
    ):
        _released.wait(HOLD_FOR_EVIDENCE_S)


def serve_probes(fifo: Path, answer: Path, cell: str, stacks: TextIO) -> bool:
    """Answer the supervisor's probes from a thread: it writes ``"<n> status|full|memory"`` into the
    FIFO, this thread writes the snapshot, tagged with n, to `answer`; ``"<n> stacks <deadline>"``
    has every thread's stack written to `stacks` (see protocol.rank_probes.STACK_SIGNAL);
    ``"<n> answer <json>"`` hands the notebook's answer to the rank's input() (notebook_input.py),
    and says whether one waited for it; ``"<n> release"`` ends `hold_for_evidence`. False where
    no probe can come: opening a FIFO blocks until the other side opens it: an idle rank pays
    nothing. Where no FIFO can be made (a --log-dir on a file system without them), the rank
    runs without: the supervisor then finds a desync at the collective timeout, from the records
    ranks leave, and signals the rank for its stacks."""
    try:
        os.mkfifo(fifo, 0o600)
    except OSError as e:
        sys.stderr.write(f"elastic_nb: no desync probes for this rank ({fifo}: {e})\n")
        return False
    threading.Thread(
        target=_serve, args=(fifo, answer, cell, stacks), name="elastic_nb-probe", daemon=True
    ).start()
    _serving.set()
    return True


def _serve(fifo: Path, answer: Path, cell: str, stacks: TextIO) -> None:
    while True:
        try:
            with open(fifo, "rb") as f:
                lines = f.read().decode(errors="replace").splitlines()
            # Two requests in one read (the first timed out before it was read): the supervisor
            # waits for the last one only.
            request = lines[-1].split(maxsplit=2) if lines else []
            if len(request) < 2 or not request[0].isdigit():
                continue
            if request[1] == PROBE_ANSWER:
                try:
                    taken = notebook_input.answered(json.loads(request[2]))
                except (ValueError, IndexError, KeyError, TypeError):
                    taken = False
                write_json(answer, {"time": time.time(), "taken": taken, "req": int(request[0])})
                continue
            if request[1] == PROBE_RELEASE:
                # Answered first: the released rank exits at once, this thread with it.
                write_json(answer, {"time": time.time(), "released": True, "req": int(request[0])})
                _released.set()
                continue
            if request[1] == PROBE_STACKS:
                # faulthandler called with the GIL held: no other thread moves its frames
                # meanwhile. Past the deadline the supervisor has signalled the rank instead.
                with contextlib.suppress(ValueError, IndexError):
                    if time.time() <= float(request[2]):
                        faulthandler.dump_traceback(file=stacks, all_threads=True)
                continue
            record: dict[str, Any]
            try:
                if request[1] == PROBE_MEMORY:
                    record = {"time": time.time(), "cuda": cuda_memory()}
                else:
                    record = snapshot(cell, full=request[1] == PROBE_FULL)
            except Exception as e:
                record = {"time": time.time(), "error": repr(e)}
            write_json(answer, {**record, "req": int(request[0])})
        except OSError:
            return  # the run directory went away: the job is over


def _groups() -> tuple[dict[str, list[int]], dict[str, int]]:
    """Every process group this rank is a member of, by name: its members' global ranks, and
    how many collectives each of its backends has issued (NCCL's as ``<name>@nccl``: each
    backend numbers its own)."""
    c10d: Any = sys.modules.get("torch.distributed.distributed_c10d")
    members: dict[str, list[int]] = {}
    seqs: dict[str, int] = {}
    try:
        for pg, name in list(c10d._world.pg_names.items()):
            members[name] = list(c10d.get_process_group_ranks(pg))
            backends = {id(b): b for d in pg._device_types if (b := pg._get_backend(d))}
            for b in backends.values():
                suffix = "@nccl" if "NCCL" in type(b).__name__ else ""
                seqs[name + suffix] = int(b._get_sequence_number_for_group())
    except Exception:  # c10d's registry is private: a torch that moved it loses this only
        pass
    return members, seqs


def _trim(entry: dict[str, Any], cell: str) -> dict[str, Any]:
    out = {k: entry.get(k) for k in _FIELDS}
    frames = entry.get("frames")
    if frames:
        kept = []
        for frame in frames[:_MAX_FRAMES]:
            kept.append({k: frame.get(k) for k in ("name", "filename", "line")})
            if frame.get("filename") == cell:
                break
        out["frames"] = kept
    return out
