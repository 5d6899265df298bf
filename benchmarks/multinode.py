"""P10-P13: jobs across machines, elastic_nb beside torchrun, on the same "machines".

The machines are tests/machines.py's: network, PID, mount and UTS namespaces on this host, a
bridge between them (root only). elastic_nb's side: a kernel here, a join agent on each other
machine, joined and warm before anything is timed. torchrun's: one `torch.distributed.run` per
machine with the c10d rendezvous on this machine's address (its agent here hosts the store), all
started at the same moment. Both sides run the same body with 2 ranks per machine, gloo on each
machine's interface (GLOO_SOCKET_IFNAME: torchrun's ranks could not even meet without it: the
machines' names resolve to nothing).

* P10 launch: the cell sent (torchrun: its agents started) -> every rank of 3 machines past
  init_process_group;
* P11 a machine lost (SIGKILL to its namespace) mid-training -> the survivors running the next
  round (elastic_nb --nnodes 2:3 --max-restarts 1; torchrun the same with --max-restarts 3, its
  ranks' process group with elastic_nb's --collective-timeout, 120 s, given 300 s);
* P12 a machine joins a 2:3 job that runs on 2 -> every rank running with the larger world:
  elastic_nb from its agent's join (an agent joins once warm); torchrun from its third agent's
  start, and with --rdzv-conf last_call_timeout=1 as well (its default is 30 s);
* P13 what listens beyond loopback on the notebook's machine while such a job runs.

python benchmarks/multinode.py [--runs N]
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import psutil
from common import HEADER, MARK, Elastic, median, read_marks, runs, spread

from elastic_nb.common.machine import interface_holding
from tests import machines
from tests.kernel import wait_for

NPROC = 2
GIVE_UP_S = 300  # P11: how long torchrun's survivors are given to run their next round
INIT = """import os, torch.distributed as dist
dist.init_process_group()
mark('inited')
dist.barrier()
"""
# Trains until its world changes: marks each round's first step with the world size.
TRAIN = """import os, time, torch, torch.distributed as dist
from datetime import timedelta
dist.init_process_group(timeout=timedelta(seconds=120))
world = dist.get_world_size()
mark(f'world{world}')
x = torch.ones(1)
stop = os.path.join(os.environ['BENCH_DIR'], 'stop')
for _ in range(7500):  # 150 s at most
    dist.all_reduce(x)
    # Every rank stops at the same step: whether any rank saw the stop file, agreed by all.
    seen = torch.tensor([float(os.path.exists(stop))])
    dist.all_reduce(seen)
    if seen.item() > 0:
        break
    time.sleep(0.02)
