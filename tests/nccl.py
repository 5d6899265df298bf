"""NCCL's watchdog, as the CPU suite stands in for it: the line ProcessGroupNCCL.cpp logs when a
collective times out (Watchdog::runLoop), and a cell whose rank 0 prints it while it waits in an
all_reduce that rank 1 never joins. Under --async-error-handling 1 NCCL would then wait a minute
for the flight recorder's dump and abort (the cell's thread does, after 60 s). The real thing is
in the tests marked `cuda`."""

from __future__ import annotations


def watchdog_line(rank: int = 0, seq: int = 2, timeout_ms: int = 1000, ran_ms: int = 1003) -> str:
    return (
        f"[rank{rank}]:[E1123 10:00:05.123456789 ProcessGroupNCCL.cpp:632] [Rank {rank}] "
        f"Watchdog caught collective operation timeout: WorkNCCL(SeqNum={seq}, OpType=ALLREDUCE, "
        f"NumelIn=1, NumelOut=1, Timeout(ms)={timeout_ms}) ran for {ran_ms} milliseconds before "
        "timing out."
    )


WATCHDOG = watchdog_line()


def stuck_with_a_watchdog(init: bool = True) -> str:
    """The body of a cell (after its %%elastic line; its lines 2 to 14): rank 0 prints the
    watchdog's line once all_reduce #2 (cell line 12), which rank 1 never enters (it sleeps at
    line 14), is in rank 0's flight recorder, where the supervisor looks (not a second after
    the thread starts, which assumed the main thread was in it by then). `init`: the cell
    creates its process group (a session's exists)."""
    init_line = "dist.init_process_group()" if init else "pass  # the session's process group"
    return _STUCK.replace("INIT", init_line)


# Cell line 6: until the flight recorder holds an entry past the collectives the group had issued
# when the thread was started (line 11, after all_reduce #1): all_reduce #2's, recorded as it is
# issued. A cell whose rank 0 enters no collective #2 replaces it.
IN_ALL_REDUCE_2 = (
    "    while not [e for e in json.loads(torch._C._distributed_c10d._dump_fr_trace_json(True, "
    "False)).get('entries', ()) if e['collective_seq_id'] > issued]: time.sleep(0.01)\n"
)
_STUCK = f"""import json, os, sys, threading, time, torch, torch.distributed as dist
INIT
dist.all_reduce(torch.ones(1))
def watchdog(issued):
{IN_ALL_REDUCE_2}    print({WATCHDOG!r}, file=sys.stderr, flush=True)
    time.sleep(60)
    os.abort()
if dist.get_rank() == 0:
    threading.Thread(target=watchdog, args=(dist.group.WORLD._get_backend(torch.device('cpu'))._get_sequence_number_for_group(),), daemon=True).start()
    dist.all_reduce(torch.ones(1))   # rank 1 never comes
else:
    time.sleep(600)
"""
