"""Other machines on this one, for the multi-node tests (root only; as here and in CI).

Each "machine" is a join agent in namespaces of its own, so that it truly cannot see the
notebook's processes or files: a network namespace (its own interfaces, its own loopback) whose
veth joins a bridge this module puts on the host, and a PID, mount and UTS namespace
(``unshare --pid --mount --uts --fork --mount-proc``: its own /proc, a private /tmp that is its
HOME and work directory, a hostname of its own). The agent is the first process of its PID
namespace: SIGKILL to it ends everything in the namespace at once, a machine lost.

The notebook's machine is the host itself, reached on the bridge's address. Traffic goes only to
loopback and to the namespaces created here; everything is removed on exit, and what a run
killed before its cleanup left is swept by the next one.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import psutil

from tests import netns, workers

_PREFIX = "enm"  # then the creator's pid: a sweep tells a live creator's from a dead one's
_NAME = re.compile(rf"^{_PREFIX}(\d+)[bmhp](\d*)")
_subnets = itertools.count()
_LABS_PER_WORKER = 250 // workers.MAX


def _ip(*args: str) -> str:
    r = subprocess.run(["ip", *args], capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {r.stderr.strip()}")
    return r.stdout


@dataclass
class Machine:
    """One machine: its network namespace, address, hostname, and the agent that runs there."""

    n: int
    netns: str
    address: str
    hostname: str
    log: Path
    agent: subprocess.Popen[bytes] | None = None
    _log_file: object = field(default=None, repr=False)

    def join(
        self,
        line: str,
        *extra: str,
        env: dict[str, str] | None = None,
        python_code: str | None = None,
    ) -> None:
        """Start the join agent with the line %elastic join-command printed (the python of this
        suite stands in for the one a machine would have; `python_code` instead of `-m
        elastic_nb`: a machine that differs, patched before the agent starts)."""
        words = line.split()
        assert words[:2] == ["elastic-nb", "join"], line
        start = ["-c", python_code] if python_code else ["-m", "elastic_nb"]
        agent = [sys.executable, *start, *words[1:], "--workdir", "/tmp/agent", *extra]
        script = (
            'mount -t tmpfs tmpfs /tmp && mkdir -p /tmp/home && hostname "$1" && shift && '
            'HOME=/tmp/home XDG_CACHE_HOME=/tmp/home/.cache exec "$@"'
        )
        command = [
            "ip", "netns", "exec", self.netns,
            "unshare", "--pid", "--mount", "--uts", "--fork", "--mount-proc", "--",
            "/bin/sh", "-c", script, "enb-machine", self.hostname, *agent,
        ]  # fmt: skip
        self._log_file = open(self.log, "ab")  # noqa: SIM115 - closed in stop()
        self.agent = subprocess.Popen(
            command,
            stdout=self._log_file,  # type: ignore[arg-type]
            stderr=subprocess.STDOUT,
            env={**os.environ, **(env or {})},
            start_new_session=True,
        )

    @property
    def agent_pid(self) -> int | None:
        """The agent's pid as the host sees it (the namespace's first process)."""
        if self.agent is None:
            return None
        with contextlib.suppress(psutil.Error):
            # unshare --fork: its child is the namespace's init (the shell, exec'd into python).
            children = psutil.Process(self.agent.pid).children()
            if children:
                return children[0].pid
        return None

    def commands(self) -> list[str]:
        """The command line of every process still running in the machine (one that ended
        meanwhile, a zombie included, is not)."""
        found = []
        for p in self.processes():
            with contextlib.suppress(psutil.Error):
                found.append(" ".join(p.cmdline()))
        return found

    def processes(self) -> list[psutil.Process]:
        """Every process in the machine's PID namespace."""
        init = self.agent_pid
        if init is None:
            return []
        try:
            ns = os.stat(f"/proc/{init}/ns/pid").st_ino
        except OSError:
            return []
        found = []
        for p in psutil.process_iter():
            with contextlib.suppress(OSError, psutil.Error):
                if os.stat(f"/proc/{p.pid}/ns/pid").st_ino == ns:
                    found.append(p)
        return found

    def kill(self) -> None:
        """The machine is lost: SIGKILL to the namespace's init ends everything in it."""
        init = self.agent_pid
        if init is not None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(init, signal.SIGKILL)

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def stop(self, timeout: float = 15) -> None:
        """SIGTERM to the agent (it ends its groups' processes and leaves), SIGKILL if it must."""
        if self.agent is not None and self.agent.poll() is None:
            init = self.agent_pid
            if init is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(init, signal.SIGTERM)
            try:
                self.agent.wait(timeout)
            except subprocess.TimeoutExpired:
                self.kill()
                self.agent.wait(10)
        if self._log_file is not None:
            self._log_file.close()  # type: ignore[attr-defined]
            self._log_file = None