"""


class Torchrun:
    """One torch.distributed.run per machine: this one's here, the others' in their namespaces."""

    def __init__(self, lab: machines.Lab, directory: str) -> None:
        self.lab, self.directory = lab, directory
        self.script = Path(directory).parent / f"{Path(directory).name}-multinode.py"
        self.procs: list[subprocess.Popen[bytes]] = []
        self.logs: list[Path] = []

    def agent(self, body: str, where: machines.Machine | None, nnodes: str, *args: str) -> float:
        """Start one agent (`where` None: on this machine); when it was started."""
        self.script.write_text(MARK + body)
        address = self.lab.host_address if where is None else where.address
        env = {
            "OMP_NUM_THREADS": "1",
            "BENCH_DIR": self.directory,
            "GLOO_SOCKET_IFNAME": interface_holding(address) if where is None else "",
        }
        # This machine hosts the store: said, since its name resolves to loopback only (torch
        # would find it by name otherwise, rendezvous/utils.py: _matches_machine_hostname).
        conf = [f"is_host={int(where is None)}"]
        conf += [a.removeprefix("--rdzv-conf=") for a in args if a.startswith("--rdzv-conf=")]
        args = tuple(a for a in args if not a.startswith("--rdzv-conf="))
        cmd = [
            sys.executable, "-m", "torch.distributed.run",
            f"--nnodes={nnodes}", f"--nproc-per-node={NPROC}",
            "--rdzv-backend=c10d", f"--rdzv-endpoint={self.lab.host_address}:29411",
            f"--rdzv-conf={','.join(conf)}",
            "--rdzv-id=bench", f"--local-addr={address}", *args, str(self.script),
        ]  # fmt: skip
        log = Path(tempfile.mkstemp(prefix="torchrun-agent-")[1])
        self.logs.append(log)
        if where is not None:
            # Its own machine: the namespaces, its interface named inside them.
            iface = f"enm{os.getpid()}p{where.n}"  # tests/machines.py's names
            env["GLOO_SOCKET_IFNAME"] = iface
            # Its name resolves there, as a real machine's does: torch's c10d rendezvous looks
            # itself up (rendezvous/utils.py, _matches_machine_hostname) and fails otherwise.
            hosts = Path(self.directory).parent / f"{Path(self.directory).name}-hosts-{where.n}"
            hosts.write_text(Path("/etc/hosts").read_text() + f"{where.address} {where.hostname}\n")
            cmd = ["ip", "netns", "exec", where.netns, "unshare", "--pid", "--uts", "--fork",
                   "--mount-proc", "--", "/bin/sh", "-c",
                   f'hostname {where.hostname} && mount --bind {hosts} /etc/hosts && exec "$@"',
                   "torchrun-machine", *cmd]  # fmt: skip
        started = time.time()
        self.procs.append(
            subprocess.Popen(
                cmd,
                stdout=log.open("wb"),
                stderr=subprocess.STDOUT,
                env={**os.environ, **env},
                start_new_session=True,
            )
        )
        return started

    def stop(self) -> None:
        for p in self.procs:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        for p in self.procs:
            p.wait()
        self.procs.clear()
        for proc in psutil.process_iter():
            with contextlib.suppress(psutil.Error):
                if proc.environ().get("BENCH_DIR") == self.directory:
                    proc.kill()

    def output(self) -> str:
        return "\n".join(log.read_text(errors="replace")[-2000:] for log in self.logs)


def _clear(directory: str) -> None:
    for path in Path(directory).iterdir():
        path.unlink()


def _wait_marks(
    directory: str, event: str, count: int, timeout: float, said: Any = None
) -> list[float]:
    ok = wait_for(lambda: len(read_marks(directory).get(event, [])) >= count, timeout, 0.05)
    assert ok, (event, read_marks(directory), said() if said else "")
    return read_marks(directory)[event]


class ElasticCluster:
    """A warm kernel here, a joined, warm agent on each of `lab`'s machines."""

    def __init__(self, lab: machines.Lab, directory: str, count: int) -> None:
        self.lab = lab
        self.el = Elastic.warm(directory)
        self.k = self.el.kernel
        self.join = self.k.ok(f"%elastic join-command --host {lab.host_address}").stdout.split(
            "\n"
        )[0]
        self.machines = [lab.machine() for _ in range(count)]
        for m in self.machines:
            m.join(self.join)
        self.wait_joined(count)

    def wait_joined(self, count: int) -> None:
        machines.wait_joined(lambda: self.k.ok("%elastic nodes").stdout, count, exactly=True)

    def shutdown(self) -> None:
        self.el.shutdown()
        for m in self.machines:
            m.stop()


def p10(
    lab: machines.Lab, d: str, n: int, cluster: ElasticCluster
) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for _ in range(n):
        r = cluster.el.run("--nnodes 3 --nproc 2", INIT)
        xs.append(r.after_start("inited", 3 * NPROC))
        cluster.el.wait_warm()
        tr = Torchrun(lab, d)
        _clear(d)
        try:
            t0 = tr.agent(INIT, None, "3")
            for m in lab.machines[2:4]:
                tr.agent(INIT, m, "3")
            ys.append(max(_wait_marks(d, "inited", 3 * NPROC, 120, tr.output)) - t0)
        finally:
            tr.stop()
    return xs, ys


