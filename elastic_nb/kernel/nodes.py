"""What `%elastic join-command` and `%elastic nodes` print: the line that adds a machine to this
notebook's jobs, and the machines there are.

    %elastic join-command [--host H] [--port P] [--new-token] [--token-file PATH]
    %elastic nodes

The line carries the join token, and a notebook's outputs are saved with it: the output says so
(clear it before sharing the notebook; `--new-token` revokes it), and `--token-file PATH` keeps
the token out of the output altogether (a file of the user's alone, which a cluster's shared
home directory brings to the other machines: the line reads it from there).
"""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

from elastic_nb import protocol
from elastic_nb.kernel.client import SupervisorClient

__all__ = ["join_command", "nodes_table", "write_token"]

JOIN_USAGE = (
    "usage: %elastic join-command [--host HOST] [--port PORT] [--new-token] [--token-file PATH]"
)
SAVED_NOTE = (
    "# the token above is saved with this notebook's outputs: clear this output before sharing "
    "the notebook (or revoke it: %elastic join-command --new-token); --token-file PATH keeps it "
    "out of the output"
)


def join_command(client: SupervisorClient, rest: str) -> str:
    """Open this notebook's supervisor to join agents (on the first call) and return the line
    to run on another machine; raises ValueError with the usage on bad flags."""
    parser = argparse.ArgumentParser(prog="%elastic join-command", add_help=False)
    parser.add_argument("--host")
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--new-token", action="store_true")
    parser.add_argument("--token-file", type=Path)
    try:
        args = parser.parse_args(rest.split())
    except SystemExit:
        raise ValueError(JOIN_USAGE) from None
    if not 0 <= args.port <= 65535:
        raise ValueError(f"--port {args.port}: out of range")
    reply = client.join(args.host, args.port, args.new_token)
    line, token = str(reply["command"]).split(" --token ")
    if args.token_file is None:
        command = f"{line} --token {token}\n{SAVED_NOTE}"
    else:
        path = args.token_file.expanduser().absolute()
        write_token(path, token)
        command = f"{line} --token-file {path}"
    if reply.get("dropped"):
        command += f"\n# the old token no longer works: {reply['dropped']} node(s) were dropped"
    return command


def write_token(path: Path, token: str) -> None:
    """The token into `path`, readable by its owner alone (made so before the token is in it)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    os.replace(tmp, path)


def nodes_table(nodes: protocol.kernel.MachineList) -> list[str]:
    """This machine and every join agent: host, address, GPUs, CPUs, versions, state, last heard."""
    rows = [_row(nodes["here"], "this machine (the notebook's)")]
    for a in nodes.get("agents", []):
        state = a["state"] if a["state"] == "ready" else f"{a['state']}: {a['why']}"
        if a.get("groups"):
            state += f", running {', '.join(a['groups'])}"
        heard = f"heard {a['last_heard_s']:.1f} s ago" if a["state"] == "ready" else ""
        rows.append(_row(a, state, heard, a["joined"]))
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


def _row(
    n: protocol.kernel.Machine, state: str, heard: str = "", joined: float | None = None
) -> str:
    gpus = f"{len(n['gpus'])} GPU" + ("s" if len(n["gpus"]) != 1 else "")
    if n["gpus"]:
        gpus += f" ({n['gpus'][0]})"
    versions = f"python {n['python']}, torch {n['torch'] or '-'}"
    if n.get("cuda"):
        versions += f", CUDA {n['cuda']}"
    since = ""
    if joined:
        since = f", joined {time.strftime('%H:%M:%S', time.localtime(joined))}"
    parts = [f"node {n['node']}: {n['name']} ({n['addr']})", gpus, f"{n['cpus']} CPUs", versions]
    parts.append(state + since + (f", {heard}" if heard else ""))
    return " · ".join(parts)
