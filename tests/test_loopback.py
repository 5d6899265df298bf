"""While a job runs, nothing of it listens beyond loopback: the launcher's rendezvous store,
rank 0's process-group store, gloo's own listeners. Real kernel, real supervisor, real gloo
ranks, listed while they are in the cell, after init_process_group."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import psutil
import pytest

from elastic_nb.common import procs
from tests import netns
from tests.kernel import Kernel, free_port, wait_for

pytestmark = pytest.mark.e2e

# Each rank says it is in the cell (pid, job marker, MASTER_PORT) once every rank has its
# process group, and stays there until the test has looked.
IN_CELL = """
import os, time, torch.distributed as dist
if not dist.is_initialized():
    dist.init_process_group()
dist.barrier()
here = {dir!r}
rank = dist.get_rank()
with open(os.path.join(here, f".rank-{{rank}}"), "w") as f:
    f.write(f"{{os.getpid()}} {{os.environ['ELASTIC_NB_JOB']}} {{os.environ['MASTER_PORT']}}")
os.replace(os.path.join(here, f".rank-{{rank}}"), os.path.join(here, f"rank-{{rank}}"))
while not os.path.exists(os.path.join(here, "go")):
    time.sleep(0.05)
dist.barrier()
"""


def listening(pids: set[int]) -> list[tuple[int, str, str, int]]:
    """(pid, command, address, port) of every socket of these processes that accepts from
    anyone who can reach its address: TCP listeners, and UDP sockets bound but not connected."""
    out = []
    for pid in sorted(pids):
        with contextlib.suppress(psutil.Error):
            p = psutil.Process(pid)
            cmd = " ".join(p.cmdline())[:100]
            for c in p.net_connections(kind="inet"):
                udp = c.type == socket.SOCK_DGRAM and not c.raddr
                if c.status == psutil.CONN_LISTEN or udp:
                    out.append((pid, cmd, c.laddr.ip, c.laddr.port))
    return out


def exposed(sockets: list[tuple[int, str, str, int]]) -> list[str]:
    return [
        f"pid {pid} ({cmd}) listens on {ip}:{port}"
        for pid, cmd, ip, port in sockets
        if not _loopback(ip)
    ]


def _loopback(ip: str) -> bool:
    addr = ipaddress.ip_address(ip.split("%")[0])
    mapped = getattr(addr, "ipv4_mapped", None)
    return (mapped or addr).is_loopback


def in_the_cell(
    k: Kernel, cell: str, here: Path, reached: Callable[[tuple], bool] | None = None
) -> tuple[dict[int, tuple[int, int]], int, list]:
    """Run `cell` (IN_CELL on two ranks) and, while both ranks wait in it, list the listening
    sockets of every process carrying the job's marker and of the kernel's whole tree (the
    supervisor, warm launchers and their fork servers too). Returns each rank's (pid,
    MASTER_PORT), the launcher's pid, and those sockets; with `reached`, the sockets are
    (pid, command, address, port, what `reached` said of them while they were still open)."""
    msg_id, ex = k.start(cell)
    files = [here / f"rank-{r}" for r in (0, 1)]
    try:
        arrived = wait_for(lambda: all(f.exists() for f in files), timeout=90)
        if arrived:
            ranks = {}
            for r, f in enumerate(files):
                pid, job, master_port = f.read_text().split()
                ranks[r] = (int(pid), int(master_port))
            marked = {p.pid for p in procs.job_processes([job])}
            tree = {p.pid for p in psutil.Process(k.pid).children(recursive=True)}
            sockets = listening(marked | tree)
            if reached is not None:
                sockets = [(*s, reached(s)) for s in sockets]
            launchers = [p for p in marked if _leads_its_group(p)]  # the job's group leader
    finally:
        (here / "go").touch()
    ex = k.collect(msg_id, ex)
    assert arrived and ex.error is None, f"{ex.ename}\n{ex.traceback}\n{ex.stdout}{ex.stderr}"
    assert {pid for pid, _ in ranks.values()} <= marked, (ranks, marked)
    assert len(launchers) == 1, [_cmd(p) for p in marked]
    return ranks, launchers[0], sockets


def _leads_its_group(pid: int) -> bool:
    try:
        return os.getpgid(pid) == pid
    except OSError:
        return False


def _cmd(pid: int) -> str:
    try:
        return " ".join(psutil.Process(pid).cmdline())
    except psutil.Error:
        return ""


def assert_only_loopback(
    ranks: dict[int, tuple[int, int]], launcher: int, sockets: list, rank0_hosts: bool = True
) -> None:
    assert not exposed(sockets), "\n".join(exposed(sockets))
    # Not vacuous: the stores this is about were there to be seen.
    assert any(pid == launcher for pid, *_ in sockets), f"no rendezvous store in {sockets}"
    pid0, master_port = ranks[0]
    if rank0_hosts:
        assert (pid0, master_port) in {(pid, port) for pid, _, _, port in sockets}, (
            f"rank 0 ({pid0}) does not host its process-group store on {master_port}: {sockets}"
        )


@pytest.mark.parametrize(
    "flags",
    ["", "--start-method spawn", "--rdzv-backend static --rdzv-endpoint localhost:{port}"],
    ids=["forkserver", "spawn", "static"],
)
def test_a_job_listens_on_loopback_only(kernel: Kernel, tmp_path: Path, flags: str) -> None:
    flags = flags.format(port=free_port())
    cell = f"%%elastic --nproc 2 {flags}\n" + IN_CELL.format(dir=str(tmp_path))
    ranks, launcher, sockets = in_the_cell(kernel, cell, tmp_path)
    # With the static backend every rank uses the agent's store: rank 0 hosts none.
    assert_only_loopback(ranks, launcher, sockets, rank0_hosts="static" not in flags)


def test_gloo_and_nccl_are_named_loopback_over_the_kernels_environment(kernel: Kernel) -> None:
    """docs/explanation/security.md's words: the ranks get GLOO_SOCKET_IFNAME=lo and NCCL_SOCKET_IFNAME==lo (this
    machine's loopback interface, exactly: NCCL reads a leading '^' as "not these" and '=' as
    "exactly this one"), over a kernel environment set up for a cluster
    (GLOO_SOCKET_IFNAME=eth0); --env, the job's own setting, still wins. (What gloo then binds
    is checked below, where the hostname resolves elsewhere.)"""
    lo = next(
        name
        for name, addrs in psutil.net_if_addrs().items()
        if any(a.family == socket.AF_INET and a.address == "127.0.0.1" for a in addrs)
    )
    kernel.ok("import os\nos.environ['GLOO_SOCKET_IFNAME'] = 'eth0'")
    try:
        show = (
            "import os\nprint(os.environ['GLOO_SOCKET_IFNAME'], os.environ['NCCL_SOCKET_IFNAME'])\n"
        )
        ex = kernel.ok("%%elastic --nproc 1\n" + show)
        assert f"[rank 0] {lo} ={lo}\n" in ex.stdout
        ex = kernel.ok("%%elastic --nproc 1 --env NCCL_SOCKET_IFNAME=mine\n" + show)
        assert f"[rank 0] {lo} mine\n" in ex.stdout
    finally:
        kernel.ok("os.environ.pop('GLOO_SOCKET_IFNAME', None)")


def test_a_session_listens_on_loopback_only(fresh_kernel: Kernel, tmp_path: Path) -> None:
    k = fresh_kernel
    assert "2 ranks up" in k.ok("%elastic up --nproc 2").stdout
    k.ok("%%elastic\nimport torch.distributed as dist\ndist.init_process_group()\n")
    ranks, launcher, sockets = in_the_cell(
        k, "%%elastic\n" + IN_CELL.format(dir=str(tmp_path)), tmp_path
    )
    assert_only_loopback(ranks, launcher, sockets)
    k.ok("%elastic down")


def test_listening_is_read_where_it_would_fail() -> None:
    """The check itself sees a socket on every interface, and one on loopback as fine."""
    with socket.socket(socket.AF_INET6) as wide, socket.socket() as narrow:
        wide.bind(("::", 0))
        wide.listen()
        narrow.bind(("127.0.0.1", 0))
        narrow.listen()
        sockets = listening({os.getpid()})
        ports = {port: ip for _, _, ip, port in sockets}
        assert (
            ports[wide.getsockname()[1]] == "::" and ports[narrow.getsockname()[1]] == "127.0.0.1"
        )
        assert exposed(sockets) and all("::" in line for line in exposed(sockets))


def test_the_master_port_stays_reserved_until_rank_0_serves_it(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch picks rank 0's store port by binding port 0 and closing it; until rank 0 listens,
    any process could take it (CI saw rank 0 fail with EADDRINUSE so). The launcher's pick stays
    bound: no other socket gets it, on any address, and rank 0's listener still binds it."""
    import torch.distributed.elastic.rendezvous.api as api

    from elastic_nb.common import loopback
    from elastic_nb.launcher import rendezvous

    monkeypatch.setattr(api, "get_free_port", api.get_free_port)  # restored after the test
    rendezvous.reserve_master_port()
    port = api.get_free_port()
    for host in ("127.0.0.1", "0.0.0.0"):
        with socket.socket() as other, pytest.raises(OSError, match="in use"):
            other.bind((host, port))
    # The next attempt's pick lets the previous one go (checked on a port no connection used:
    # a closed store's connections may leave it in TIME_WAIT, which a plain bind refuses too).
    again = api.get_free_port()
    assert again != port
    with socket.socket() as other:
        other.bind(("0.0.0.0", port))
    store = loopback._serve("127.0.0.1", again)  # rank 0's listener (SO_REUSEADDR)
    assert store.port == again
    store.set("k", "v")
    assert store.get("k") == b"v"


