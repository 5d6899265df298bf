"""The supervisor's side of a join agent (supervisor/nodes/remote_site.py, cluster.py), below the
channel: what a bug of ours or a silent agent may cost is one message, one task or one site's
answer, never the supervisor (whose teardowns need the cluster's tasks to hear their agents).
The agents themselves, over the real channel, are tests/test_multinode.py's."""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import Any

import anyio
import psutil
import pytest
from anyio.abc import ByteStream

from elastic_nb import protocol
from elastic_nb.common import machine
from elastic_nb.common.rank_state import RankState
from elastic_nb.common.rundir import RunDir
from elastic_nb.kernel.flags import job_spec
from elastic_nb.supervisor.nodes import remote_site
from elastic_nb.supervisor.nodes.agent_link import JoinAgentLink
from elastic_nb.supervisor.nodes.cluster import Cluster
from elastic_nb.supervisor.nodes.remote_site import RemoteSite
from elastic_nb.supervisor.processes.site import Work

pytestmark = pytest.mark.unit


async def _site(tmp_path: Path, sent: list[Any], attempt: int = 0) -> RemoteSite:
    """Round `attempt` of group g1 started on an agent that opens the round it is ordered to
    and answers no other order (`sent`: every order it took)."""

    async def send(peer: bytes, msg: protocol.Message, blob: bytes | None) -> bool:
        sent.append(msg)
        if msg["kind"] == protocol.agents.OPEN:
            opened = {"warm": False, "launcher": 4242}
            answer = protocol.agents.Answer(
                kind=protocol.agents.ANSWER, req=msg["req"], ok=True, data=opened
            )
            link.dispatch(answer, None)
        return True

    link = JoinAgentLink(send, lambda *a: None, b"peer", 1, machine.describe("10.0.0.2", ""), "x:1")
    site = RemoteSite(RunDir(str(tmp_path)), link, 0, None, {})
    spec = job_spec({"nproc": "2", "nnodes": "1:2", "log_dir": str(tmp_path)}, cwd=str(tmp_path))
    plan = protocol.launcher.LaunchRound(
        attempt=attempt,
        nnodes=2,
        run_id="g1",
        endpoint="127.0.0.1:29400",
        addr="10.0.0.2",
        ifname="eth0",
        key="00",
    )
    with anyio.fail_after(10):
        assert await site.start(Work("g1", spec, {}, plan)) is False  # a cold launcher took it
    assert site.launcher_pid == 4242 and site.launcher_alive()
    return site


def _said(site: RemoteSite, msg: dict[str, Any], round: int = 0) -> None:
    """The agent tells what the site's launcher said in `round`."""
    said = protocol.agents.LauncherSaid(
        kind=protocol.agents.LAUNCHER, group="g1", round=round, msg=msg
    )
    site.link.dispatch(said, None)


def _started(rank: int, attempt: int = 0) -> dict[str, Any]:
    return {"kind": "start", "attempt": attempt, "rank": rank, "pid": 100 + rank}


def test_a_rounds_news_that_nobody_reads_any_more_is_dropped(tmp_path: Path) -> None:
    """The group's reader ended (its tasks cancelled by a bug of ours): the agent's news for it
    must not raise in the cluster's receive loop, which every agent's messages go through; and
    what it said is still known: the rank it started goes with its node."""

    async def main() -> None:
        site = await _site(tmp_path, [])
        reader = site.messages()
        _said(site, _started(1))
        assert await reader.__anext__() == _started(1)  # the group's reader took it
        await reader.aclose()  # the group's reader ended
        _said(site, _started(0))  # raised BrokenResourceError
        site.link.gone("lost", "connection lost")
        r = RankState(0, 0, pid=100)
        with anyio.fail_after(5):
            gone_at, _ = await site.wait_gone(r)
        assert gone_at == site.link.last_heard_wall and not site.alive(r)
        assert r.lost == "its node left: connection lost"

    anyio.run(main)


