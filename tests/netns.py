"""A second, non-loopback address of this machine, and a hostname that resolves to it, so that a
socket on the wrong interface is seen as one (root only; as here and in CI).

This machine's hostname resolves to 127.0.0.1, so gloo without GLOO_SOCKET_IFNAME binds
loopback anyway (ProcessGroupGloo::createDefaultDevice binds whatever gethostname() resolves
to; torch/csrc/distributed/c10d/ProcessGroupGloo.cpp): a check that it does not could never
fail here. `second_address` gives the machine a veth whose peer lives in a network namespace
created here; `hostname_prefix` runs a command (a kernel: everything it starts inherits it) in
a UTS namespace whose hostname *is* that address. glibc's getaddrinfo parses a numeric name
itself, before /etc/hosts, nsswitch, nscd or resolved, so gloo's default device binds it.
Nothing is routed: only the namespace created here reaches the address. Both are removed on
exit, and a run killed before its cleanup is swept by the next one.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import socket
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import psutil
import pytest

from tests import workers

_PREFIX = "enb"  # then the creator's pid, so that a sweep can tell a live creator's
_NETNS = re.compile(rf"^{_PREFIX}-(\d+)-(\d+)$")
_LINK = re.compile(rf"^{_PREFIX}(\d+)[hp](\d+)$")
_counter = itertools.count()


@dataclass(frozen=True)
class SecondAddress:
    address: str  # this machine's, on `host_if`: not loopback
    netns: str  # holds the other end of the veth, with `peer_address`
    host_if: str
    peer_address: str


def usable() -> str | None:
    """Why these tests cannot run here (a reason to skip them), or None. Only not being root is
    one: as root (as here and in CI) a missing tool is a broken setup, and the tests fail on
    it, or a machine without iproute2 would pass the suite with its loopback checks unrun."""
    if os.geteuid() != 0:
        return "needs root (network and UTS namespaces)"
    missing = [t for t in ("ip", "unshare", "hostname") if shutil.which(t) is None]
    if missing:
        pytest.fail(
            f"running as root without {', '.join(missing)}: `make netns-tools` installs "
            "iproute2 (ip) and util-linux (unshare); hostname is Debian's hostname package"
        )
    return None


def _ip(*args: str) -> str:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


def _names(pid: int, n: int) -> tuple[str, str, str]:
    # An interface name has at most 15 characters.
    return f"{_PREFIX}-{pid}-{n}", f"{_PREFIX}{pid}h{n}", f"{_PREFIX}{pid}p{n}"


@contextlib.contextmanager
def second_address(
    address: str | None = None, peer_address: str | None = None
) -> Iterator[SecondAddress]:
    """A veth with `address` here and `peer_address` in a new namespace (by default a /30 of
    this test worker's own: tests/workers.py)."""
    address = address or f"10.213.{workers.index()}.1"
    peer_address = peer_address or f"10.213.{workers.index()}.2"
    ours = {a.address for addrs in psutil.net_if_addrs().values() for a in addrs}
    if address in ours:
        raise RuntimeError(f"{address} is already an address of this machine")
    sweep()
    netns, host_if, peer_if = _names(os.getpid(), next(_counter))
    try:
        _ip("netns", "add", netns)
        _ip("link", "add", host_if, "type", "veth", "peer", "name", peer_if, "netns", netns)
        _ip("addr", "add", f"{address}/30", "dev", host_if)
        _ip("link", "set", host_if, "up")  # the address of a link that is down cannot be bound
        _ip("-n", netns, "addr", "add", f"{peer_address}/30", "dev", peer_if)
        _ip("-n", netns, "link", "set", peer_if, "up")
        yield SecondAddress(address, netns, host_if, peer_address)
    finally:
        _remove(netns, host_if)


def _remove(netns: str, host_if: str) -> None:
    # Either end of a veth takes the other with it; each step tolerates the other's.
    subprocess.run(["ip", "link", "del", host_if], capture_output=True)
    subprocess.run(["ip", "netns", "del", netns], capture_output=True)


def sweep() -> list[str]:
    """Remove the namespaces and links of runs whose process is gone (SIGKILL skips finally)."""
    names = {line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()}
    names |= {line.split()[1].split("@")[0].rstrip(":") for line in _ip("-o", "link").splitlines()}
    removed = []
    for name in sorted(names):
        m = _NETNS.match(name) or _LINK.match(name)
        if m and not psutil.pid_exists(int(m[1])):
            _remove(*_names(int(m[1]), int(m[2]))[:2])
            removed.append(name)
    return removed


def hostname_prefix(address: str) -> list[str]:
    """``prefix + cmd`` runs cmd with `address` as its hostname, in a UTS namespace of its own
    (it ends with its last process). exec: cmd keeps the pid its starter got."""
    return [
        "unshare",
        "--uts",
        "--",
        "/bin/sh",
        "-c",
        'hostname "$1" && shift && exec "$@"',
        "enb-hostname",
        address,
    ]


def reachable(netns: str, address: str, port: int) -> bool:
    """Whether a TCP connection from inside `netns` to address:port is accepted."""
    code = (
        "import socket, sys\n"
        f"try: socket.create_connection(({address!r}, {port}), timeout=2).close()\n"
        "except OSError: sys.exit(1)\n"
    )
    r = subprocess.run(
        ["ip", "netns", "exec", netns, sys.executable, "-c", code], capture_output=True
    )
    return r.returncode == 0


def resolves_to(address: str) -> bool:
    """What gloo's default device would bind, seen from this process: its hostname's address."""
    return address in {a[4][0] for a in socket.getaddrinfo(socket.gethostname(), None)}
