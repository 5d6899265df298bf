"""A join agent's store relay admits its group's launcher alone (supervisor/processes/peers.py,
connected_from): torch's agent unpickles the rendezvous store's state, so another local process
must not reach the notebook's store through the relay. Real processes, real TCPStore clients
(whose sockets are IPv6, their ends IPv4-mapped); the relay's whole path is
tests/test_multinode.py's."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator

import pytest

from elastic_nb.supervisor.processes.peers import connected_from

pytestmark = pytest.mark.unit

CLIENT = """
import datetime, sys, torch.distributed as dist
try:
    dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False,
                  timeout=datetime.timedelta(seconds=30))
except Exception:
    pass
"""


@pytest.fixture
def accepted() -> Iterator[tuple[socket.socket, subprocess.Popen[bytes]]]:
    """A connection accepted on loopback from a process that opened a torch store client."""
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = subprocess.Popen([sys.executable, "-c", CLIENT, str(listener.getsockname()[1])])
        try:
            conn, _ = listener.accept()
            with conn:
                yield conn, client
        finally:
            client.kill()
            client.wait()


def test_the_process_that_connected_is_recognised(
    accepted: tuple[socket.socket, subprocess.Popen[bytes]],
) -> None:
    conn, client = accepted
    assert connected_from(client.pid, conn)


def test_any_other_process_is_not(accepted: tuple[socket.socket, subprocess.Popen[bytes]]) -> None:
    conn, client = accepted
    assert not connected_from(os.getpid(), conn)  # the accepting side's own pid
    assert not connected_from(client.pid + 100_000, conn)
    assert not connected_from(None, conn)  # no launcher (yet): nobody