def p11(
    lab: machines.Lab, d: str, n: int, cluster: ElasticCluster
) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    for _ in range(n):
        cluster.wait_joined(2)
        _clear(d)
        msg_id, ex = cluster.k.start(
            f"%%elastic --nnodes 2:3 --nproc 2 --max-restarts 1 --env BENCH_DIR={d}\n{TRAIN}"
        )
        _wait_marks(d, "world6", 6, 120)
        lost = cluster.machines[1]
        killed = time.time()
        lost.kill()
        xs.append(max(_wait_marks(d, "world4", 4, 60)) - killed)
        Path(d, "stop").touch()
        cluster.k.collect(msg_id, ex, timeout=120)
        lost.stop()
        lost.join(cluster.join)
        tr = Torchrun(lab, d)
        _clear(d)
        try:
            # Three restarts, not one: with one, torchrun spends it on a round that still
            # counts the dead machine (its keep-alives not yet expired) and closes the job.
            for where in (None, lab.machines[2], lab.machines[3]):
                tr.agent(TRAIN, where, "2:3", "--max-restarts=3")
            _wait_marks(d, "world6", 6, 120, tr.output)
            killed = time.time()
            os.killpg(tr.procs[-1].pid, signal.SIGKILL)  # the agent's namespace, whole
            try:
                ys.append(max(_wait_marks(d, "world4", 4, GIVE_UP_S)) - killed)
            except AssertionError:
                ys.append(math.inf)  # never, within GIVE_UP_S: its last words are printed
                print(f"P11 torchrun: no round of the survivors in {GIVE_UP_S} s:", file=sys.stderr)
                print(tr.output()[-3000:], file=sys.stderr)
        finally:
            Path(d, "stop").touch()
            tr.stop()
    return xs, ys


def p12(
    lab: machines.Lab, d: str, n: int, cluster: ElasticCluster
) -> tuple[list[float], list[float], list[float]]:
    xs, ys, zs = [], [], []
    late = cluster.machines[1]
    for _ in range(n):
        late.stop()
        cluster.wait_joined(1)
        _clear(d)
        msg_id, ex = cluster.k.start(
            f"%%elastic --nnodes 2:3 --nproc 2 --env BENCH_DIR={d}\n{TRAIN}"
        )
        _wait_marks(d, "world4", 4, 120)
        late.join(cluster.join)
        cluster.wait_joined(2)
        joined = _joined_at(cluster, late)
        xs.append(max(_wait_marks(d, "world6", 6, 60)) - joined)
        Path(d, "stop").touch()
        cluster.k.collect(msg_id, ex, timeout=120)
        for extra, out in (((), ys), (("--rdzv-conf=last_call_timeout=1",), zs)):
            tr = Torchrun(lab, d)
            _clear(d)
            try:
                tr.agent(TRAIN, None, "2:3", *extra)
                tr.agent(TRAIN, lab.machines[2], "2:3", *extra)
                _wait_marks(d, "world4", 4, 120, tr.output)
                started = tr.agent(TRAIN, lab.machines[3], "2:3", *extra)
                out.append(max(_wait_marks(d, "world6", 6, 120, tr.output)) - started)
            finally:
                Path(d, "stop").touch()
                tr.stop()
    return xs, ys, zs


def _joined_at(cluster: ElasticCluster, m: machines.Machine) -> float:
    """When the supervisor took the agent in (its log's line)."""
    log = Path(re.search(r"log:\s+(\S+)", cluster.k.ok("%elastic status").stdout).group(1))  # type: ignore[union-attr]
    stamps = re.findall(rf"(\S+ \S+) INFO \S+: node \d+ joined: {m.hostname}\b", log.read_text())
    assert stamps, log.read_text()[-2000:]
    return time.mktime(time.strptime(stamps[-1].split(",")[0], "%Y-%m-%d %H:%M:%S")) + float(
        "0." + stamps[-1].split(",")[1]
    )


