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
    watchdog's line a second into all_reduce #2 (cell line 12), which rank 1 never enters (it
    sleeps at line 14). `init`: the cell creates its process group (a session's exists)."""
    init_line = "dist.init_process_group()" if init else "pass  # the session's process group"
    return _STUCK.replace("INIT", init_line)


_STUCK = f"""import os, sys, threading, time, torch, torch.distributed as dist
INIT
dist.all_reduce(torch.ones(1))
def watchdog():
    time.sleep(1)
    print({WATCHDOG!r}, file=sys.stderr, flush=True)
    time.sleep(60)
    os.abort()
if dist.get_rank() == 0:
    threading.Thread(target=watchdog, daemon=True).start()
    dist.all_reduce(torch.ones(1))   # rank 1 never comes
else:
    time.sleep(600)
"""
