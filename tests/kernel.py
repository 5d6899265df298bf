"""A real ipykernel, driven through jupyter_client, for end-to-end tests; and what the jobs it runs
leave behind, observed from outside (processes, ports, run directories)."""

from __future__ import annotations

import atexit
import contextlib
import itertools
import json
import os
import re
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import psutil
from jupyter_client.blocking import BlockingKernelClient
from jupyter_client.manager import KernelManager
from traitlets import List, Unicode

from elastic_nb.common import modules, procs, registry

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_CALLERS = ("ELASTIC_NB_", "JPY_", "VSCODE_")
_JOB = re.compile(r"\[elastic_nb\] job ([0-9a-f]{8})")
_RUN_DIR = re.compile(r"\[elastic_nb\] job ([0-9a-f]{8}) .*?logs: (\S+)")
HOST = socket.gethostname()  # rank records name their machine (test_multinode: others)


class TreeWatch:
    """Every process that ever appeared under a kernel (or a Jupyter server), sampled by a
    thread every 20 ms: the suite's own account of what a kernel started, independent of the
    marker sweep the implementation uses (which cannot see a process that dropped its
    environment). Every watch is listed in `TreeWatch.every`, for the per-test check
    (tests/conftest.py, every_process_ends_with_its_test): what appeared under a root during a
    test and still runs after it must be one of the processes `kept()` names, the long-lived
    ones, found by what they are."""

    every: ClassVar[list[TreeWatch]] = []

    def __init__(
        self,
        pid: int,
        kept: Callable[[TreeWatch], set[int]] | None = None,
        kernel: Kernel | None = None,
    ) -> None:
        self._root = psutil.Process(pid)
        self.seen: dict[tuple[int, float], str] = {}  # (pid, start time) -> command line
        self.parent: dict[int, int] = {}  # pid -> its parent when first seen (before any adoption)
        self._unnamed: set[tuple[int, float]] = set()  # seen with no command line yet
        self._kept = kept or (lambda w: kernel_keeps(pid, w))
        self.kernel = kernel  # whose cells' one-off jobs the per-test check follows too
        self._kept_at: tuple[float, set[int]] | None = None
        self._stop = threading.Event()
        self._awake = threading.Event()
        self._awake.set()
        self._thread = threading.Thread(target=self._run, name="tree-watch", daemon=True)
        self._thread.start()
        TreeWatch.every.append(self)

    @property
    def root(self) -> int:
        return self._root.pid

    @property
    def over(self) -> bool:
        """It no longer samples: stopped, or its root is gone."""
        return not self._thread.is_alive()

    def mark(self) -> frozenset[tuple[int, float]]:
        """What runs under the root now or ran before: `outliving` leaves these out."""
        self._kept_at = None  # asked afresh at the check
        if not self.over:
            self.sample()
        return frozenset(self.seen)

    def outliving(self, before: frozenset[tuple[int, float]]) -> list[str]:
        """What appeared since `before` (a `mark`) and still runs, but for what `kept()`
        names."""
        if not self.over:
            self.sample()
        new = [(key, cmd) for key, cmd in list(self.seen.items()) if key not in before]
        live = [(key, cmd) for key, cmd in new if _runs(*key)]
        if not live:
            return []  # most tests: no need to ask anything
        kept = self.kept()
        if any(pid not in kept for (pid, _), _ in live):
            # Asked afresh: what the supervisor keeps may have changed since the cached answer
            # (its idle launcher, still warming, forked a child through its fork server).
            kept = self.kept(fresh=True)
        return [
            f"{pid} {cmd} (under {self._named(self.parent.get(pid))}; now {_now(pid)}; "
            f"its parent now {_now(self.parent.get(pid, 0))}; kept: {sorted(kept)})"
            for (pid, started), cmd in live
            # Still running once the supervisor has been asked: a warming launcher's short-lived
            # child, seen running, then gone before the answer listed the launcher's children,
            # is no leak (it was reported as one: "now unreadable: NoSuchProcess").
            if pid not in kept and _runs(pid, started)
        ]

    def _named(self, pid: int | None) -> str:
        """A pid with its command line as the watch saw it (the root's: 'the root')."""
        if pid == self._root.pid:
            return f"{pid}, the root"
        return next((f"{pid} {c}" for (q, _), c in list(self.seen.items()) if q == pid), str(pid))

    def kept(self, fresh: bool = False) -> set[int]:
        """The pids under the root that may outlive a test (a supervisor and what it keeps).
        Asked at most once a second unless `fresh`: a supervisor's status takes 0.1-0.2 s here
        (it measures the warm processes' PSS), and the per-test check polls while a job's last
        processes exit."""
        now = time.monotonic()
        if fresh or self._kept_at is None or now - self._kept_at[0] >= 1.0:
            self._kept_at = (now, self._kept(self))
        return self._kept_at[1]

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No sampling meanwhile: a benchmark times its turns without the watch's CPU (about a
        tenth of a core, on a 2-core machine a slowdown of whatever ranks run meanwhile,
        torchrun's as much as elastic_nb's: benchmarks/common.py pauses it for both)."""
        self._awake.clear()
        try:
            yield
        finally:
            self._awake.set()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            self._awake.wait()
            if not self.sample():
                return  # the root is gone

    def sample(self) -> bool:
        """Take in what runs under the root now (the thread's step; the per-test check takes
        one too, for what started since the last); False once the root is gone."""
        try:
            children = self._root.children(recursive=True)
        except psutil.Error:
            return False
        for p in children:
            try:
                key = (p.pid, p.create_time())
                if key not in self.seen:
                    self.parent[p.pid] = p.ppid()
                elif key not in self._unnamed:
                    continue
                # A process seen in the middle of its exec (or its exit) has no command line
                # yet: its name stands in until a later look finds one.
                cmd = " ".join(p.cmdline())[:120]
                self.seen[key] = cmd or f"{p.name()} (no command line yet)"
                (self._unnamed.add if not cmd else self._unnamed.discard)(key)
            except psutil.Error:
                continue
        return True

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)

    def ancestors(self, pid: int, depth: int) -> list[int]:
        """Up to `depth` of the processes above `pid`, each its child's parent when first seen
        (a forked rank's fork server, then its launcher; a spawned rank's launcher)."""
        chain = []
        while len(chain) < depth and (pid := self.parent.get(pid, 0)) and pid != self._root.pid:
            chain.append(pid)
        return chain

    def alive(self) -> list[str]:
        """What the watch saw that still runs (a zombie has ended: its parent reaps it)."""
        return [
            f"{pid} {cmd}" for (pid, started), cmd in list(self.seen.items()) if _runs(pid, started)
        ]


def _now(pid: int) -> str:
    """What a process is doing now, for a report of one that outlived its test: its state, its
    command line as it reads now (one first seen mid-fork or mid-exec had none), its parent."""
    try:
        p = psutil.Process(pid)
        with p.oneshot():
            return f"{p.status()}, {' '.join(p.cmdline())[:120] or p.name()!r}, parent {p.ppid()}"
    except psutil.Error as e:
        return f"unreadable: {e!r}"


def _runs(pid: int, started: float) -> bool:
    """That process (not another that reused its pid) still runs: a zombie has ended."""
    try:
        p = psutil.Process(pid)
        return p.create_time() == started and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


# ---- the long-lived processes of a kernel, found by what they are --------------------------------


def _has(cmdline: list[str], option: str, value: str) -> bool:
    return (option, value) in itertools.pairwise(cmdline)


def runs_module(cmdline: list[str], module: str) -> bool:
    """The command line is `python ... -m module ...`: the process was started as that module
    (what it is), not merely one whose command line mentions it."""
    return _has(cmdline, "-m", module)


def supervisor_of(kernel_pid: int) -> psutil.Process | None:
    """The kernel's supervisor, found by what it is: the kernel's child started as `python -m
    elastic_nb.supervisor` (modules.SUPERVISOR) for that kernel (its --kernel-pid). None when
    it has none running (not started yet, or gone)."""
    try:
        children = psutil.Process(kernel_pid).children()
    except psutil.Error:
        return None
    found = []
    for p in children:
        with contextlib.suppress(psutil.Error):
            cmd = p.cmdline()
            if (
                runs_module(cmd, modules.SUPERVISOR)
                and _has(cmd, "--kernel-pid", str(kernel_pid))
                and p.status() != psutil.STATUS_ZOMBIE
            ):
                found.append(p)
    assert len(found) <= 1, f"kernel {kernel_pid} has several supervisors: {found}"
    return found[0] if found else None


def supervisor_registration(pid: int) -> registry.Registration | None:
    """What the supervisor registered beside its socket (elastic_nb.common.registry), read
    without judging anyone's registration."""
    for path in registry.runtime_dir().glob("sup-*.json"):
        with contextlib.suppress(OSError, ValueError, TypeError):
            reg = registry.Registration(**json.loads(path.read_text()))
            if reg.pid == pid:
                return reg
    return None


