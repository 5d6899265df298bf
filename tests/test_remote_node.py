"""The supervisor's side of a join agent (supervisor/nodes/remote_node.py, cluster.py), below the
channel: what a bug of ours or a silent agent may cost is one message, one task or one node's
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

from elastic_nb.common import machine, protocol
from elastic_nb.common.rundir import RunDir
from elastic_nb.supervisor.nodes import remote_node
from elastic_nb.supervisor.nodes.cluster import Cluster
from elastic_nb.supervisor.nodes.remote_node import AgentLink, RemoteNode

pytestmark = pytest.mark.unit


def _node(tmp_path: Path, sent: list[Any]) -> RemoteNode:
    """A round's node on an agent that takes every order and answers none."""

    async def send(peer: bytes, msg: protocol.Message, blob: bytes | None) -> bool:
        sent.append(msg)
        return True

    link = AgentLink(send, lambda *a: None, b"peer", 1, machine.describe("10.0.0.2", ""), "x:1")
    node = RemoteNode(RunDir(str(tmp_path)), link, 0, None, {})
    node._group = "g1"  # as start() leaves it
    link.nodes["g1"] = node
    return node


def test_a_rounds_news_that_nobody_reads_any_more_is_dropped(tmp_path: Path) -> None:
    """The group's reader ended (its tasks cancelled by a bug of ours): the agent's news for it
    must not raise in the cluster's receive loop, which every agent's messages go through."""

    async def main() -> None:
        node = _node(tmp_path, [])
        node._said.close()
        said = protocol.LauncherSaid(
            kind=protocol.LAUNCHER,
            group="g1",
            msg={"kind": "start", "attempt": 0, "rank": 0, "pid": 123},
        )
        node.link.dispatch(said, None)  # raised BrokenResourceError
        assert (0, 0) in node._gone  # what it said is still known

    anyio.run(main)


def test_a_stop_the_agent_never_answers_is_bounded(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A teardown is shielded from cancellation: a stop waiting forever on an agent that takes
    the order and never answers would hold the supervisor forever."""
    monkeypatch.setattr(remote_node, "ANSWER_S", 0.2)

    async def main() -> None:
        sent: list[Any] = []
        node = _node(tmp_path, sent)
        started = time.monotonic()
        with anyio.fail_after(10, shield=True):  # as a teardown's; failing, not hanging
            survivors = await node.stop(0.1, lambda sig, pids: None)
        assert survivors == []
        assert [m["kind"] for m in sent] == [protocol.STOP]
        assert time.monotonic() - started < 5

    anyio.run(main)


def test_a_task_for_an_agent_that_fails_ends_alone(caplog: pytest.LogCaptureFixture) -> None:
    """Cluster.spawn runs in the supervisor's own task group: a failing task is logged and
    every other task of the supervisor runs on."""
    ran = []

    async def broken() -> None:
        raise RuntimeError("a bug of ours")

    async def fine() -> None:
        await anyio.sleep(0.05)
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
                for c in psutil.Process().net_connections("tcp")
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
                    beat = protocol.Beat(kind=protocol.BEAT, t=0.0, groups={})
                    with pytest.raises(FrameTooLarge, match="beat of"):
                        await dialer.send(beat, bytes(MAX_FRAME + 1))
                    await dialer.send(beat, bytes(MAX_FRAME))
                    _, header, blob, _ = await listener.receive()
                    assert header["kind"] == protocol.BEAT and blob == bytes(MAX_FRAME)
                tg.cancel_scope.cancel()
        finally:
            dialer.close()
            listener.close()

    anyio.run(main)


def test_a_stack_dump_too_long_for_the_answer_keeps_its_last_lines() -> None:
    from elastic_nb.supervisor.nodes.join_agent import _tail

    text = "".join(f"line {i}\n" for i in range(100_000))
    kept = _tail(text, 1000)
    assert len(kept.encode()) <= 1000 + 4 and kept.startswith("...\nline ")
    assert kept.endswith("line 99999\n") and _tail("short\n", 1000) == "short\n"