def test_a_closed_rounds_late_news_is_not_taken_as_the_next_rounds(tmp_path: Path) -> None:
    """A group's rounds on an agent share its id: the agent can send the last word of a round's
    launcher (its exit, after the mirror's sweep) after the supervisor has closed that round and
    opened the next there. Taken as the new launcher's exit, it failed a round that had just
    begun ("torchelastic gave up: launcher received SIGTERM", the old launcher's end) and spent
    a restart (test_notebooks, once in a full run). Each piece of news names its round; another
    round's is dropped, the site's own is taken."""

    async def main() -> None:
        # the round after a join: the agent still tells of round 1
        site = await _site(tmp_path, [], attempt=2)
        link, group = site.link, "g1"
        late: list[protocol.agents.NodeNews] = [
            protocol.agents.LauncherSaid(
                kind=protocol.agents.LAUNCHER, group=group, round=1, msg=_started(1, attempt=1)
            ),
            protocol.agents.RankGone(
                kind=protocol.agents.RANK_GONE,
                group=group,
                round=1,
                attempt=1,
                rank=1,
                t=0.0,
                code=-15,
            ),
            protocol.agents.MemoryRead(
                kind=protocol.agents.MEMORY,
                group=group,
                round=1,
                rss={"1": 5},
                gpu={},
                limit=None,
                gpus=False,
            ),
            protocol.agents.LauncherExit(
                kind=protocol.agents.LAUNCHER_EXIT,
                group=group,
                round=1,
                outcome="failed",
                reason="torchelastic gave up: launcher received SIGTERM",
            ),
        ]
        for msg in late:
            link.dispatch(msg, None)
        beat = protocol.agents.GroupBeat(
            round=1,
            launcher=100,
            launcher_alive=False,
            state=None,
            tick_age=None,
            running=False,
            zombies=[[1, 1]],
            oom_kills=3,
        )
        link.dispatch(
            protocol.agents.Beat(kind=protocol.agents.BEAT, t=0.0, groups={group: beat}), None
        )
        log = tmp_path / "launcher.log"
        outcome = site.launcher_outcome(log)
        assert site.launcher_alive() and outcome[0] == "failed"
        assert "never reported" in outcome[1], outcome
        r = RankState(1, 1, pid=100)
        assert site.alive(r)  # its going, told late, is none of this round's
        # No beat of round 1 taken: no zombie, no OOM count, the launcher as the open left it
        assert not site.unreaped(r) and site.oom_kills() is None and site.running()
        assert site.read_memory([r]).rss == {}

        own = protocol.agents.LauncherExit(
            kind=protocol.agents.LAUNCHER_EXIT,
            group=group,
            round=2,
            outcome="succeeded",
            reason="every rank finished",
        )
        link.dispatch(own, None)
        with anyio.fail_after(5):
            await site.launcher_exited()
            told = [msg async for msg in site.messages()]
        assert told == []  # nothing of round 1 reached the group's reader, its start neither
        assert not site.launcher_alive() and site.launcher_outcome(log) == (
            "succeeded",
            f"{site.label}: every rank finished",
        )

    anyio.run(main)