def kernel_keeps(kernel_pid: int, watch: TreeWatch) -> set[int]:
    """What may outlive a test under a kernel that runs: its supervisor and what that says it
    keeps (`status`): the zygote, the idle warm launcher with its tree (its fork server and
    resource tracker: launcher/fork_server.py), and the ranks of every session it runs with the
    fork servers and launchers above them (as the watch first saw them)."""
    sup = supervisor_of(kernel_pid)
    if sup is None:
        return set()
    kept = {sup.pid}
    reg = supervisor_registration(sup.pid)
    if reg is None:
        return kept  # starting: it keeps nothing yet
    try:
        status = ask_supervisor(reg.socket, {"kind": "status", "req": 1}, timeout=10)["data"]
    except OSError:
        return kept
    warm = status.get("warm") or {}
    if warm.get("zygote"):
        kept.add(warm["zygote"])
    if warm.get("pid"):
        kept.add(warm["pid"])
        # Its whole tree: its fork server and resource tracker, and while it is still warming
        # (not ready) the child it forks through its fork server (agent._wait_fork_server), seen
        # still running 10 s after a test when four workers' jobs shared two cores. An idle
        # launcher has no job: nothing of a job can be under it.
        with contextlib.suppress(psutil.Error):
            kept.update(p.pid for p in psutil.Process(warm["pid"]).children(recursive=True))
    for session in status.get("sessions", ()):
        for r in session["ranks"]:
            if r["pid"]:
                kept.add(r["pid"])
                kept.update(watch.ancestors(r["pid"], 3))
    return kept