@dataclass
class Lab:
    """A bridge on the host (the notebook's machine's address) and machines behind it."""

    bridge: str
    host_address: str
    subnet: int
    workdir: Path
    machines: list[Machine] = field(default_factory=list)

    def machine(self) -> Machine:
        n = len(self.machines) + 1
        ns = f"{_PREFIX}{os.getpid()}m{self.subnet}x{n}"
        # An interface name has at most 15 characters.
        host_if, peer_if = f"{_PREFIX}{os.getpid()}h{n}", f"{_PREFIX}{os.getpid()}p{n}"
        address = f"10.78.{self.subnet}.{n + 1}"
        _ip("netns", "add", ns)
        _ip("link", "add", host_if, "type", "veth", "peer", "name", peer_if, "netns", ns)
        _ip("link", "set", host_if, "master", self.bridge)
        _ip("link", "set", host_if, "up")
        _ip("-n", ns, "addr", "add", f"{address}/24", "dev", peer_if)
        _ip("-n", ns, "link", "set", peer_if, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        m = Machine(n, ns, address, f"node-{n}", self.workdir / f"machine-{n}.log")
        self.machines.append(m)
        return m


def usable() -> str | None:
    """Why the multi-node tests cannot run here, or None."""
    why = netns.usable()
    if why is None and subprocess.run(["unshare", "--help"], capture_output=True).returncode:
        why = "unshare cannot run"
    return why


@contextlib.contextmanager
def lab(workdir: Path) -> Iterator[Lab]:
    sweep()
    # A /24 of this test worker's own (tests/workers.py), a new one for each lab of its run.
    subnet = 1 + workers.index() * _LABS_PER_WORKER + next(_subnets) % _LABS_PER_WORKER
    bridge = f"{_PREFIX}{os.getpid()}b{subnet}"[:15]
    host_address = f"10.78.{subnet}.1"
    _ip("link", "add", bridge, "type", "bridge")
    _ip("addr", "add", f"{host_address}/24", "dev", bridge)
    _ip("link", "set", bridge, "up")
    the_lab = Lab(bridge, host_address, subnet, workdir)
    try:
        yield the_lab
    finally:
        for m in the_lab.machines:
            m.stop()
        for m in the_lab.machines:
            subprocess.run(["ip", "netns", "del", m.netns], capture_output=True)
        subprocess.run(["ip", "link", "del", bridge], capture_output=True)


def sweep() -> list[str]:
    """Remove the namespaces and links of runs whose process is gone."""
    names = {line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()}
    names |= {line.split()[1].split("@")[0].rstrip(":") for line in _ip("-o", "link").splitlines()}
    removed = []
    for name in sorted(names):
        m = _NAME.match(name)
        if m and not psutil.pid_exists(int(m[1])):
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
            subprocess.run(["ip", "link", "del", name], capture_output=True)
            removed.append(name)
    return removed


def wait_joined(
    kernel_nodes: object, count: int, timeout: float = 60, exactly: bool = False
) -> None:
    """Poll until `count` agents (`exactly`: no more) are ready (`kernel_nodes()` returns
    %elastic nodes' text)."""
    deadline = time.monotonic() + timeout
    text = ""
    while time.monotonic() < deadline:
        text = kernel_nodes()  # type: ignore[operator]
        ready = text.count("· ready")
        if ready == count or (ready > count and not exactly):
            return
        time.sleep(0.2)
    raise AssertionError(f"{count} nodes did not join within {timeout} s:\n{text}")
