"""Every entry of the product's decision tables, one test each, read from the docs' page that
lists them: the variables that need a zygote of a job's own, the exit codes and signals and what
each makes of a rank, the cause classes, the flags a session's cell takes, the reasons a join is
refused, what --rdzv-conf takes, and when a checkpoint step counts. Removing or changing an entry,
in the code or in the docs, fails a test here.

Each decision is driven through the function that makes it, with fakes only below it: the
launcher pool with a zygote and launchers that are records (no process), a checkpoint's commit
with real directories and ranks that are threads."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from signal import SIGABRT, SIGINT, SIGKILL, SIGSEGV, SIGTERM
from typing import Any

import anyio
import pytest
from IPython.core.magic_arguments import parse_argstring

from elastic_nb import protocol
from elastic_nb.checkpoint.commit import Commit
from elastic_nb.checkpoint.directory import Directory, Layout, step_name
from elastic_nb.common import machine, report
from elastic_nb.common.rank_state import RankState
from elastic_nb.common.rundir import RUN_DIR_ENV, RunDir
from elastic_nb.common.spec import JobSpec
from elastic_nb.common.submission import Submission
from elastic_nb.kernel.flags import C10D_CONF, SpecError, job_spec
from elastic_nb.kernel.magic import ElasticMagics
from elastic_nb.kernel.options import OPTIONS, Option
from elastic_nb.kernel.session_handle import SessionHandle, up_options
from elastic_nb.supervisor.forensics.verdict import analyze
from elastic_nb.supervisor.nodes.channel import Dialer, Keys
from elastic_nb.supervisor.nodes.cluster import Cluster
from elastic_nb.supervisor.processes import launcher_pool
from elastic_nb.supervisor.processes.launcher_pool import LauncherPool
from elastic_nb.supervisor.processes.zygote_process import ZygoteFailed
from elastic_nb.supervisor.ranks.checkpoint_log import CheckpointLog
from elastic_nb.supervisor.runs.job import Job
from elastic_nb.supervisor.runs.placement import InRounds
from elastic_nb.supervisor.runs.rounds import Machines
from elastic_nb.supervisor.runs.summary import closing_alerts as summary_alerts
from elastic_nb.supervisor.runs.summary import summarize
from tests import test_checkpoint as checkpoint_tests
from tests.docs_pages import between, every_page
from tests.fake_site import FakeSite

# ---- the zygote: which variables need one of a job's own -------------------------------------


def docs_at_start() -> list[str]:
    """Warm start: 'A job whose environment differs where a running process cannot follow
    (`LD_LIBRARY_PATH`, ...) gets a zygote of its own'."""
    listed = between(
        "howto/warm-start",
        "Warm start and `--preload`",
        "where a running process cannot follow (",
        ")",
    )
    return re.findall(r"`([A-Z_]+)`", listed)


AT_START = docs_at_start()
KERNEL_ENV = {"PATH": "/usr/bin:/bin", "HOME": "/home/me", "LANG": "C.UTF-8"}


class FakeZygote:
    """A zygote as the pool sees it, with no process: ready at once, forks records."""

    def __init__(self, env: dict[str, str], start_key: tuple[str | None, ...], log_path: Path):
        self.env, self.start_key, self.log_path = env, start_key, log_path
        self.pid = 10_000 + len(ZYGOTES)
        self.ready, self.alive = True, True
        ZYGOTES.append(self)

    async def read_ready(self) -> None:
        pass

    async def wait_ready(self) -> None:
        if not self.alive:
            raise ZygoteFailed("the zygote was ended before it was ready")

    def close(self) -> None:
        self.alive = False


class FakeLauncher:
    """A launcher forked by a FakeZygote: what the pool reads of it (its start key, preload and
    sys.path; alive, ready; discarded when the pool ends it)."""

    def __init__(
        self, zygote: FakeZygote, env: dict[str, str], preload: tuple[str, ...], log_path: Path
    ) -> None:
        self.zygote, self.env, self.preload, self.log_path = zygote, env, preload, log_path
        self.sys_path = tuple(json.loads(env.get("ELASTIC_NB_SYS_PATH") or "[]"))
        self.start_key = zygote.start_key
        self.pid = 20_000 + len(ZYGOTES)
        self.ready, self.alive, self.discarded = True, True, False
        self.job: str | None = None
        self.closed = anyio.Event()

    async def read(self) -> None:
        pass

    def discard(self) -> None:
        self.discarded, self.alive = True, False
        self.closed.set()


ZYGOTES: list[FakeZygote] = []  # every zygote the pool started, in order


@pytest.fixture
def pool(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Callable[..., None]]:
    """Runs `scenario(pool)` on a LauncherPool attached for a kernel in `kernel_env`, its zygote
    and launchers the fakes above."""
    monkeypatch.setattr(launcher_pool, "Zygote", FakeZygote)
    monkeypatch.setattr(launcher_pool, "Launcher", FakeLauncher)
    ZYGOTES.clear()

    def run(
        scenario: Callable[[LauncherPool], Awaitable[None]], kernel_env: dict[str, str]
    ) -> None:
        async def main() -> None:
            async with anyio.create_task_group() as tg:
                p = LauncherPool(str(tmp_path / "pool"))
                p.attach(tg, dict(kernel_env))
                try:
                    with anyio.fail_after(10):
                        assert await p.warmed(10), "the pool never warmed a launcher"
                        await scenario(p)
                finally:
                    p.close()
                    tg.cancel_scope.cancel()

        anyio.run(main)

    yield run
    ZYGOTES.clear()


def a_spec(tmp_path: Path, **options: Any) -> JobSpec:
    return job_spec({"nproc": "1", "log_dir": str(tmp_path), **options}, cwd=str(tmp_path))


@pytest.mark.unit
def test_the_docs_list_every_variable_the_pool_starts_a_zygote_for() -> None:
    assert AT_START, "the docs' Warm start no longer lists the variables"
    assert sorted(AT_START) == sorted(launcher_pool._AT_START)