@dataclass
class Execution:
    stdout: str = ""
    stderr: str = ""
    result: str | None = None  # text/plain of the execute_result
    error: dict[str, Any] | None = None  # ename, evalue, traceback (ANSI stripped)
    seconds: float = 0.0
    # Wall-clock (time.time()) arrival of the error and of the final idle, for benchmarks that
    # compare them with timestamps taken in the ranks.
    error_at: float | None = None
    idle_at: float | None = None
    pager: str = ""  # what IPython's pager showed (%%elastic? and friends)
    prompts: list[str] = field(default_factory=list)  # the kernel's input requests, in order
    prompted_at: list[float] = field(default_factory=list)  # time.time() each one arrived
    messages: list[dict[str, Any]] = field(default_factory=list)

    @property
    def ename(self) -> str | None:
        return self.error["ename"] if self.error else None

    @property
    def traceback(self) -> str:
        return "\n".join(self.error["traceback"]) if self.error else ""

    def when(self, text: str) -> float:
        """When the kernel sent the first output that holds `text` (its message's date: what a
        person sees, when they see it)."""
        for m in self.messages:
            if m["msg_type"] == "stream" and text in m["content"]["text"]:
                date = m["header"]["date"]
                return float(date.timestamp() if hasattr(date, "timestamp") else date)
        raise AssertionError(f"no output holds {text!r}")

    @property
    def job_ids(self) -> list[str]:
        return list(dict.fromkeys(_JOB.findall(self.stdout)))

    @property
    def job_id(self) -> str:
        ids = self.job_ids
        assert len(ids) == 1, f"expected one job in the output, found {ids}:\n{self.stdout}"
        return ids[0]

    @property
    def run_dir(self) -> Path:
        """The run directory its one job's summary line names (`... logs: PATH`)."""
        dirs = list(dict.fromkeys(path for _, path in _RUN_DIR.findall(self.stdout)))
        assert len(dirs) == 1, f"expected one run directory in the output, found {dirs}"
        return Path(dirs[0])


