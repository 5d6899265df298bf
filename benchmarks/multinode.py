"""P10-P13: jobs across machines, elastic_nb beside torchrun, on the same "machines".

The machines are tests/machines.py's: network, PID, mount and UTS namespaces on this host, a
bridge between them (root only). elastic_nb's side: a kernel here, a join agent on each other
machine, joined and warm before anything is timed. torchrun's: one `torch.distributed.run` per
machine with the c10d rendezvous on this machine's address (its agent here hosts the store), all
started at the same moment. Both sides run the same body with 2 ranks per machine, gloo on each
machine's interface (GLOO_SOCKET_IFNAME: torchrun's ranks could not even meet without it: the
machines' names resolve to nothing). Each benchmark runs its elastic_nb turns first, on a kernel
and agents of its own, then its torchrun turns (`elastic` says why).

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
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
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
    """A warm kernel here, a joined, warm agent on each of `ours` (machines of the lab)."""

    def __init__(self, lab: machines.Lab, directory: str, ours: list[machines.Machine]) -> None:
        self.lab = lab
        self.el = Elastic.warm(directory)
        self.k = self.el.kernel
        self.join = self.k.ok(f"%elastic join-command --host {lab.host_address}").stdout.split(
            "\n"
        )[0]
        self.log = Path(re.search(r"log:\s+(\S+)", self.k.ok("%elastic status").stdout).group(1))  # type: ignore[union-attr]
        self.machines = ours
        for m in self.machines:
            m.join(self.join)
        self.wait_joined(len(ours))

    def joins(self, m: machines.Machine) -> list[float]:
        """When the supervisor took `m`'s agent in, each time (its log's lines): read without
        the kernel, which is busy with a cell meanwhile."""
        stamps = re.findall(
            rf"(\S+ \S+) INFO \S+: node \d+ joined: {m.hostname}\b", self.log.read_text()
        )
        return [
            time.mktime(time.strptime(s.split(",")[0], "%Y-%m-%d %H:%M:%S"))
            + float("0." + s.split(",")[1])
            for s in stamps
        ]

    def wait_joined(self, count: int) -> None:
        machines.wait_joined(lambda: self.k.ok("%elastic nodes").stdout, count, exactly=True)

    def shutdown(self) -> None:
        self.el.shutdown()
        for m in self.machines:
            m.stop()


@contextlib.contextmanager
def elastic(lab: machines.Lab, d: str, ours: list[machines.Machine]) -> Iterator[ElasticCluster]:
    """A cluster of its own for each benchmark, whose elastic_nb turns all come before its
    torchrun turns. (With one kernel through every turn of both sides, `%elastic nodes` went
    unanswered for 120 s after P11's torchrun turns, in two runs of two; why was not found: the
    kernel answered every 5 s through P11's elastic_nb turns alone and through its torchrun
    turns alone. The "Socket operation on non-socket" ipykernel logged after it is the reply of
    a cell still running when the benchmark shut the kernel down.)"""
    cluster = ElasticCluster(lab, d, ours)
    try:
        yield cluster
    finally:
        cluster.shutdown()


def p10(
    lab: machines.Lab, d: str, n: int, ours: list[machines.Machine], theirs: list[machines.Machine]
) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    with elastic(lab, d, ours) as cluster:
        for _ in range(n):
            r = cluster.el.run("--nnodes 3 --nproc 2", INIT)
            xs.append(r.after_start("inited", 3 * NPROC))
            cluster.el.wait_warm()
    for _ in range(n):
        tr = Torchrun(lab, d)
        _clear(d)
        try:
            t0 = tr.agent(INIT, None, "3")
            for m in theirs:
                tr.agent(INIT, m, "3")
            ys.append(max(_wait_marks(d, "inited", 3 * NPROC, 120, tr.output)) - t0)
        finally:
            tr.stop()
    return xs, ys


def p11(
    lab: machines.Lab, d: str, n: int, ours: list[machines.Machine], theirs: list[machines.Machine]
) -> tuple[list[float], list[float]]:
    xs, ys = [], []
    with elastic(lab, d, ours) as cluster:
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
    for _ in range(n):
        tr = Torchrun(lab, d)
        _clear(d)
        try:
            # Three restarts, not one: with one, torchrun spends it on a round that still
            # counts the dead machine (its keep-alives not yet expired) and closes the job.
            for where in (None, *theirs):
                tr.agent(TRAIN, where, "2:3", "--max-restarts=3")
            _wait_marks(d, "world6", 6, 120, tr.output)
            killed = time.time()
            os.killpg(tr.procs[-1].pid, signal.SIGKILL)  # the agent's namespace, whole
            survivors = tr.procs[:-1]
            wait_for(
                lambda survivors=survivors: (
                    len(read_marks(d).get("world4", [])) >= 4
                    or all(p.poll() is not None for p in survivors)
                ),  # they gave up
                GIVE_UP_S,
                0.05,
            )
            if len(marks := read_marks(d).get("world4", [])) >= 4:
                ys.append(max(marks) - killed)
            else:
                ys.append(math.inf)  # never: its agents' last words are printed
                ended = sum(p.poll() is not None for p in survivors)
                print(
                    f"P11 torchrun: no round of the survivors ({ended} of {len(survivors)} "
                    f"agents exited, {time.time() - killed:.0f} s after the kill):",
                    file=sys.stderr,
                )
                print(tr.output()[-3000:], file=sys.stderr)
        finally:
            Path(d, "stop").touch()
            tr.stop()
    return xs, ys


def p12(
    lab: machines.Lab, d: str, n: int, ours: list[machines.Machine], theirs: list[machines.Machine]
) -> tuple[list[float], list[float], list[float]]:
    xs, ys, zs = [], [], []
    with elastic(lab, d, ours) as cluster:
        late = cluster.machines[1]
        for _ in range(n):
            late.stop()
            cluster.wait_joined(1)
            _clear(d)
            msg_id, ex = cluster.k.start(
                f"%%elastic --nnodes 2:3 --nproc 2 --env BENCH_DIR={d}\n{TRAIN}"
            )
            _wait_marks(d, "world4", 4, 120)
            before = len(cluster.joins(late))
            late.join(cluster.join)
            joined = wait_for(lambda n=before: len(cluster.joins(late)) > n, 60, 0.05)
            assert joined, late.output()
            xs.append(max(_wait_marks(d, "world6", 6, 60)) - cluster.joins(late)[-1])
            Path(d, "stop").touch()
            cluster.k.collect(msg_id, ex, timeout=120)
    for _ in range(n):
        for extra, out in (((), ys), (("--rdzv-conf=last_call_timeout=1",), zs)):
            tr = Torchrun(lab, d)
            _clear(d)
            try:
                tr.agent(TRAIN, None, "2:3", *extra)
                tr.agent(TRAIN, theirs[0], "2:3", *extra)
                _wait_marks(d, "world4", 4, 120, tr.output)
                started = tr.agent(TRAIN, theirs[1], "2:3", *extra)
                try:
                    out.append(max(_wait_marks(d, "world6", 6, 120)) - started)
                except AssertionError:
                    out.append(math.inf)  # never: its agents' last words are printed
                    print(f"P12 torchrun {extra}: no larger world in 120 s:", file=sys.stderr)
                    print(tr.output()[-3000:], file=sys.stderr)
            finally:
                Path(d, "stop").touch()
                tr.stop()
    return xs, ys, zs


def p13(
    lab: machines.Lab, d: str, ours: list[machines.Machine], theirs: list[machines.Machine]
) -> tuple[list[str], list[str]]:
    """What listens beyond loopback on this machine, each side's processes, while a job runs."""
    with elastic(lab, d, ours) as cluster:
        _clear(d)
        msg_id, ex = cluster.k.start(f"%%elastic --nnodes 3 --nproc 2 --env BENCH_DIR={d}\n{TRAIN}")
        _wait_marks(d, "world6", 6, 120)
        mine = _listeners(lambda p: p.pid in {pid for pid, _ in cluster.k.tree.seen})
        Path(d, "stop").touch()
        cluster.k.collect(msg_id, ex, timeout=120)
    tr = Torchrun(lab, d)
    _clear(d)
    try:
        tr.agent(TRAIN, None, "3")
        for m in theirs:
            tr.agent(TRAIN, m, "3")
        _wait_marks(d, "world6", 6, 120, tr.output)
        here = tr.procs[0].pid
        others = _listeners(lambda p: _descends(p, here))
    finally:
        Path(d, "stop").touch()
        tr.stop()
    return mine, others


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
    lab_dir = tempfile.mkdtemp(prefix="elastic_nb-bench-lab-")
    try:
        with machines.lab(Path(lab_dir)) as lab:
            mine = [lab.machine(), lab.machine()]  # elastic_nb's agents' machines
            others = [lab.machine(), lab.machine()]  # torchrun's agents'
            p10_x, p10_y = p10(lab, d, n, mine, others)
            p11_x, p11_y = p11(lab, d, max(1, n // 2 + 1), mine, others)
            p12_x, p12_y, p12_z = p12(lab, d, max(1, n // 2 + 1), mine, others)
            ours, theirs = p13(lab, d, mine, others)
    finally:
        # The marks, torchrun's script and the machines' hosts files beside them, the lab.
        for path in (d, *Path(d).parent.glob(f"{Path(d).name}-*"), lab_dir):
            if Path(path).is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                Path(path).unlink(missing_ok=True)
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