# Here the hostname resolves to 127.0.0.1, so gloo on its default device (no
# GLOO_SOCKET_IFNAME) listens on loopback anyway and the tests above could not fail for it.
# These run the same jobs from a kernel whose hostname resolves to a second address of this
# machine (tests/netns.py: a veth into a namespace created here), where they can.


@pytest.fixture(scope="module")
def second() -> Iterator[netns.SecondAddress]:
    why = netns.usable()
    if why:
        pytest.skip(why)
    with netns.second_address() as s:
        yield s


@pytest.fixture(scope="module")
def off_lo_kernel(
    second: netns.SecondAddress, tmp_path_factory: pytest.TempPathFactory, cache_home: Path
) -> Iterator[Kernel]:
    """A kernel (and so every job it starts) whose hostname resolves to the second address."""
    cwd = tmp_path_factory.mktemp("nb")
    prefix = netns.hostname_prefix(second.address)
    k = Kernel(str(cwd), env={"XDG_CACHE_HOME": str(cache_home)}, cmd_prefix=prefix)
    k.ok("%load_ext elastic_nb")
    yield k
    k.shutdown()


def _probe(second: netns.SecondAddress) -> Callable[[tuple], bool]:
    """Whether the namespace reaches a listener's port at the second address (one on 127.0.0.1
    it cannot): asked while the ranks still hold it."""
    return lambda s: netns.reachable(second.netns, second.address, s[3])