class PrefixedKernelManager(KernelManager):
    """A KernelManager whose kernel runs as ``cmd_prefix + <the kernelspec's command>``: the
    prefix comes after jupyter_client has put sys.executable for the spec's "python" (a prefix
    in the kernelspec's argv would lose that and run whatever python is on PATH). The prefix
    must exec, so that the pid jupyter_client holds and signals is the kernel's."""

    cmd_prefix = List(Unicode(), default_value=[])

    def format_kernel_cmd(self, extra_arguments: list[str] | None = None) -> list[str]:
        return [*self.cmd_prefix, *super().format_kernel_cmd(extra_arguments)]


class Kernel:
    def __init__(
        self, cwd: str, env: dict[str, str] | None = None, cmd_prefix: list[str] | None = None
    ) -> None:
        # Its channels on Unix sockets of a folder of its own: TCP ports that jupyter_client picks,
        # closes and hands to the kernel to bind were taken meanwhile on a loaded machine, by a
        # rank or another worker's kernel ("Address already in use": the kernel never started).
        self._sockets = tempfile.mkdtemp(prefix="enb-kernel-")
        atexit.register(shutil.rmtree, self._sockets, True)  # gone by the worker's end
        self.km = PrefixedKernelManager(
            kernel_name="python3",
            transport="ipc",
            ip=f"{self._sockets}/channel",
            cmd_prefix=cmd_prefix or [],
        )
        # A clean, explicit environment: nothing of the caller's notebook or elastic_nb setup
        # (ELASTIC_NB_WIDGETS, JPY_SESSION_NAME, VSCODE_PID...) decides what the test sees.
        inherited = {k: v for k, v in os.environ.items() if not k.startswith(_CALLERS)}
        self.km.start_kernel(cwd=cwd, env={**inherited, **(env or {})})
        self.kc = self.km.client()
        self.kc.start_channels()
        self.kc.wait_for_ready(timeout=60)
        self.executions: list[Execution] = []  # every cell run, in order
        self.tree = TreeWatch(self.pid, kernel=self)
        # IOPub messages of earlier cells that arrived while another cell was collected (what a
        # background job's thread prints goes under the cell that started it).
        self.late: dict[str, list[dict[str, Any]]] = {}

    @classmethod
    def attach(cls, connection_file: str, pid: int) -> Kernel:
        """A kernel someone else started (a Jupyter server's), driven like one of ours; its
        starter shuts it down."""
        k = cls.__new__(cls)
        k.km = None  # type: ignore[assignment]
        k._pid = pid
        k.kc = BlockingKernelClient(connection_file=connection_file)
        k.kc.load_connection_file()
        # No heartbeat: with no manager of its own, wait_for_ready takes a heartbeat missed for
        # a second (a kernel still starting on a loaded machine) for a dead kernel ("Kernel died
        # before replying to kernel_info"); its starter knows whether it lives.
        k.kc.start_channels(hb=False)
        k.kc.wait_for_ready(timeout=60)
        k.executions = []
        k.late = {}
        k.tree = TreeWatch(pid, kernel=k)
        return k

    @property
    def pid(self) -> int:
        if self.km is None:
            return self._pid
        return self.km.provisioner.process.pid  # type: ignore[union-attr]

    def supervisor(self) -> psutil.Process:
        """Its supervisor (`supervisor_of`), which must be running."""
        sup = supervisor_of(self.pid)
        assert sup is not None, f"kernel {self.pid} has no supervisor running"
        return sup

    def start(self, code: str, allow_stdin: bool = False) -> tuple[str, Execution]:
        """Execute `code`; `allow_stdin`: as a frontend that takes input (JupyterLab) rather
        than one that takes none (nbclient): `collect` then answers its input requests."""
        ex = Execution()
        self.executions.append(ex)
        return self.kc.execute(code, allow_stdin=allow_stdin), ex

    def job_pids(self, executions: list[Execution]) -> dict[str, set[int]]:
        """Every process of the one-off jobs these cells ran, observed from outside the product:
        each rank's pid as the rank itself wrote it in its records (every attempt), and the
        processes the kernel's tree showed between that rank and the supervisor (its fork server
        and launcher). A session's cells are left out: their ranks are the session's."""
        found: dict[str, set[int]] = {}
        for ex in executions:
            for job, path in _RUN_DIR.findall(ex.stdout + ex.stderr):
                rd = Path(path)
                summary = rd / "summary.json"
                if job in found or (
                    summary.exists() and json.loads(summary.read_text()).get("session")
                ):
                    continue
                pids: set[int] = set()
                for record in rd.glob("attempt-*/rank-*.*.json"):
                    with contextlib.suppress(ValueError, OSError):
                        said = json.loads(record.read_text())
                        # Another machine's rank (tests/machines.py) is its own test's to check.
                        if isinstance(said.get("pid"), int) and said.get("host") == HOST:
                            pids.add(said["pid"])
                spec = json.loads((rd / "spec.json").read_text())
                depth = 2 if spec["start_method"] == "forkserver" else 1
                for pid in list(pids):
                    pids.update(self.tree.ancestors(pid, depth))
                found[job] = pids
        return found

    def collect(
        self,
        msg_id: str,
        ex: Execution,
        timeout: float = 120,
        until: Any = None,
        t0: float | None = None,
        answer: Callable[[str, Execution], str | None] | None = None,
    ) -> Execution:
        """Read IOPub for `msg_id` until the kernel is idle (or `until(ex)` holds); with
        `answer`, a person at the frontend's input box: each input request's prompt is kept in
        `ex.prompts` and answered with `answer(prompt, ex)`, once what the kernel printed before
        it asked is in `ex`."""
        t0 = time.monotonic() if t0 is None else t0
        deadline = time.monotonic() + timeout
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise TimeoutError(
                    f"no end of execution in {timeout} s; so far:\n{ex.stdout}\n{ex.stderr}"
                )
            if answer is not None and self._answer_input(msg_id, ex, answer):
                return self._idle(msg_id, ex, t0)
            if answer is not None and until is not None and until(ex):
                return ex  # a prompt it waited for, say (no IOPub message comes after it)
            try:
                msg = self.kc.get_iopub_msg(
                    timeout=min(remaining, 1.0 if answer is None else 0.002)
                )
            except Exception:  # queue.Empty
                continue
            if self._take(msg, msg_id, ex):
                return self._idle(msg_id, ex, t0)
            if until is not None and until(ex):
                return ex

    def _take(self, msg: dict[str, Any], msg_id: str, ex: Execution) -> bool:
        """One IOPub message into `ex` (another cell's kept in `late`); True at the idle."""
        parent = msg["parent_header"].get("msg_id")
        if parent != msg_id:
            self.late.setdefault(parent, []).append(msg)
            return False
        ex.messages.append(msg)
        kind, content = msg["msg_type"], msg["content"]
        if kind == "stream":
            if content["name"] == "stdout":
                ex.stdout += content["text"]
            else:
                ex.stderr += content["text"]
        elif kind == "execute_result":
            ex.result = content["data"].get("text/plain")
        elif kind == "error":
            ex.error_at = time.time()
            ex.error = {
                "ename": content["ename"],
                "evalue": content["evalue"],
                "traceback": [_ANSI.sub("", t) for t in content["traceback"]],
            }
        return kind == "status" and content["execution_state"] == "idle"

    def _idle(self, msg_id: str, ex: Execution, t0: float) -> Execution:
        ex.idle_at = time.time()
        ex.seconds = time.monotonic() - t0
        self._reply(msg_id, ex)
        return ex

    def _answer_input(
        self, msg_id: str, ex: Execution, answer: Callable[[str, Execution], str | None]
    ) -> bool:
        """Answer the kernel's input requests; True if the kernel went idle meanwhile."""
        while True:
            try:
                request = self.kc.get_stdin_msg(timeout=0)
            except Exception:  # queue.Empty
                return False
            if request["msg_type"] != "input_request":
                continue
            arrived = time.time()
            # ipykernel flushes what the cell printed before it asks: take that in first (it
            # comes on IOPub, another socket), as a person sees it above the input box.
            while True:
                try:
                    msg = self.kc.get_iopub_msg(timeout=0.05)
                except Exception:  # queue.Empty
                    break
                if self._take(msg, msg_id, ex):
                    return True
            prompt = request["content"]["prompt"]
            ex.prompts.append(prompt)
            ex.prompted_at.append(arrived)
            text = answer(prompt, ex)
            if text is not None:  # None: the person pressed stop instead (it interrupted)
                self.kc.input(text)

    def debug(
        self, code: str, answer: Callable[[str, Execution], str | None], timeout: float = 120
    ) -> Execution:
        """Run `code` in a frontend that takes input, answering each prompt with `answer`."""
        t0 = time.monotonic()
        msg_id, ex = self.start(code, allow_stdin=True)
        return self.collect(msg_id, ex, timeout, t0=t0, answer=answer)

    def _reply(self, msg_id: str, ex: Execution) -> None:
        """IPython shows a UsageError on stderr without an IOPub error; the reply has it."""
        while True:
            reply = self.kc.get_shell_msg(timeout=30)
            if reply["parent_header"].get("msg_id") == msg_id:
                break
        content = reply["content"]
        for payload in content.get("payload", ()):
            if payload.get("source") == "page":
                ex.pager += _ANSI.sub("", payload["data"].get("text/plain", ""))
        if content["status"] == "error" and ex.error is None:
            ex.error = {
                "ename": content["ename"],
                "evalue": content["evalue"],
                "traceback": [ex.stderr],
            }

    def late_stdout(self, msg_id: str) -> str:
        return "".join(
            m["content"]["text"]
            for m in self.late.get(msg_id, ())
            if m["msg_type"] == "stream" and m["content"]["name"] == "stdout"
        )

    def run(self, code: str, timeout: float = 120) -> Execution:
        t0 = time.monotonic()
        msg_id, ex = self.start(code)
        return self.collect(msg_id, ex, timeout, t0=t0)

    def ok(self, code: str, timeout: float = 120) -> Execution:
        ex = self.run(code, timeout)
        assert ex.error is None, (
            f"{ex.ename}: {ex.error and ex.error['evalue']}\n{ex.traceback}\n{ex.stderr}"
        )
        return ex

    def interrupt(self) -> None:
        self.km.interrupt_kernel()

    def kill(self) -> None:
        os.kill(self.pid, signal.SIGKILL)

    def shutdown(self) -> None:
        """A normal shutdown (jupyter_client's): every process the kernel's tree ever held must
        be gone after it, the supervisor, warm launchers and fork servers included."""
        self.kc.stop_channels()
        self.km.shutdown_kernel(now=False)  # shutdown_request first, as JupyterLab does
        self.assert_tree_gone()

    def assert_tree_gone(self, timeout: float = 10) -> None:
        self.tree.stop()
        assert wait_for(lambda: not self.tree.alive(), timeout), (
            f"processes the kernel started outlived it: {self.tree.alive()}"
        )


