"""What `%elastic join-command` and `%elastic nodes` print: the line that adds a machine to this
notebook's jobs, and the machines there are.

    %elastic join-command [--host H] [--port P] [--new-token]
    %elastic nodes
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from elastic_nb.kernel.client import SupervisorClient

__all__ = ["join_command", "nodes_table"]

JOIN_USAGE = "usage: %elastic join-command [--host HOST] [--port PORT] [--new-token]"


def join_command(client: SupervisorClient, rest: str) -> str:
    """Open this notebook's supervisor to join agents (on the first call) and return the line
    to run on another machine; raises ValueError with the usage on bad flags."""
    parser = argparse.ArgumentParser(prog="%elastic join-command", add_help=False)
    parser.add_argument("--host")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--new-token", action="store_true")
    try:
        args = parser.parse_args(rest.split())
    except SystemExit:
        raise ValueError(JOIN_USAGE) from None
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port}: out of range")
    reply = client.join(args.host, args.port, args.new_token)
    command = str(reply["command"])
    if reply.get("dropped"):
        command += f"\n# the old token no longer works: {reply['dropped']} node(s) were dropped"
    return command


def nodes_table(nodes: dict[str, Any]) -> list[str]:
    """This machine and every join agent: host, address, GPUs, CPUs, versions, state, last heard."""
    rows = [_row(nodes["here"], "this machine (the notebook's)")]
    for a in nodes.get("agents", []):
        state = a["state"] if a["state"] == "ready" else f"{a['state']}: {a['why']}"
        if a.get("groups"):
            state += f", running {', '.join(a['groups'])}"
        heard = f"heard {a['last_heard_s']:.1f} s ago" if a["state"] == "ready" else ""
        rows.append(_row(a, state, heard))
    listening = nodes.get("listening")
    if listening is None:
        rows.append(
            "no other machine can join yet: %elastic join-command prints the line to run there"
        )
    else:
        rows.append(
            f"agents join on {listening['host']}:{listening['port']} with the token whose "
            f"fingerprint is {listening['token']} (%elastic join-command prints the token)"
        )
    for r in nodes.get("refused", []):
        who = f"{r.get('name') or ''} {r.get('addr') or ''}".strip()
        rows.append(f"refused {who}: {r['why']}" if who else r["why"])
    return rows


def _row(n: dict[str, Any], state: str, heard: str = "") -> str:
    gpus = f"{len(n['gpus'])} GPU" + ("s" if len(n["gpus"]) != 1 else "")
    if n["gpus"]:
        gpus += f" ({n['gpus'][0]})"
    versions = f"python {n['python']}, torch {n['torch'] or '-'}"
    if n.get("cuda"):
        versions += f", CUDA {n['cuda']}"
    since = ""
    if n.get("joined"):
        since = f", joined {time.strftime('%H:%M:%S', time.localtime(n['joined']))}"
    parts = [f"node {n['node']}: {n['name']} ({n['addr']})", gpus, f"{n['cpus']} CPUs", versions]
    parts.append(state + since + (f", {heard}" if heard else ""))
    return " · ".join(parts)