@pytest.mark.unit
@pytest.mark.parametrize("name", AT_START)
@pytest.mark.parametrize(
    ("kernel_value", "job_value"),
    [(None, "/job"), ("/kernel", "/job"), ("/kernel", None)],
    ids=["set-by-the-job", "changed-by-the-job", "unset-by-the-job"],
)
def test_a_job_whose_start_variable_differs_gets_a_zygote_of_its_own(
    pool: Callable[..., None],
    tmp_path: Path,
    name: str,
    kernel_value: str | None,
    job_value: str | None,
) -> None:
    """The warm launcher (a fork of the zygote started in the kernel's environment) cannot
    serve the job: the job's launcher is a fork of a new zygote started with the job's value;
    the next job with that value is warm again, from that same zygote."""
    kernel_env = {**KERNEL_ENV, **({name: kernel_value} if kernel_value else {})}
    job_env = {k: v for k, v in kernel_env.items() if k != name}
    if job_value is not None:
        job_env[name] = job_value
    spec = a_spec(tmp_path)

    async def scenario(p: LauncherPool) -> None:
        warm = p.idle
        assert isinstance(warm, FakeLauncher) and warm.zygote.env.get(name) == kernel_value
        launcher = await p.take(spec, dict(job_env))
        assert isinstance(launcher, FakeLauncher)
        assert launcher is not warm and warm.discarded
        own = launcher.zygote
        assert own is not warm.zygote, f"{name}: forked from the kernel's zygote"
        assert own.env.get(name) == job_value and not warm.zygote.alive
        p.job_ended(spec, started=True)
        assert await p.warmed(10)
        ready = p.idle
        assert await p.take(spec, dict(job_env)) is ready
        assert isinstance(ready, FakeLauncher) and ready.zygote is own

    pool(scenario, kernel_env)
    assert len(ZYGOTES) == 2


@pytest.mark.unit
@pytest.mark.parametrize(
    "name", ["SET_IN_THE_KERNEL", "OMP_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "PYTHONUNBUFFERED"]
)
def test_a_job_whose_environment_differs_elsewhere_takes_the_warm_launcher(
    pool: Callable[..., None], tmp_path: Path, name: str
) -> None:
    """What a rank adopts when it starts (its job's environment) never costs the warm start."""
    spec = a_spec(tmp_path)

    async def scenario(p: LauncherPool) -> None:
        warm = p.idle
        assert await p.take(spec, {**KERNEL_ENV, name: "the job's"}) is warm

    pool(scenario, KERNEL_ENV)
    assert len(ZYGOTES) == 1


@pytest.mark.unit
def test_no_warm_forks_from_a_zygote_of_its_own_and_keeps_none(
    pool: Callable[..., None], tmp_path: Path
) -> None:
    """--no-warm: 'starts this cell's launcher from scratch and keeps none ready for the next'."""
    spec = a_spec(tmp_path, warm=False)

    async def scenario(p: LauncherPool) -> None:
        warm = p.idle
        assert isinstance(warm, FakeLauncher)
        launcher = await p.take(spec, dict(KERNEL_ENV))
        assert isinstance(launcher, FakeLauncher)
        assert launcher is not warm and warm.discarded
        assert launcher.zygote is not warm.zygote and not launcher.zygote.alive
        p.job_ended(spec, started=True)
        assert p.idle is None and p.describe() is None

    pool(scenario, KERNEL_ENV)


@pytest.mark.unit
def test_a_session_takes_the_warm_launcher_only_with_its_preload(
    pool: Callable[..., None], tmp_path: Path
) -> None:
    """A session's ranks are forked from its launcher's server for its whole life: a warm
    launcher that did not import the session's --preload does not serve it (a job's may)."""
    job = a_spec(tmp_path, preload=["json"])
    session = dataclasses.replace(job, session=True)

    async def scenario(p: LauncherPool) -> None:
        warm = p.idle  # made without json: a job's ranks import what the server did not
        assert await p.take(job, dict(KERNEL_ENV)) is warm
        p.job_ended(job, started=True)
        assert await p.warmed(10)
        made_for_json = p.idle
        assert isinstance(made_for_json, FakeLauncher) and made_for_json.preload == ("json",)
        lacking = dataclasses.replace(session, preload=("json", "torch._dynamo"))
        launcher = await p.take(lacking, dict(KERNEL_ENV))
        assert launcher is not made_for_json and made_for_json.discarded
        assert isinstance(launcher, FakeLauncher) and launcher.preload == lacking.preload
        # The session did not make its preload the next cell's: the next warm launcher is made
        # for the last one-off cell.
        p.job_ended(lacking, started=True)
        assert await p.warmed(10)
        ready = p.idle
        assert isinstance(ready, FakeLauncher) and ready.preload == ("json",)
        assert await p.take(session, dict(KERNEL_ENV)) is ready  # it has what the session needs

    pool(scenario, KERNEL_ENV)


# ---- a checkpoint step counts once every rank has written its part ---------------------------


class ThreadRanks:
    """`Ranks` for one of `world` threads: `all_ok` is the MIN all-reduce (and barrier) the
    real one runs on the checkpoint's gloo group."""

    def __init__(self, rank: int, world: int, votes: dict[tuple[int, int], bool], barrier: Any):
        self.rank, self.world, self.group = rank, world, None
        self._votes, self._barrier, self._calls = votes, barrier, 0

    def all_ok(self, ok: bool) -> bool:
        call, self._calls = self._calls, self._calls + 1
        self._votes[(call, self.rank)] = ok
        self._barrier.wait()  # a rank that never comes breaks it (BrokenBarrierError)
        return all(self._votes[(call, r)] for r in range(self.world))


def save_on_threads(
    roots: list[str],
    step: int,
    errors: dict[int, BaseException],
    commit_fails: frozenset[int] = frozenset(),
) -> dict[int, BaseException | None]:
    """Step `step` as `len(roots)` ranks save it, rank R into roots[R] (one directory shared by
    every rank when all roots are the same, else a directory per rank, each rank its own
    node's leader): each writes its part (a file, as DCP would) unless `errors` has what its
    write raised, then runs the real commit (`commit_fails`: ranks whose COMMITTED cannot be
    written). What each rank's save raised."""
    world, shared = len(roots), len(set(roots)) == 1
    groups = ((*range(world),),) if shared else tuple((r,) for r in range(world))
    votes: dict[tuple[int, int], bool] = {}
    barrier = threading.Barrier(world, timeout=30)
    name = step_name(step, "cafe0001")
    raised: dict[int, BaseException | None] = {}

    class Failing(Directory):
        def commit(self, name: str, marker: dict[str, Any], *, fsync: bool) -> None:
            raise OSError(28, "No space left on device")

    def rank(r: int) -> None:
        directory = (Failing if r in commit_fails else Directory)(roots[r])
        layout = Layout(shared, 0 if shared else r, groups)
        error = errors.get(r)
        if error is None:
            os.makedirs(directory.path(name), exist_ok=True)
            Path(directory.path(name, f"__{r}_0.distcp")).write_bytes(b"part")
            if r == layout.leader:
                Path(directory.path(name, ".metadata")).write_bytes(b"metadata")
        barrier.wait()  # DCP's save returns on no rank before every rank has written
        ranks: Any = ThreadRanks(r, world, votes, barrier)
        commit = Commit(directory, ranks, layout, step, name, 0.0, False, 3, False)
        try:
            commit(error)
            raised[r] = None
        except BaseException as e:  # what the rank's save raised, whatever it is
            raised[r] = e

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(raised) == world, "a rank's save never returned"
    return raised


def committed_steps(root: str) -> list[int]:
    """The steps a load would choose from, newest last (what a leader reads before a load)."""
    return [step for step, _, _ in Directory(root).tidy()]


LAYOUTS = {"shared": lambda tmp: [tmp / "ckpt"] * 2, "per-node": lambda tmp: [tmp / "a", tmp / "b"]}


@pytest.mark.unit
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("failing", [0, 1])
def test_a_step_one_rank_could_not_write_counts_on_no_rank(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, layout: str, failing: int
) -> None:
    """'a step counts only once every rank has written its part': one rank's write fails, so
    every rank's save raises, no copy of the step has COMMITTED, and the step before it is the
    newest on every node (the one a load takes)."""
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)  # no record of the saves
    roots = [str(p) for p in LAYOUTS[layout](tmp_path)]
    assert save_on_threads(roots, 1, {}) == {0: None, 1: None}
    assert [committed_steps(root) for root in roots] == [[1], [1]]
    raised = save_on_threads(roots, 2, {failing: OSError(28, "No space left on device")})
    assert isinstance(raised[failing], OSError), raised
    other = raised[1 - failing]
    assert isinstance(other, RuntimeError), raised
    assert "step 2 was not saved: another rank failed to write its part" in str(other)
    for root in roots:
        assert not list(Path(root).glob("step-000000000002-*/COMMITTED")), root
    if layout == "per-node" or failing == 0:  # the failing rank leads its node: it removed
        assert not list(Path(roots[failing]).glob("step-000000000002-*")), "left half-written"
    assert [committed_steps(root) for root in roots] == [[1], [1]]