def wait_for(predicate: Any, timeout: float, interval: float = 0.05) -> bool:
    """Poll a liveness bound: True as soon as `predicate()` holds, False after `timeout`."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return bool(predicate())


def job_processes(job_id: str) -> list[str]:
    out = []
    for p in procs.job_processes([job_id]):
        try:
            out.append(f"{p.pid} {' '.join(p.cmdline())[:120]}")
        except Exception:
            out.append(str(p.pid))
    return out


def assert_job_gone(job_id: str) -> None:
    """Nothing carrying the job's marker is alive, right now (no waiting)."""
    left = job_processes(job_id)
    assert not left, f"processes of job {job_id} survived: {left}"


def kill_and_see_the_job_end(k: Kernel, job: str) -> None:
    """SIGKILL the kernel: the job's processes and its supervisor (whose lifeline the kernel
    was) are gone within the teardown's bound."""
    from elastic_nb.common import procs

    assert procs.job_processes([job])
    supervisor = k.supervisor()
    k.kill()
    assert wait_for(lambda: not procs.job_processes([job]), timeout=10), procs.job_processes([job])
    assert wait_for(
        lambda: not supervisor.is_running() or supervisor.status() == psutil.STATUS_ZOMBIE,
        timeout=10,
    )


def pid_ended(pid: int) -> bool:
    """The process has exited (gone, or a zombie its parent has yet to reap)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def free_port() -> int:
    """A TCP port free on 127.0.0.1 a moment ago."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# ---- what a job leaves in its run directory, read from outside --------------------------------