def test_a_stop_the_agent_never_answers_is_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A teardown is shielded from cancellation: a stop waiting forever on an agent that takes
    the order and never answers would hold the supervisor forever."""
    monkeypatch.setattr(remote_site, "ANSWER_S", 0.2)

    async def main() -> None:
        sent: list[Any] = []
        site = await _site(tmp_path, sent)
        started = time.monotonic()
        with anyio.fail_after(10, shield=True):  # as a teardown's; failing, not hanging
            survivors = await site.stop(0.1, lambda sig, pids: None)
        assert survivors == []
        assert [m["kind"] for m in sent] == [protocol.agents.OPEN, protocol.agents.STOP]
        assert time.monotonic() - started < 5

    anyio.run(main)


def test_a_task_for_an_agent_that_fails_ends_alone(caplog: pytest.LogCaptureFixture) -> None:
    """Cluster.spawn runs in the supervisor's own task group: a failing task is logged and
    every other task of the supervisor runs on."""
    ran = []
    failing = anyio.Event()

    async def broken() -> None:
        failing.set()
        raise RuntimeError("a bug of ours")

    async def fine() -> None:
        await failing.wait()  # runs on once the other has failed
        ran.append("fine")

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            cluster = Cluster(tg)
            cluster.spawn(broken)
            cluster.spawn(fine)

    with caplog.at_level(logging.ERROR):
        anyio.run(main)
    assert ran == ["fine"]
    assert "a task for an agent failed" in caplog.text and "a bug of ours" in caplog.text


@pytest.mark.parametrize("host", ["192.0.2.1", "elastic-nb-nowhere.invalid"])
def test_an_address_no_interface_here_holds_is_refused_before_anyone_joins(host: str) -> None:
    """`--host` names this machine, as the agents reach it, and the ranks listen on the
    interface holding it: an address of another machine (or a name that resolves to none) is
    refused at once, with nothing listening."""
    errors: list[BaseException] = []

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            cluster = Cluster(tg)
            try:
                await cluster.serve(host, 0)
            except (ValueError, OSError) as e:
                errors.append(e)
            assert cluster.listener is None
            tg.cancel_scope.cancel()

    anyio.run(main)
    assert len(errors) == 1, errors
    if host == "192.0.2.1":
        assert "no network interface of this machine has the address 192.0.2.1" in str(errors[0])


def test_a_name_of_this_machine_is_taken_as_its_address() -> None:
    async def main() -> None:
        async with anyio.create_task_group() as tg:
            cluster = Cluster(tg)
            await cluster.serve("localhost", 0)
            assert cluster.addr == "127.0.0.1"
            assert cluster.listener is not None and cluster.listener.host == "127.0.0.1"
            assert "elastic-nb join 127.0.0.1:" in cluster.join_command()
            tg.cancel_scope.cancel()
        cluster.listener.close()

    anyio.run(main)


def test_without_a_host_the_agents_port_is_on_the_primary_address_alone() -> None:
    """Not every interface: the address the join command names (the default route's)."""

    async def main() -> None:
        async with anyio.create_task_group() as tg:
            cluster = Cluster(tg)
            await cluster.serve(None, 0)
            assert cluster.listener is not None
            assert cluster.listener.host == machine.primary_address() == cluster.addr
            assert f"elastic-nb join {cluster.addr}:{cluster.listener.port} " in (
                cluster.join_command()
            )
            bound = {
                c.laddr
                for c in psutil.net_connections("tcp")  # (the floors' psutil: no Process's)
                if c.status == psutil.CONN_LISTEN and c.laddr.port == cluster.listener.port
            }
            assert {a.ip for a in bound} == {cluster.addr}, bound
            tg.cancel_scope.cancel()
        cluster.listener.close()

    anyio.run(main)


def test_a_frame_over_the_channels_limit_is_never_sent_and_one_at_it_arrives() -> None:
    """An agent refuses to send what the supervisor would cut its connection for (a larger
    answer becomes an error answer, not a lost node); a frame within the limit arrives whole."""
    from elastic_nb.supervisor.nodes.channel import MAX_FRAME, Dialer, FrameTooLarge, Keys, Listener

    async def main() -> None:
        keys = Keys.new()
        listener = Listener(keys, "127.0.0.1", 0)
        dialer = Dialer(Keys.from_token(keys.token()), "127.0.0.1", listener.port)
        try:
            async with anyio.create_task_group() as tg:
                tg.start_soon(listener.serve_admission)
                with anyio.fail_after(10):
                    await dialer.handshake()
                    beat = protocol.agents.Beat(kind=protocol.agents.BEAT, t=0.0, groups={})
                    with pytest.raises(FrameTooLarge, match="beat of"):
                        await dialer.send(beat, bytes(MAX_FRAME + 1))
                    await dialer.send(beat, bytes(MAX_FRAME))
                    _, header, blob, _ = await listener.receive()
                    assert header["kind"] == protocol.agents.BEAT and blob == bytes(MAX_FRAME)
                tg.cancel_scope.cancel()
        finally:
            dialer.close()
            listener.close()

    anyio.run(main)


def test_a_stack_dump_too_long_for_the_answer_keeps_its_last_lines() -> None:
    from elastic_nb.join_agent.agent import _tail

    text = "".join(f"line {i}\n" for i in range(100_000))
    kept = _tail(text, 1000)
    assert len(kept.encode()) <= 1000 + 4 and kept.startswith("...\nline ")
    assert kept.endswith("line 99999\n") and _tail("short\n", 1000) == "short\n"


def test_a_node_writes_only_the_files_of_the_ranks_its_launcher_started(tmp_path: Path) -> None:
    """Through the agent's dispatch, as its messages arrive: rank 0's result from a node that
    runs ranks 2 and 3 is refused (said once, nothing written: the kernel would unpickle it),
    their own files are taken, and rank 0's once that node says its launcher started it."""

    async def main() -> None:
        site = await _site(tmp_path, [])  # its run directory is the group's, as the open left it
        link = site.link

        def file(rel: str, data: bytes = b"x") -> None:
            chunk = protocol.agents.FileChunk(
                kind=protocol.agents.FILE, group="g1", root="", path=rel, offset=-1
            )
            link.dispatch(chunk, data)

        def started(rank: int) -> None:
            _said(site, _started(rank))

        started(2)
        started(3)
        with pytest.raises(ValueError, match=r"rank-0\.result\.pkl.*did not start"):
            file("attempt-0/rank-0.result.pkl", b"a forged result")
        file("attempt-0/rank-0.result.pkl", b"again")  # its next chunks: dropped unsaid
        for rel in (
            "attempt-0/fr-rank-0",  # rank 0's flight recorder: the desync watch reads it
            "attempt-1/rank-2.out",
            "nodes/2-other/launcher.log",
            "checkpoints.jsonl",
        ):
            with pytest.raises(ValueError, match="did not start"):
                file(rel)
        file("attempt-0/rank-2.out", b"two")
        file("attempt-0/fr-rank-3", b"three")
        file(f"nodes/1-{link.name}/launcher.log", b"log")
        assert not (tmp_path / "attempt-0" / "rank-0.result.pkl").exists()
        assert (tmp_path / "attempt-0" / "rank-2.out").read_bytes() == b"two"
        assert (tmp_path / "attempt-0" / "fr-rank-3").read_bytes() == b"three"
        started(0)
        file("checkpoints.jsonl", b"{}")
        file("attempt-0/rank-0.result.pkl", b"rank 0's")
        assert (tmp_path / "attempt-0" / "rank-0.result.pkl").read_bytes() == b"rank 0's"

    anyio.run(main)


def test_a_nodes_files_stop_at_their_caps(monkeypatch: pytest.MonkeyPatch) -> None:
    from elastic_nb.supervisor.nodes import files

    taken = files.NodeFiles("1-b")
    taken.started("g", 0, 1)
    with pytest.raises(ValueError, match="past 4 GiB"):
        taken.admit("g", "attempt-0/rank-1.out", files.MAX_FILE - 1, 2)
    taken.admit("g", "attempt-0/rank-1.out", files.MAX_FILE - 2, 2)
    monkeypatch.setattr(files, "MAX_GROUP", 10)
    taken.admit("g", "attempt-0/rank-1.err", -1, 8)
    with pytest.raises(ValueError, match="group g's files past"):
        taken.admit("g", "attempt-0/rank-1.err", 8, 8)


def test_a_relayed_rank_hello_is_taken_only_for_a_rank_of_that_machine(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """A pid names a rank only on the machine it runs on: a process on node 1 whose pid there
    equals rank 0's pid here is not rank 0 (nor is a process here rank 2 of node 1)."""
    from types import SimpleNamespace

    from elastic_nb.supervisor.ranks.rank_book import RankBook
    from elastic_nb.supervisor.ranks.rank_links import RankLinks

    class Hello(ByteStream):
        """A rank's connection that says its hello and ends."""

        def __init__(self, rank: int) -> None:
            hello = protocol.sessions.RankHello(
                kind=protocol.sessions.RANK_HELLO, attempt=0, rank=rank, pid=4242
            )
            self.unread = protocol.wire.encode(hello)

        async def receive(self, max_bytes: int = 65536) -> bytes:
            if not self.unread:
                raise anyio.EndOfStream
            data, self.unread = self.unread, b""
            return data

        async def send(self, item: bytes) -> None:
            raise AssertionError("the session says nothing to a rank at its hello")

        async def send_eof(self) -> None:
            pass

        async def aclose(self) -> None:
            pass

    async def main() -> None:
        there = await _site(tmp_path, [])
        here: Any = SimpleNamespace(number=0, label="this machine")  # what the check reads
        book = RankBook(RunDir(str(tmp_path)))
        r0 = book.add(0, 0, 4242, time.time(), here)
        r2 = book.add(0, 2, 4242, time.time(), there)

        async def until(predicate: Any, timeout: float) -> bool:
            return bool(predicate())

        changed: list[None] = []
        links = RankLinks("s1", book, until, lambda: changed.append(None), lambda *a: None)
        with anyio.fail_after(5):  # each connection, relayed (its site) or here (None)
            await links.serve(Hello(0), 4242, there)
            await links.serve(Hello(2), 4242, None)
            assert not links.linked(r0) and not links.linked(r2) and changed == []
            assert "as rank 0 of attempt 0: that rank runs on this machine" in caplog.text
            assert f"as rank 2 of attempt 0: that rank runs on {there.label}" in caplog.text
            await links.serve(Hello(2), 4242, there)
            assert links.linked(r2) and not links.linked(r0)
            await links.serve(Hello(0), 4242, None)
            assert links.linked(r0) and len(changed) == 2

    with caplog.at_level(logging.WARNING):
        anyio.run(main)