@pytest.mark.unit
def test_a_step_whose_commit_failed_on_one_node_fails_on_every_rank(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Saving is collective: when one node's leader cannot write COMMITTED, every rank's save
    raises (none goes on to its next collective while another has failed)."""
    monkeypatch.delenv(RUN_DIR_ENV, raising=False)  # no record of the saves
    roots = [str(tmp_path / "a"), str(tmp_path / "b")]
    raised = save_on_threads(roots, 1, {}, commit_fails=frozenset({1}))
    assert all(isinstance(e, RuntimeError) for e in raised.values()), raised
    assert "step 1 was written but not committed: [Errno 28]" in str(raised[1])
    assert "not committed on every node" in str(raised[0])
    assert committed_steps(roots[1]) == []


@pytest.mark.unit
def test_a_committed_step_is_recorded_though_a_peer_is_lost_as_the_ranks_compare(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Rank 0 committed step 14 (a load takes it from then on); a peer's machine went before
    the ranks compared their commits, and that comparison raised. The step is recorded for the
    notebook all the same: the restart's words named step 9 while the next attempt resumed
    from step 14 (the elastic_restarts_and_checkpoints notebook, once in a full run)."""
    run = tmp_path / "run"
    run.mkdir()
    monkeypatch.setenv(RUN_DIR_ENV, str(run))
    root = str(tmp_path / "ckpt")
    name = step_name(14, "cafe0001")
    directory = Directory(root)
    os.makedirs(directory.path(name))
    Path(directory.path(name, ".metadata")).write_bytes(b"metadata")

    class PeerLost:
        rank, world, group = 0, 2, None
        calls = 0

        def all_ok(self, ok: bool) -> bool:
            self.calls += 1
            if self.calls == 2:  # the comparison of the commits
                raise RuntimeError("Connection closed by peer")
            return ok

    ranks: Any = PeerLost()
    commit = Commit(directory, ranks, Layout(True, 0, ((0, 1),)), 14, name, 0.0, False, 3, False)
    with pytest.raises(RuntimeError, match="Connection closed by peer"):
        commit(None)
    assert committed_steps(root) == [14]
    (saved,) = CheckpointLog(run / "checkpoints.jsonl").poll()
    assert (saved["event"], saved["step"]) == ("saved", 14)


# ---- the cause classes ---------------------------------------------------------------------


def docs_causes() -> list[str]:
    """Forensics: 'Every failure ends with a cause class ... and a one-line hint: `exception`,
    ...' (each class's note in parentheses)."""
    listed = between("explanation/forensics", "Cause classes", "hint:", ".")
    return re.findall(r"`([a-z_]+)`", re.sub(r"\([^)]*\)", "", listed))


CAUSES = docs_causes()


def failed_record(t: float, type_: str, message: str) -> dict[str, Any]:
    return {"time": t, "type": type_, "message": message, "cell_line": 2, "traceback": ""}


# How each cause class comes about ("class[, which way]"): the job's outcome, its ranks as the
# supervisor saw them, the zombie watchdog, the ranks a desync verdict found behind, whether too
# few nodes came.
CAUSE_SCENARIOS: dict[str, dict[str, Any]] = {
    "exception": {"ranks": [dict(failure=failed_record(1, "ValueError", "boom"))]},
    "cuda_oom": {
        "ranks": [dict(failure=failed_record(1, "torch.OutOfMemoryError", "CUDA out of memory"))]
    },
    "host_oom": {"ranks": [dict(died_at=1.0, exit_code=-SIGKILL, oom_killed=True)]},
    "collective_timeout": {
        "ranks": [dict(failure=failed_record(1, "RuntimeError", "Timed out waiting 5000ms"))]
    },
    "desync": {
        "ranks": [dict(failure=failed_record(1, "RuntimeError", "Timed out waiting 5000ms")), {}],
        "behind": [1],
    },
    "peer": {
        "ranks": [dict(failure=failed_record(1, "RuntimeError", "Connection closed by peer"))]
    },
    "signal": {"ranks": [dict(died_at=1.0, exit_code=-SIGSEGV)]},
    "exit": {"ranks": [dict(died_at=1.0, exit_code=3)]},
    "zombie": {"ranks": [dict(died_at=1.0, exit_code=-SIGKILL)], "zombie": True},
    # ... and where the agent got stuck before any rank failed (its ranks still running)
    "zombie, no rank failed": {"ranks": [{}], "zombie": True},
    "deadline": {"outcome": "timeout"},
    "interrupted": {"outcome": "stopped"},
    "launcher": {},
    "node_lost": {"ranks": [dict(lost="node 1 (gpu-b) left: its connection dropped")]},
    "nodes": {"nodes_missing": True},
}


def job_summary(tmp_path: Path, scenario: dict[str, Any]) -> dict[str, Any]:
    """The summary a job ends with (what JobFailed.cause and summary.json say), as the job
    makes it from what it saw."""
    rd = RunDir.of(str(tmp_path), "cafe0001")
    ranks = [RankState(0, r, **fields) for r, fields in enumerate(scenario.get("ranks", []))]
    verdict = analyze(ranks, None, scenario.get("behind"), len(ranks))
    return dict(
        summarize(
            job_id="cafe0001",
            spec=a_spec(tmp_path),
            rd=rd,
            outcome=scenario.get("outcome", "failed"),
            reason="what the job decided",
            verdict=verdict,
            attempt=0,
            created=0.0,
            zombie=scenario.get("zombie", False),
            diagnosis=None,
            leftovers=[],
            lines=0,
            memory={},
            checkpoints=CheckpointLog(rd.checkpoints),
            nodes_missing=scenario.get("nodes_missing", False),
        )
    )


@pytest.mark.unit
def test_the_docs_list_every_cause_class_and_each_has_a_hint() -> None:
    assert CAUSES, "the docs' Forensics no longer lists the cause classes"
    assert sorted(CAUSES) == sorted(report.CAUSE_HINTS)
    assert {scenario.split(",")[0] for scenario in CAUSE_SCENARIOS} == set(CAUSES)


@pytest.mark.unit
@pytest.mark.parametrize("scenario", CAUSE_SCENARIOS)
def test_each_cause_class_is_what_its_failure_ends_with(tmp_path: Path, scenario: str) -> None:
    cause = scenario.split(",")[0]
    s = job_summary(tmp_path, CAUSE_SCENARIOS[scenario])
    assert s["cause"] == cause
    if s["failure"] is not None:
        assert s["failure"]["cause"] == cause
    # the failure report says the class's hint
    assert report.CAUSE_HINTS[cause] in "\n".join(report.failure_report(s))  # type: ignore[arg-type]


class NoAgents:
    """A supervisor's cluster that no join agent has joined."""

    addr = "127.0.0.1"

    def __init__(self) -> None:
        self.changed = anyio.Event()

    def ready(self) -> list[Any]:
        return []


class Kernel:
    """The kernel a job sends its messages to: what it was sent, and a wait for a message."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self._more = anyio.Event()  # set (and replaced) at every message

    async def send(self, msg: Any) -> None:
        self.sent.append(dict(msg))
        self._more.set()
        self._more = anyio.Event()

    async def until(self, said: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
        """The first message sent that `said` holds of, once one is."""
        seen = 0
        while True:
            for msg in self.sent[seen:]:
                if said(msg):
                    return msg
            seen = len(self.sent)
            await self._more.wait()

    def chips(self, attempt: int) -> dict[str, dict[str, Any]]:
        """Each rank's chip of `attempt` as the dashboard shows it now (the latest wins)."""
        chips: dict[str, dict[str, Any]] = {}
        for m in self.sent:
            if m["kind"] == protocol.kernel.UPDATE:
                chips.update(
                    {r: c for r, c in m.get("ranks", {}).items() if c["attempt"] == attempt}
                )
        return chips


class LocalSites:
    """This machine's sites of a multi-node job: FakeSites, one a round, made as the job asks."""

    def __init__(self) -> None:
        self.made: list[FakeSite] = []
        self.rd: RunDir | None = None
        self._more = anyio.Event()  # set (and replaced) at every site made

    def __call__(self) -> FakeSite:
        assert self.rd is not None
        self.made.append(FakeSite(self.rd))
        self._more.set()
        self._more = anyio.Event()
        return self.made[-1]

    async def nth(self, n: int) -> FakeSite:
        """The `n`th site made (from 1), once the job has made it."""
        while len(self.made) < n:
            await self._more.wait()
        return self.made[n - 1]


def multi_node_job(tmp_path: Path, **options: Any) -> tuple[Job, LocalSites, Kernel]:
    """A job across machines (`options`: its flags) with no agent joined: this machine's sites
    (FakeSites, one a round, as they are made), and the kernel the job tells."""
    spec = a_spec(tmp_path, **options)
    kernel, sites = Kernel(), LocalSites()

    async def store() -> tuple[Any, int]:
        return None, 0

    machines = Machines(
        cluster=NoAgents(),  # type: ignore[arg-type]
        local=sites,
        store=store,
        end_store=lambda _: None,
    )
    meta = {"display": True, "modules": {}, "objects": [], "pull": []}
    job = Job(Submission("cafe0001", spec, "x = 1\n", meta, None), {}, None, kernel.send, machines)
    sites.rd = job.rd
    job.prepare()
    return job, sites, kernel


def play(job: Job, sites: LocalSites, scene: Callable[[FakeSite], Awaitable[None]]) -> None:
    """Run `job` while `scene` plays its first node's launcher and ranks (20 s at most); a job
    still running when the scene ends is stopped (cancelled, as the supervisor's end does)."""

    async def main() -> None:
        with anyio.fail_after(20):
            async with anyio.create_task_group() as tg:
                tg.start_soon(job.run)
                await scene(await sites.nth(1))
                tg.cancel_scope.cancel()

    anyio.run(main)


def ended(msg: dict[str, Any]) -> bool:
    return msg["kind"] == protocol.kernel.END


@pytest.mark.unit
def test_a_job_whose_nodes_never_came_ends_with_cause_nodes(tmp_path: Path) -> None:
    """--nnodes 2 with no agent joined: the job waits `join_timeout` (1 s here), then fails with
    cause `nodes` and its hint (not the launcher's: none ever started)."""
    job, _, kernel = multi_node_job(tmp_path, nnodes="2", rdzv_conf=["join_timeout=1"])

    async def main() -> None:
        with anyio.fail_after(20):
            await job.run()

    anyio.run(main)
    (end,) = [m for m in kernel.sent if ended(m)]
    s = end["summary"]
    assert (s["outcome"], s["cause"]) == ("failed", "nodes"), s
    assert "only 1 of the 2 nodes it needs were there within 1.0 s" in s["reason"]
    assert report.CAUSE_HINTS["nodes"] in "\n".join(report.failure_report(s))


@pytest.mark.unit
def test_across_machines_the_ranks_a_failed_agent_ended_were_stopped(tmp_path: Path) -> None:
    """torch's agent on the notebook's machine failed (its rendezvous refused a forged state)
    and SIGTERMed its rank; a loaded supervisor saw the rank's death (its chip says it failed)
    before the agent's word. The round failed because the agent did: the rank it ended was
    stopped, not the root (as on one machine)."""
    job, sites, kernel = multi_node_job(tmp_path, nnodes="1:2")

    async def scene(site: FakeSite) -> None:
        site.start_ranks(0, {0: 100})
        await site.heard()
        assert [r.rank for r in job.book.of(0)] == [0]
        failed_at = time.time()
        site.rank_dies(0, 0, -SIGTERM)
        await kernel.until(lambda _: kernel.chips(0).get("0", {}).get("state") == "failed")
        assert job.book.of(0)[0].died_at is not None
        error = "RendezvousStateError: the rendezvous state was not written by this job"
        site.say(protocol.launcher.AGENT_FAILED, error=error, t=failed_at)
        await kernel.until(ended)

    play(job, sites, scene)
    (end,) = [m for m in kernel.sent if ended(m)]
    s = end["summary"]
    assert s["outcome"] == "failed" and s["failure"] is None, s
    assert "torchelastic's agent failed on node 0" in s["reason"], s["reason"]


@pytest.mark.unit
def test_the_ranks_a_round_change_stopped_show_so_though_a_status_is_untold(tmp_path: Path) -> None:
    """A round ended for the next (a node left, one joined): its ranks' chips in the timeline
    say "stopped for the next round", also the one whose exit status its node had not told yet
    when the stop ended (a forked rank's comes from its launcher, which went with the round).
    None stays "running" in an attempt that is over (test_multinode, once in a full run)."""
    job, sites, kernel = multi_node_job(tmp_path, nnodes="1:2", start_method="forkserver")
    chips: dict[str, dict[str, Any]] = {}

    async def scene(site: FakeSite) -> None:
        site.start_ranks(0, {0: 100, 1: 101})
        await site.heard()
        assert [r.rank for r in job.book.of(0)] == [0, 1]
        site.untold_at_stop = {1}  # rank 0's status told at once, rank 1's late
        assert isinstance(job.placement, InRounds)
        job.placement.new_round("node-2 left", counted=False)
        await sites.nth(2)  # the next round has begun
        chips.update(kernel.chips(0))

    play(job, sites, scene)
    assert {r: (c["state"], c["label"]) for r, c in chips.items()} == {
        r: ("stopped", "stopped for the next round") for r in ("0", "1")
    }, chips


# ---- the flags a session's cell takes --------------------------------------------------------


def docs_cell_flags() -> list[str]:
    """Sessions: 'a bare `%%elastic` runs on it, and so does one with only a cell's own flags:
    `--push`, ... A launch flag (...) is refused'."""
    listed = between(
        "howto/sessions", "What a session's cell takes", "only a cell's own flags:", "A launch"
    )
    return re.findall(r"`(--[a-z-]+)`", listed)


CELL_FLAGS = docs_cell_flags()


def option_of(flag: str) -> Option:
    (option,) = [o for o in OPTIONS if flag in o.flags]
    return option


def parsed(flag: str) -> dict[str, Any]:
    """What the magic's parser makes of `flag` (with a value where it takes one)."""
    option = option_of(flag)
    value = "1" if option.metavar else ""
    return dict(vars(parse_argstring(ElasticMagics.elastic, f"{flag} {value}".strip())))


class NoSupervisor:
    def subscribe(self, _: str) -> object:
        return object()


def a_session(tmp_path: Path) -> SessionHandle:
    return SessionHandle(NoSupervisor(), a_spec(tmp_path), {"nproc": "2"})  # type: ignore[arg-type]


@pytest.mark.unit
def test_the_docs_list_every_flag_a_session_cell_takes() -> None:
    assert CELL_FLAGS, "the docs' Sessions page no longer lists a cell's own flags"
    per_cell = [o.flags[0] for o in OPTIONS if o.per_cell]
    # --one-off is a cell's own flag too: it runs the cell beside the session, not on it
    assert sorted([*CELL_FLAGS, "--one-off"]) == sorted(per_cell)


@pytest.mark.unit
@pytest.mark.parametrize("flag", CELL_FLAGS)
def test_a_cell_on_a_session_takes_its_own_flag(tmp_path: Path, flag: str) -> None:
    options = parsed(flag)
    assert a_session(tmp_path).cell_options(options, {}) == {"nproc": "2", **options}


LAUNCH_FLAGS = [o.flags[0] for o in OPTIONS if o.flags[0] not in (*CELL_FLAGS, "--one-off")]


@pytest.mark.unit
@pytest.mark.parametrize("flag", LAUNCH_FLAGS)
def test_a_cell_on_a_session_refuses_a_launch_flag(tmp_path: Path, flag: str) -> None:
    session = a_session(tmp_path)
    with pytest.raises(ValueError, match=r"session \w+ is up") as refused:
        session.cell_options(parsed(flag), {})
    said = str(refused.value)
    assert said.startswith(f"{flag}: session {session.id} is up")
    takes = said.split("a cell on it takes only ")[1].split(". ")[0].split(", ")
    assert sorted(takes) == sorted(CELL_FLAGS)
    assert "%%elastic --one-off" in said


@pytest.mark.unit
@pytest.mark.parametrize("flag", [o.flags[0] for o in OPTIONS])
def test_config_defaults_reach_a_session_cell_only_for_a_cells_own_flags(
    tmp_path: Path, flag: str
) -> None:
    """'`%elastic config` defaults for those per-cell flags apply to a session's cells too'; a
    launch flag's default is not the session's: its ranks were launched with their own."""
    default = parsed(flag)
    got = a_session(tmp_path).cell_options({}, default)
    if flag in (*CELL_FLAGS, "--one-off"):
        assert got == {"nproc": "2", **default}
    else:
        assert got == {"nproc": "2"}


# What %elastic up refuses: what only one cell's run can use (what travels with it, whether a
# restart replays it, --one-off and --bg); every other flag launches the session's ranks or is a
# default for its cells (--no-widgets, --timeout, --hang-after, --memory-history).
UP_REFUSES = {"--push", "--pull", "--pull-rank", "--no-replay", "--one-off", "--bg"}


@pytest.mark.unit
@pytest.mark.parametrize("flag", [o.flags[0] for o in OPTIONS])
def test_elastic_up_refuses_exactly_a_single_cells_flags(flag: str) -> None:
    options = parsed(flag)
    if flag in UP_REFUSES:
        with pytest.raises(ValueError, match=f"%elastic up {flag}: a cell's flag"):
            up_options(options, {})
    else:
        assert up_options(options, {"max_restarts": "0"}) == options


# ---- the reasons a join is refused -----------------------------------------------------------


def docs_join_checks() -> list[str]:
    """Across machines: 'A machine whose Python (minor), torch (major.minor) or elastic_nb
    version differs from the notebook's is refused at join with both named'."""
    listed = between("howto/multinode", "The agent", "A machine whose ", " differs from the")
    return re.split(r", | or ", listed)


JOIN_CHECKS = docs_join_checks()
NOTEBOOK = {"python": "3.11.9", "torch": "2.13.0+cpu", "elastic_nb": "0.1.0"}
# Per entry the docs list: the field, a version that differs only below what is compared (admitted),
# one that differs in what is (refused).
JOIN_VERSIONS = {
    "Python (minor)": ("python", "3.11.2", "3.12.9"),
    "torch (major.minor)": ("torch", "2.13.1+cu126", "2.14.0+cpu"),
    "elastic_nb version": ("elastic_nb", None, "0.1.1"),
}


def node_info(**versions: str) -> dict[str, Any]:
    info = {"name": "gpu-b", "addr": "10.0.0.6", "pid": 1, "cpus": 8, "gpus": [], "cuda": None}
    return {**info, "workdir": "/tmp", **NOTEBOOK, **versions}


@pytest.mark.unit
def test_the_docs_list_every_version_a_join_compares() -> None:
    assert sorted(JOIN_CHECKS) == sorted(JOIN_VERSIONS)


@pytest.mark.unit
@pytest.mark.parametrize("check", JOIN_CHECKS)
def test_a_machine_whose_version_differs_is_refused_with_both_named(check: str) -> None:
    field, same, other = JOIN_VERSIONS[check]
    ours = node_info()
    why = machine.mismatch(ours, node_info(**{field: other}))  # type: ignore[arg-type]
    assert why is not None, f"{check}: {other} against {NOTEBOOK[field]} was admitted"
    assert f"{other} (the notebook's is {NOTEBOOK[field]})" in why
    if same is not None:
        assert machine.mismatch(ours, node_info(**{field: same})) is None  # type: ignore[arg-type]


@pytest.mark.unit
def test_an_agent_speaking_another_protocol_is_refused_and_one_that_matches_joins() -> None:
    """The supervisor's side of a join, over the agents' channel as a join agent reaches it (its
    token, the handshake, its hello): a hello in another protocol version (another elastic_nb)
    is answered with a refusal naming both; one that matches is welcomed, and `%elastic nodes`
    lists the one and the other."""
    answers: dict[str, dict[str, Any]] = {}
    listed: dict[str, Any] = {}

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            cluster = Cluster(tg)
            await cluster.serve("127.0.0.1", 0)
            assert cluster.listener is not None
            token, port = cluster.listener.keys.token(), cluster.listener.port
            dialers: list[Dialer] = []

            async def join(name: str, version: int) -> dict[str, Any]:
                """A join agent on `name` says hello in protocol `version`: the answer."""
                dialer = Dialer(Keys.from_token(token), "127.0.0.1", port)
                dialers.append(dialer)
                await dialer.handshake()
                hello = protocol.agents.NodeHello(
                    kind=protocol.agents.NODE_HELLO,
                    version=version,
                    info={**cluster.info, "name": name},
                )
                await dialer.send(hello)
                frame, _ = await dialer.receive()
                return dict(protocol.agents.node_order(frame))

            try:
                with anyio.fail_after(10):
                    answers["old"] = await join("gpu-a", protocol.wire.VERSION - 1)
                    answers["same"] = await join("gpu-b", protocol.wire.VERSION)
                listed.update(cluster.describe())  # with both agents still connected
            finally:
                for dialer in dialers:
                    dialer.close()
                tg.cancel_scope.cancel()

    anyio.run(main)
    refused, welcome = answers["old"], answers["same"]
    assert (refused["kind"], welcome["kind"]) == (protocol.agents.REFUSED, protocol.agents.WELCOME)
    assert (
        f"speaks protocol {protocol.wire.VERSION - 1}, the notebook's {protocol.wire.VERSION}"
        in (refused["error"])
    )
    assert [(a["name"], a["state"]) for a in listed["agents"]] == [("gpu-b", "ready")]
    assert welcome["node"] == listed["agents"][0]["node"]
    assert [(r["name"], r["addr"].split(":")[0]) for r in listed["refused"]] == [
        ("gpu-a", "127.0.0.1")
    ]


# ---- what --rdzv-conf takes --------------------------------------------------------------------


def docs_rdzv_conf() -> list[str]:
    """Across machines: '`--rdzv-conf` takes what c10d reads (`join_timeout`, ...); `timeout=`
    is refused: c10d ignores it'."""
    listed = between(
        "howto/multinode",
        "How a job runs on several machines",
        "`--rdzv-conf` takes what c10d reads (",
        ")",
    )
    return re.findall(r"`([a-z_]+)`", listed)


RDZV_CONF = docs_rdzv_conf()


@pytest.mark.unit
def test_the_docs_list_every_rdzv_conf_setting() -> None:
    assert sorted(RDZV_CONF) == sorted(C10D_CONF)


@pytest.mark.unit
@pytest.mark.parametrize("key", RDZV_CONF)
def test_rdzv_conf_takes_each_setting_c10d_reads(tmp_path: Path, key: str) -> None:
    assert a_spec(tmp_path, rdzv_conf=[f"{key}=5"]).rdzv_conf == {key: "5"}


@pytest.mark.unit
@pytest.mark.parametrize(
    ("pair", "said"),
    [
        ("timeout=60", "c10d rendezvous ignores it"),
        ("joint_timeout=60", "not a setting of the c10d rendezvous"),
    ],
)
def test_rdzv_conf_refuses_what_c10d_does_not_read(tmp_path: Path, pair: str, said: str) -> None:
    with pytest.raises(SpecError, match=said):
        a_spec(tmp_path, rdzv_conf=[pair])


# ---- exit codes and signals: what each makes of a rank -----------------------------------------


def a_rank(rank: int, **fields: Any) -> RankState:
    return RankState(0, rank, **fields)


# A rank that ended on its own, by each way a rank can: (the docs' words for it, the rank as the
# supervisor saw it, its kind, the cause class it gives the job, its words in the report).
OWN_ENDS: dict[str, tuple[str, dict[str, Any], str, str, str]] = {
    "exit 0 early": (
        "A rank that exits with code 0 without finishing the cell (`os._exit(0)`) is a failure",
        dict(died_at=2.0, exit_code=0),
        "exit0",
        "exit",
        "exited with code 0 before finishing the cell (os._exit?)",
    ),
    "exit code": (
        "`exit`",
        dict(died_at=2.0, exit_code=3),
        "exit",
        "exit",
        "exited with code 3",
    ),
    "sys.exit": (
        "`exit`",
        dict(failure=failed_record(2, "SystemExit", "3"), died_at=2.1, exit_code=3),
        "exit",
        "exit",
        "SystemExit: 3 (cell line 2)",
    ),
    "SIGKILL by the OOM killer": (
        "`host_oom` (SIGKILL while the cgroup's `oom_kill` count rose)",
        dict(died_at=2.0, exit_code=-SIGKILL, oom_killed=True, rss_peak=2 * 2**30),
        "host_oom",
        "host_oom",
        "killed by SIGKILL from the kernel's OOM killer (host memory; it peaked at 2.0 GiB",
    ),
    "SIGKILL": (
        "a SIGKILL stays `signal`",
        dict(died_at=2.0, exit_code=-SIGKILL),
        "signal",
        "signal",
        "killed by SIGKILL",
    ),
    "SIGSEGV": (
        "Fatal signals (SIGSEGV, SIGABRT)",
        dict(died_at=2.0, exit_code=-SIGSEGV),
        "signal",
        "signal",
        "killed by SIGSEGV",
    ),
    "SIGABRT": (
        "Fatal signals (SIGSEGV, SIGABRT)",
        dict(died_at=2.0, exit_code=-SIGABRT),
        "signal",
        "signal",
        "killed by SIGABRT",
    ),
    "its machine left": (
        "`node 1 (gpu-b) rank 3 was lost: node 1 (gpu-b) left: its connection dropped`",
        dict(lost="node 1 (gpu-b) left: its connection dropped", died_at=2.0),
        "lost",
        "node_lost",
        "was lost: node 1 (gpu-b) left: its connection dropped",
    ),
    "an exception": (
        "`exception`",
        dict(failure=failed_record(2, "ValueError", "boom")),
        "exception",
        "exception",
        "ValueError: boom (cell line 2)",
    ),
    "a CUDA OOM": (
        "`cuda_oom`",
        dict(failure=failed_record(2, "torch.OutOfMemoryError", "CUDA out of memory")),
        "oom",
        "cuda_oom",
        "torch.OutOfMemoryError: CUDA out of memory (cell line 2)",
    ),
}


@pytest.mark.unit
@pytest.mark.parametrize("end", OWN_ENDS)
def test_a_rank_that_ended_on_its_own_is_the_root_whatever_its_peers_said(end: str) -> None:
    """Each way a rank can end on its own: its kind, the job's cause and the words the report
    gives it; and it is the root even when a peer's 'connection closed' came earlier (that
    peer saw it die)."""
    promise, fields, kind, cause, words = OWN_ENDS[end]
    assert promise in every_page(), f"the docs no longer say: {promise}"
    r = a_rank(1, **fields)
    assert r.kind(None) == kind
    assert r.failure_summary().startswith(words)
    peer = a_rank(0, failure=failed_record(1.5, "RuntimeError", "Connection closed by peer"))
    v = analyze([peer, r], None)
    assert v.root is r and v.cause == cause
    assert [(o["rank"], o["kind"]) for o in v.others] == [(0, "peer")]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("signal_name", "code"), [("SIGTERM", -SIGTERM), ("SIGINT", -SIGINT), ("SIGKILL", -SIGKILL)]
)
def test_a_rank_stopped_after_another_failed_is_a_consequence(signal_name: str, code: int) -> None:
    """SIGTERM, SIGINT or SIGKILL after another rank failed: torchelastic's agent stopping the
    group (the docs: 'rank 0: stopped by elastic_nb (SIGTERM) after rank 1 failed' once the
    teardown began), never the root."""
    culprit = a_rank(1, failure=failed_record(1.0, "ValueError", "boom"))
    stopped = a_rank(0, died_at=1.2, exit_code=code)
    v = analyze([stopped, culprit], None)
    assert v.root is culprit and v.cause == "exception", signal_name
    (other,) = v.others
    assert other["text"] in (
        f"stopped by the torchelastic agent ({signal_name}) after rank 1 failed",
        "ended with its parent (torch's parent-death signal, SIGINT) after rank 1 failed",
    )
    # ... and, once elastic_nb's teardown began, stopped by elastic_nb
    v = analyze([stopped, culprit], teardown_at=1.1)
    assert v.root is culprit and v.others[0]["kind"] == "terminated"
    if signal_name != "SIGINT":
        assert v.others[0]["text"] == f"stopped by elastic_nb ({signal_name}) after rank 1 failed"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("seen", "root", "rank_1"),
    [
        ("before anyone would send SIGKILL", 1, "signal"),
        ("after elastic_nb sent it SIGKILL", 0, "terminated"),
        ("after the window", 0, "terminated"),
    ],
)
def test_a_sigkill_seen_after_a_peers_error_began_the_teardown(
    seen: str, root: int, rank_1: str
) -> None:
    """Rank 1 died of SIGKILL; rank 0's 'connection reset by peer' was read first and began the
    teardown (1.1), so rank 1 is seen gone after it. No one stopping a group sends SIGKILL
    sooner than a grace after SIGTERM: within the rank's kill window (0.5 s) the SIGKILL is its
    own, unless elastic_nb sent it (a session ends stuck ranks with SIGKILL at once)."""
    died_at = 1.7 if seen == "after the window" else 1.2
    r = a_rank(1, died_at=died_at, exit_code=-SIGKILL, kill_window=0.5)
    r.killed = seen.startswith("after elastic_nb")
    peer = a_rank(0, failure=failed_record(1.05, "RuntimeError", "Connection reset by peer"))
    v = analyze([peer, r], teardown_at=1.1)
    assert v.root is not None and v.root.rank == root
    assert r.kind(1.1) == rank_1