def run_dir(cache_home: Path, job: str, log_dir: Path | None = None) -> Path:
    """A job's run directory: under its --log-dir if it had one, else under the suite's cache
    home (the default)."""
    return (log_dir or cache_home / "elastic_nb" / "runs") / job


def run_summary(cache_home: Path, job: str, log_dir: Path | None = None) -> dict[str, Any]:
    path = run_dir(cache_home, job, log_dir) / "summary.json"
    summary: dict[str, Any] = json.loads(path.read_text())
    return summary


def run_events(cache_home: Path, job: str, log_dir: Path | None = None) -> list[dict[str, Any]]:
    path = run_dir(cache_home, job, log_dir) / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()]


def supervisor_socket(k: Kernel) -> str:
    """The kernel's supervisor's socket, as %elastic status says."""
    m = re.search(r"socket: (\S+)", k.ok("%elastic status").stdout)
    assert m, "no supervisor"
    return m[1]


def ask_supervisor(
    socket_path: str, request: dict[str, Any], timeout: float | None = None
) -> dict[str, Any]:
    """A request to a supervisor over its socket, as another client (the JupyterLab panel's
    way): answered while a cell keeps the kernel busy. Returns the reply."""
    from elastic_nb import protocol

    with socket.socket(socket.AF_UNIX) as s:
        s.settimeout(timeout)
        s.connect(socket_path)
        s.sendall(
            protocol.wire.encode(
                {"kind": "hello", "version": protocol.wire.VERSION, "role": "tool"}
            )
        )
        s.sendall(protocol.wire.encode(request))  # type: ignore[arg-type]
        decoder = protocol.wire.FrameDecoder()
        replies: list[dict[str, Any]] = []
        while len(replies) < 2:
            replies.extend(m for m, _ in decoder.feed(s.recv(65536)))
    return replies[1]