def test_off_loopback_is_seen_where_gloo_is_not_named_loopback(
    off_lo_kernel: Kernel, second: netns.SecondAddress, tmp_path: Path
) -> None:
    """The negative control: a cell that drops GLOO_SOCKET_IFNAME before its process group has
    every rank's gloo listener on the second address, reachable from the namespace, and the
    check says so."""
    drop = "import os\nos.environ.pop('GLOO_SOCKET_IFNAME', None)\n"
    cell = "%%elastic --nproc 2\n" + drop + IN_CELL.format(dir=str(tmp_path))
    ranks, _, probed = in_the_cell(off_lo_kernel, cell, tmp_path, _probe(second))
    sockets = [s[:4] for s in probed]
    on_second = {pid for pid, _, ip, _ in sockets if ip == second.address}
    assert on_second == {pid for pid, _ in ranks.values()}, sockets
    assert exposed(sockets), sockets
    reached = {s[:4] for s in probed if s[4]}
    assert reached == {s for s in sockets if s[2] == second.address}, probed


@pytest.mark.parametrize(
    "flags",
    ["", "--start-method spawn", "--rdzv-backend static --rdzv-endpoint localhost:{port}"],
    ids=["forkserver", "spawn", "static"],
)
def test_a_job_listens_on_loopback_only_where_the_hostname_is_not(
    off_lo_kernel: Kernel, second: netns.SecondAddress, tmp_path: Path, flags: str
) -> None:
    shown = off_lo_kernel.ok("import socket\nprint(socket.gethostbyname(socket.gethostname()))")
    assert shown.stdout.strip() == second.address  # where gloo's default device would listen
    flags = flags.format(port=free_port())
    cell = f"%%elastic --nproc 2 {flags}\n" + IN_CELL.format(dir=str(tmp_path))
    ranks, launcher, probed = in_the_cell(off_lo_kernel, cell, tmp_path, _probe(second))
    sockets = [s[:4] for s in probed]
    assert_only_loopback(ranks, launcher, sockets, rank0_hosts="static" not in flags)
    assert {pid for pid, _ in ranks.values()} <= {pid for pid, *_ in sockets}, sockets
    assert not [s for s in probed if s[4]], probed


