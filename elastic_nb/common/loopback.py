"""Keep every listening socket of a job on loopback.

A `TCPStore` server listens on every interface (``::``, dual stack) whatever host it is given,
and has no authentication; torch's dynamic rendezvous keeps its state in one and reads it back
with ``pickle.loads``. Two such servers live while a job runs: the launcher's rendezvous store
and, with ``TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1``, rank 0's process-group store. Every job is
single-node (the spec refuses more), so nothing outside this machine needs to reach either.

Both serve on a socket bound here to 127.0.0.1 and handed over with
``TCPStore(..., master_listen_fd=FD)``. torch builds both stores itself, with
``multi_tenant=True``, and a multi-tenant TCPStore serves from the server that another TCPStore
of the same process already runs on its port (torch's documented multi-tenancy; the server is
shared by reference and ends with the last store that uses it). So the server is started here
first, on our socket, and torch's own constructor finds it: no torch argument is restated.

- The launcher (`rendezvous_server`) holds its server for its life, which is the job's; the
  endpoint torch is given becomes ``127.0.0.1:PORT``, the port our socket got for ``:0``.
- Rank 0 (`patch_process_group_store`) holds its server only while torch builds the process
  group's store: from then on torch's store alone keeps it, and it ends with that store
  (``destroy_process_group``) as torch's own would.

gloo and NCCL open listening sockets of their own, on the interface they pick (gloo: whatever
this machine's hostname resolves to; NCCL: the first non-loopback interface); `interface_env`
names the loopback interface for both.

A multi-node job cannot keep to loopback: its ranks meet across machines. There each node's
ranks use the interface of the node's address (the one the notebook's machine and the other
nodes reach it at), and rank 0's process-group store listens on that address alone rather than
on every interface (`NODE_ADDR_ENV`). The rendezvous store still lives on the notebook's
loopback: other machines reach it only through their join agent's authenticated channel.
"""

from __future__ import annotations

import functools
import importlib
import ipaddress
import os
import socket
from typing import Any

__all__ = [
    "HOST",
    "NODE_ADDR_ENV",
    "interface_env",
    "patch_process_group_store",
    "rendezvous_server",
]

HOST = "127.0.0.1"
NODE_ADDR_ENV = "ELASTIC_NB_NODE_ADDR"  # a multi-node job's rank: its node's address


def rendezvous_server(port: int) -> Any:
    """The launcher's rendezvous store server, on 127.0.0.1:`port` (0: a free port). Keep it
    referenced for the job's life and give torch ``127.0.0.1:<its .port>`` as the endpoint:
    the c10d and static backends create their store there with multi_tenant=True."""
    return _serve(HOST, port)


def patch_process_group_store() -> None:
    """In a rank: rank 0's process-group store (``init_process_group`` with env://, or a
    tcp:// on a loopback address) serves on loopback.

    torch's env:// and tcp:// handlers call ``torch.distributed.rendezvous._create_c10d_store``
    by its module-global name; the wrapper starts the loopback server on the port rank 0 is
    about to host, then lets torch build its store exactly as it would have.
    """
    # importlib: ``torch.distributed.rendezvous`` as an attribute is the function of that name.
    rendezvous: Any = importlib.import_module("torch.distributed.rendezvous")
    original = rendezvous._create_c10d_store
    if getattr(original, "_elastic_nb_loopback", False):
        return

    @functools.wraps(original)
    def _create_c10d_store(hostname: str, port: int, rank: int, *args: Any, **kwargs: Any) -> Any:
        host = _own_ipv4(hostname)
        # The agent's store (TORCHELASTIC_USE_AGENT_STORE) makes every rank a client; a host
        # that is not loopback is the cell's own choice.
        if rank != 0 or host is None or os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            return original(hostname, port, rank, *args, **kwargs)
        try:
            server = _serve(host, port)
        except OSError:
            # The port is taken: by a store this process still holds (torch then shares its
            # server) or by someone else (torch then says so, in its own words).
            return original(hostname, port, rank, *args, **kwargs)
        try:
            return original(hostname, port, rank, *args, **kwargs)
        finally:
            del server  # torch's store holds the server from here on

    setattr(_create_c10d_store, "_elastic_nb_loopback", True)  # noqa: B010 - a mark torch never reads
    rendezvous._create_c10d_store = _create_c10d_store


def interface_env(ifname: str | None = None) -> dict[str, str]:
    """gloo's and NCCL's socket interface: loopback (their bootstrap and, for NCCL, its proxy
    and socket transport listen there), or `ifname` across machines. NCCL's data moves over
    NVLink, PCIe or shared memory within a node; its sockets only carry the bootstrap."""
    name = ifname or _loopback_interface()
    return {"GLOO_SOCKET_IFNAME": name, "NCCL_SOCKET_IFNAME": f"={name}"}  # '=': exactly


def _serve(host: str, port: int) -> Any:
    from torch.distributed import TCPStore

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        # As torch's own listener: a previous attempt's TIME_WAIT leftovers do not block the port.
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(socket.SOMAXCONN)
        store = TCPStore(
            host,
            sock.getsockname()[1],
            is_master=True,
            multi_tenant=True,
            wait_for_workers=False,
            master_listen_fd=sock.fileno(),
        )
    except BaseException:
        sock.close()
        raise
    sock.detach()  # the store's server owns the descriptor now, and closes it when it ends
    return store


def _own_ipv4(hostname: str) -> str | None:
    """The address to serve a store on: a loopback one, or this node's in a multi-node job."""
    if hostname == "localhost":
        return HOST
    if hostname and hostname == os.environ.get(NODE_ADDR_ENV):
        return hostname
    try:
        addr = ipaddress.ip_address(hostname)
    except ValueError:
        return None
    return str(addr) if addr.version == 4 and addr.is_loopback else None


def _loopback_interface() -> str:
    """The interface that holds 127.0.0.1 (``lo`` on Linux)."""
    import psutil

    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == HOST for a in addrs):
            return str(name)
    return "lo"