def dashboard_of(
    k: Kernel, job: str, flags: dict[str, Any], keep: str | None = None
) -> tuple[Any, list[dict[str, Any]]]:
    """A job's (or session cell's) dashboard as the kernel's model folds what the supervisor
    sent its renderer (the history the JupyterLab panel reads back), and that history. `flags`:
    the cell's, as job_spec takes them. `keep`: a name to keep the history under, in
    test-output/histories/ (what `history_dashboard` draws again)."""
    path = supervisor_socket(k)
    jobs = ask_supervisor(path, {"kind": "overview", "req": 1})["data"]["jobs"]
    (entry,) = [j for j in jobs if j["id"] == job]
    events = ask_supervisor(path, {"kind": "events", "req": 1, "job": job, "since": 0})["data"]
    history = {
        "job": job,
        "logs_dir": entry["logs_dir"],
        "session": entry["session"],
        "flags": flags,
        "events": events["events"],
    }
    if keep is not None:
        HISTORIES.mkdir(parents=True, exist_ok=True)
        (HISTORIES / f"{keep}.json").write_text(json.dumps(history, indent=1))
    return history_dashboard(history), events["events"]


HISTORIES = Path(__file__).resolve().parent.parent / "test-output" / "histories"


def history_dashboard(history: dict[str, Any]) -> Any:
    """The kernel's dashboard model of a job's history (dashboard_of's), folded as the kernel
    folds it live; its clock starts at the history's first message."""
    from elastic_nb.kernel.dashboard.model import DashboardState
    from elastic_nb.kernel.flags import job_spec

    events = history["events"]
    spec = job_spec(history["flags"])
    state = DashboardState(history["job"], history["logs_dir"], spec, history["session"])
    if events:
        state.header["started"] = events[0]["t"]
    for e in events:
        if e["kind"] == "update":
            state.apply(e)
        elif e["kind"] == "end":
            state.end(e["summary"])
    return state