def test_a_session_listens_on_loopback_only_where_the_hostname_is_not(
    off_lo_kernel: Kernel, second: netns.SecondAddress, tmp_path: Path
) -> None:
    k = off_lo_kernel
    assert "2 ranks up" in k.ok("%elastic up --nproc 2").stdout
    try:
        k.ok("%%elastic\nimport torch.distributed as dist\ndist.init_process_group()\n")
        ranks, launcher, probed = in_the_cell(
            k, "%%elastic\n" + IN_CELL.format(dir=str(tmp_path)), tmp_path, _probe(second)
        )
    finally:
        k.ok("%elastic down")
    assert_only_loopback(ranks, launcher, [s[:4] for s in probed])
    assert not [s for s in probed if s[4]], probed


# Another process on this machine writes a pickle under the rendezvous state's key of a running
# job's store, as a local user who found its port could: the pickle would make a directory.
_FORGE = """
import base64, os, pickle, sys
from datetime import timedelta
from torch.distributed import TCPStore

class Payload:
    def __reduce__(self):
        return (os.mkdir, (sys.argv[3],))

store = TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=10))
key = "torch.rendezvous." + sys.argv[2]
assert store.check([key]), "no rendezvous state under " + key
store.set(key, base64.b64encode(pickle.dumps(Payload())))
"""


def test_a_state_another_process_writes_into_the_rendezvous_store_is_never_unpickled(
    kernel: Kernel, tmp_path: Path
) -> None:
    """The launcher refuses a rendezvous state its job's launchers did not sign (an HMAC under
    a key only they hold) before anything unpickles it: the payload never runs, the job fails
    saying why, and nothing of it is left."""
    marker = tmp_path / "payload-ran"
    msg_id, ex = kernel.start("%%elastic --nproc 2\n" + IN_CELL.format(dir=str(tmp_path)))
    try:
        assert wait_for(lambda: all((tmp_path / f"rank-{r}").exists() for r in (0, 1)), 90)
        job = (tmp_path / "rank-0").read_text().split()[1]
        (launcher,) = [p for p in procs.job_processes([job]) if _leads_its_group(p.pid)]
        (port,) = [port for *_, port in listening({launcher.pid})]
        subprocess.run(
            [sys.executable, "-c", _FORGE, str(port), job, str(marker)], check=True, timeout=60
        )
        # Read back at the agent's next monitor tick: the launcher ends (or the payload runs).
        assert wait_for(lambda: marker.exists() or not launcher.is_running(), 30)
    finally:
        (tmp_path / "go").touch()
    ex = kernel.collect(msg_id, ex)
    assert not marker.exists(), "the forged rendezvous state was unpickled"
    assert ex.error is not None, ex.stdout
    said = ex.traceback + ex.stdout + ex.stderr
    assert "rendezvous state in the store was not written by this job's launchers" in said, said