@pytest.mark.unit
def test_a_rank_ended_by_sigint_went_with_its_parent() -> None:
    """torch gives every rank PDEATHSIG=SIGINT: a rank ended by SIGINT went because its
    launcher (or fork server) did; the rank that failed is the root even if later."""
    gone = a_rank(0, died_at=1.0, exit_code=-SIGINT)
    culprit = a_rank(1, failure=failed_record(2.0, "ValueError", "boom"))
    assert gone.kind(None) == "terminated"
    assert analyze([gone, culprit], None).root is culprit


@pytest.mark.unit
def test_a_rank_interrupted_in_a_session_cell_is_no_failure_of_its_own() -> None:
    """KeyboardInterrupt in the cell: elastic_nb interrupted it after another rank raised."""
    interrupted = a_rank(0, failure=failed_record(1.0, "KeyboardInterrupt", ""))
    culprit = a_rank(1, failure=failed_record(2.0, "ValueError", "boom"))
    assert interrupted.kind(None) == "terminated"
    v = analyze([interrupted, culprit], None)
    assert v.root is culprit and v.others[0]["text"].startswith("interrupted by elastic_nb")


@pytest.mark.unit
def test_sigabrts_after_a_collective_timeout_are_its_consequences() -> None:
    """'SIGABRTs after a timeout are its consequences' (NCCL aborts every rank)."""
    timed_out = a_rank(1, failure=failed_record(1.0, "RuntimeError", "Timed out waiting 5000ms"))
    aborted = a_rank(0, died_at=61.0, exit_code=-SIGABRT)
    v = analyze([aborted, timed_out], None)
    assert v.root is timed_out and v.cause == "collective_timeout"
    assert v.others[0]["text"] == "aborted by NCCL (SIGABRT) after the collective timeout"
    # one before any timeout is a failure of its own
    v = analyze([a_rank(0, died_at=0.5, exit_code=-SIGABRT), timed_out], None)
    assert v.cause == "signal"