def p13(lab: machines.Lab, d: str, cluster: ElasticCluster) -> tuple[list[str], list[str]]:
    """What listens beyond loopback on this machine, each side's processes, while a job runs."""
    cluster.wait_joined(2)
    _clear(d)
    msg_id, ex = cluster.k.start(f"%%elastic --nnodes 3 --nproc 2 --env BENCH_DIR={d}\n{TRAIN}")
    _wait_marks(d, "world6", 6, 120)
    ours = _listeners(lambda p: p.pid in {pid for pid, _ in cluster.k.tree.seen})
    Path(d, "stop").touch()
    cluster.k.collect(msg_id, ex, timeout=120)
    tr = Torchrun(lab, d)
    _clear(d)
    try:
        tr.agent(TRAIN, None, "3")
        for m in lab.machines[2:4]:
            tr.agent(TRAIN, m, "3")
        _wait_marks(d, "world6", 6, 120, tr.output)
        here = tr.procs[0].pid
        theirs = _listeners(lambda p: _descends(p, here))
    finally:
        Path(d, "stop").touch()
        tr.stop()
    return ours, theirs


def _descends(p: psutil.Process, root: int) -> bool:
    with contextlib.suppress(psutil.Error):
        return p.pid == root or any(a.pid == root for a in p.parents())
    return False


def _listeners(mine: Any) -> list[str]:
    out = []
    for p in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if not mine(p):
                continue
            for c in p.net_connections("inet"):
                if c.status == psutil.CONN_LISTEN and not c.laddr.ip.startswith("127."):
                    name = " ".join(p.cmdline())[:60]
                    out.append(f"{c.laddr.ip}:{c.laddr.port} ({_role(name)})")
    return sorted(out)


def _role(cmdline: str) -> str:
    if "elastic_nb.supervisor" in cmdline:
        return "supervisor: the agents' channel"
    if "torch.distributed.run" in cmdline:
        return "torchrun's agent"
    return "a rank"


def main() -> None:
    n = runs()
    if os.geteuid() != 0:
        sys.exit("benchmarks/multinode.py makes machines of namespaces: run it as root")
    # Where ranks mark their moments: seen by every machine (theirs have a /tmp of their own).
    d = tempfile.mkdtemp(prefix="elastic_nb-bench-", dir="/var/tmp")
    with machines.lab(Path(tempfile.mkdtemp(prefix="elastic_nb-bench-lab-"))) as lab:
        cluster = ElasticCluster(lab, d, 2)
        lab.machine(), lab.machine()  # torchrun's two other machines
        try:
            p10_x, p10_y = p10(lab, d, n, cluster)
            p11_x, p11_y = p11(lab, d, max(1, n // 2 + 1), cluster)
            p12_x, p12_y, p12_z = p12(lab, d, max(1, n // 2 + 1), cluster)
            ours, theirs = p13(lab, d, cluster)
        finally:
            cluster.shutdown()
    print(HEADER)
    ratio = median(p10_x) / median(p10_y)
    print(
        f"| P10 3 machines x 2 ranks: start -> every rank past init_process_group | "
        f"{spread(p10_x)} | {spread(p10_y)} | {ratio:.2f}x | <= 0.15x | {len(p10_x)} |"
    )
    print(
        f"| P11 a machine lost (SIGKILL) -> the survivors running the next round | "
        f"{spread(p11_x)} | {spread(p11_y)} | {median(p11_x) / median(p11_y):.2f}x | <= 3 s | "
        f"{len(p11_x)} |"
    )
    print(
        f"| P12 a machine joins a 2:3 job -> every rank running in the larger world (torchrun: "
        f"its agent started; last_call 30 s) | {spread(p12_x)} | {spread(p12_y)} | "
        f"{median(p12_x) / median(p12_y):.2f}x | <= 3 s | {len(p12_x)} |"
    )
    print(
        f"| P12b the same, torchrun with --rdzv-conf last_call_timeout=1 | {spread(p12_x)} | "
        f"{spread(p12_z)} | {median(p12_x) / median(p12_z):.2f}x | <= 3 s | {len(p12_x)} |"
    )
    print()
    print("P13: listening beyond loopback on the notebook's machine while a 3-machine job runs:")
    print(f"- elastic_nb ({len(ours)}): " + ("; ".join(ours) or "none"))
    print(f"- torchrun ({len(theirs)}): " + ("; ".join(theirs) or "none"))
    print(json.dumps({"p13": {"elastic_nb": ours, "torchrun": theirs}}))


if __name__ == "__main__":
    main()
