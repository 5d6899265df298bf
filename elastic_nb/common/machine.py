"""This machine as a node: what `%elastic nodes` lists for it (host, CPUs, GPUs, versions) and
the versions a join agent must share with the notebook's side.

Nothing here imports torch or initialises CUDA: torch's version comes from its installed
metadata and its CUDA version from ``torch/version.py`` read as text; GPUs from NVML.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import ipaddress
import os
import platform
import re
import socket
from pathlib import Path

import psutil

from elastic_nb import protocol
from elastic_nb.common import nvml

__all__ = ["describe", "interface_holding", "interface_of", "mismatch", "primary_address"]


def describe(addr: str, workdir: str) -> protocol.records.NodeInfo:
    """This machine, reached by others at `addr`, keeping its run directories in `workdir`."""
    from elastic_nb import __version__

    torch, cuda = _torch_versions()
    return protocol.records.NodeInfo(
        name=socket.gethostname(),
        addr=addr,
        pid=os.getpid(),
        cpus=len(os.sched_getaffinity(0)),
        gpus=nvml.names(),
        python=platform.python_version(),
        torch=torch,
        cuda=cuda,
        elastic_nb=__version__,
        workdir=workdir,
    )


def mismatch(ours: protocol.records.NodeInfo, theirs: protocol.records.NodeInfo) -> str | None:
    """Why a node cannot run the notebook's cells (None: it can): Python's minor version,
    torch's major.minor or elastic_nb's version differ. Pickled cells and objects, torch's
    rendezvous state and our protocol all assume them equal."""

    def minor(v: str | None) -> str | None:
        return ".".join(v.split("+")[0].split(".")[:2]) if v else None

    wrong = []
    if minor(ours["python"]) != minor(theirs["python"]):
        wrong.append(f"Python {theirs['python']} (the notebook's is {ours['python']})")
    if minor(ours["torch"]) != minor(theirs["torch"]):
        wrong.append(f"torch {theirs['torch']} (the notebook's is {ours['torch']})")
    if ours["elastic_nb"] != theirs["elastic_nb"]:
        wrong.append(f"elastic_nb {theirs['elastic_nb']} (the notebook's is {ours['elastic_nb']})")
    if not wrong:
        return None
    return f"{theirs['name']} runs " + ", ".join(wrong) + ": install the notebook's versions there"


def primary_address() -> str:
    """The address other machines most likely reach this one at: the source address of the
    default route (a UDP socket's connect sends nothing), else the first address of an
    interface that is up and not loopback, else loopback."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: routed like any remote address
            addr = str(s.getsockname()[0])
            if not ipaddress.ip_address(addr).is_loopback:
                return addr
        except OSError:
            pass
    stats = psutil.net_if_stats()
    for name, addrs in psutil.net_if_addrs().items():
        if not stats.get(name) or not stats[name].isup:
            continue
        for a in addrs:
            if a.family == socket.AF_INET and not ipaddress.ip_address(a.address).is_loopback:
                return str(a.address)
    return "127.0.0.1"


def interface_of(addr: str) -> str | None:
    """The network interface that holds `addr` (gloo and NCCL are told to use it)."""
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == addr for a in addrs):
            return str(name)
    return None


def interface_holding(addr: str) -> str:
    """`interface_of`, or why this machine cannot be reached at `addr` (its ranks would listen
    where no other node reaches them)."""
    name = interface_of(addr)
    if name is None:
        raise ValueError(f"no network interface of this machine has the address {addr}")
    return name


def _torch_versions() -> tuple[str | None, str | None]:
    try:
        torch = importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        return None, None
    cuda = None
    spec = importlib.util.find_spec("torch")
    if spec is not None and spec.submodule_search_locations:
        for location in spec.submodule_search_locations:
            version_py = Path(location) / "version.py"
            if version_py.exists():
                found = re.search(
                    r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", version_py.read_text(), re.M
                )
                cuda = found.group(1) if found else None
                break
    return torch, cuda