@pytest.mark.unit
@pytest.mark.parametrize(
    ("code", "alerted"),
    [
        (0, False),
        (None, False),
        (-SIGTERM, False),
        (-SIGKILL, False),
        (1, True),
        (-SIGSEGV, True),
        (-SIGABRT, True),
    ],
)
def test_after_a_success_only_an_exit_the_agent_did_not_cause_is_alerted(
    code: int | None, alerted: bool
) -> None:
    """A rank that finished the cell and then exited 0, or was ended by the agent closing the
    group (SIGTERM, SIGKILL), is no news; any other end while exiting is a warning."""
    finished = a_rank(0, done={"time": 1.0}, died_at=1.5, exit_code=code)
    s: Any = {"outcome": "succeeded", "failure": None}
    alerts = summary_alerts(s, [finished], [])
    titles = [a["title"] for a in alerts if a["kind"] == "exit_after_done"]
    if alerted:
        assert titles == [
            f"rank 0 finished the cell, then {report.describe_exit(code)} while exiting"
        ]
    else:
        assert titles == []


@pytest.mark.unit
def test_how_a_process_ended_in_words() -> None:
    """The chips' and reports' words: 'killed by SIGKILL', 'exited with code 3'."""
    assert report.describe_exit(-SIGKILL) == "killed by SIGKILL"
    assert report.describe_exit(-SIGSEGV) == "killed by SIGSEGV"
    assert report.describe_exit(3) == "exited with code 3"
    assert report.describe_exit(None) == "exited (status unknown)"


