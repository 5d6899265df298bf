"""A multi-node group's rendezvous store, on the notebook's machine: a fork of the zygote (torch
imported) in the store role, which serves torch's `TCPStore` on 127.0.0.1 (loopback.py) for the
group's life and says on which port.

Every round's launchers, here and on joined nodes, are its clients: torch's c10d rendezvous
keeps its state there. No launcher hosts it (a launcher lives for one round; the store lives
with the group), and no other machine reaches it but through its join agent's authenticated
channel, which the supervisor connects to this port.
"""

from __future__ import annotations

import os
import sys

from elastic_nb import protocol
from elastic_nb.common import loopback, modules
from elastic_nb.launcher.pipe import Channel
from elastic_nb.launcher.torch_agent import die_with_parent

__all__ = ["main"]


def main() -> None:
    channel = Channel(os.dup(1))
    os.dup2(2, 1)
    die_with_parent()
    server = loopback.rendezvous_server(int(os.environ.get(modules.STORE_PORT_ENV) or 0))
    channel.send(protocol.launcher.StoreUp(kind=protocol.launcher.STORE, port=server.port))
    sys.stdin.read()  # until the supervisor lets go (EOF): the group has ended