# In real ranks (elastic_launch, gloo, DCP: tests/test_checkpoint.py's launcher), a directory per
# rank, as two nodes without shared storage: each node's lowest rank writes its node's copy alone.
ONE_WRITE_FAILS = """
import errno
import torch.distributed.checkpoint.filesystem as dcp_files

DIRECTORY = os.environ["DIRS"].split(",")[RANK]
torch.manual_seed(0)
model = nn.parallel.DistributedDataParallel(nn.Linear(4, 2))
ckpt = checkpoint.Checkpoints(DIRECTORY)
ckpt.save(1, model)
if RANK == 1:
    # Rank 1's disk is full: DCP's write of its copy of step 2 fails.
    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")
    dcp_files._write_item = full
try:
    ckpt.save(2, model)
    error = None
except BaseException as e:  # DCP's CheckpointException is one
    error = f"{type(e).__name__}: {e}"
emit("saved", {"error": error, "listing": listing(DIRECTORY)})
step = ckpt.load(model)
emit("loaded", {"step": step, "steps": ckpt.steps(), "shared": ckpt.shared})
"""


@pytest.fixture(scope="module")
def dcp_launcher(tmp_path_factory: pytest.TempPathFactory) -> Iterator[checkpoint_tests.Launcher]:
    launcher = checkpoint_tests.Launcher(tmp_path_factory.mktemp("launcher"))
    yield launcher
    launcher.close()


@pytest.mark.e2e
def test_a_step_one_node_could_not_write_is_committed_and_loaded_nowhere(
    dcp_launcher: checkpoint_tests.Launcher, tmp_path: Path
) -> None:
    """Without shared storage nothing of DCP's own gathers the nodes' writes: the commit alone
    keeps rank 0's whole copy of step 2 from counting when rank 1's copy failed. Both saves
    raise, no copy has COMMITTED, and both ranks load step 1."""
    dirs = f"{tmp_path / 'a'},{tmp_path / 'b'}"
    dcp_launcher.start(tmp_path, ONE_WRITE_FAILS, [{"nproc": 2, "env": {"DIRS": dirs}}]).wait()
    saved = checkpoint_tests.emitted(tmp_path, "saved", 2)
    assert "No space left on device" in saved[1]["error"], saved
    assert "step 2 was not saved: another rank failed to write its part" in saved[0]["error"]
    for rank in (0, 1):
        steps = {n: files for n, files in saved[rank]["listing"].items() if n.startswith("step-")}
        assert all("COMMITTED" not in files for n, files in steps.items() if "0002-" in n), steps
    loaded = checkpoint_tests.emitted(tmp_path, "loaded", 2)
    assert loaded == [{"step": 1, "steps": [1], "shared": False}] * 2, loaded


# ---- the memory outlier a hang alert names (diagnosis.memory_words) ---------------------------


@pytest.mark.unit
@pytest.mark.parametrize(
    ("held", "said"),
    [
        ({0: 100 << 20, 1: 450 << 20}, "; rank 1 holds 4.5× the others' host memory (450 MiB)"),
        ({0: 100 << 20, 1: 199 << 20}, ""),  # under twice: not an outlier
        ({0: 100 << 20, 1: 200 << 20}, "; rank 1 holds 2.0× the others' host memory (200 MiB)"),
        ({0: 100 << 20, 1: 110 << 20, 2: 900 << 20, 3: 105 << 20}, "; rank 2 holds 8.6×"),
        ({0: 100 << 20, 1: None}, ""),  # one rank measured: nothing to compare
        ({}, ""),
    ],
)
def test_a_memory_outlier_is_named_where_it_stands_out(held: dict, said: str) -> None:
    from elastic_nb.supervisor.runs.diagnosis import memory_words

    words = memory_words(held)
    assert words.startswith(said) and (bool(words) == bool(said)), words
