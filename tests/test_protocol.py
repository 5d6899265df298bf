"""The frame codec, byte by byte."""

from __future__ import annotations

import typing
from typing import Any

import pytest

from elastic_nb import protocol

pytestmark = pytest.mark.unit


def test_frames_with_and_without_blobs_survive_any_split() -> None:
    stream = (
        protocol.wire.encode({"kind": "a", "x": 1})  # type: ignore[typeddict-unknown-key]
        + protocol.wire.encode({"kind": "b", "y": "two"}, b"\x00\n\xffblob\n")  # type: ignore[typeddict-unknown-key]
        + protocol.wire.encode({"kind": "c"}, b"")  # type: ignore[arg-type]
        + protocol.wire.encode({"kind": "d"})  # type: ignore[arg-type]
    )
    for cut in range(1, len(stream)):
        decoder = protocol.wire.FrameDecoder()
        got = list(decoder.feed(stream[:cut])) + list(decoder.feed(stream[cut:]))
        assert got == [
            ({"kind": "a", "x": 1}, None),
            ({"kind": "b", "y": "two", "blob": 8}, b"\x00\n\xffblob\n"),
            ({"kind": "c", "blob": 0}, b""),
            ({"kind": "d"}, None),
        ]


def test_garbage_is_a_protocol_error() -> None:
    with pytest.raises(protocol.wire.ProtocolError):
        list(protocol.wire.FrameDecoder().feed(b"not json\n"))
    with pytest.raises(protocol.wire.ProtocolError):
        list(protocol.wire.FrameDecoder().feed(b'{"no": "kind"}\n'))
    for size in (b"-1", b'"8"', b"1.5", b"true"):
        with pytest.raises(protocol.wire.ProtocolError, match="blob size"):
            list(protocol.wire.FrameDecoder().feed(b'{"kind": "x", "blob": ' + size + b"}\nabc"))


def test_hello_checks_the_version() -> None:
    protocol.kernel.check_hello({"kind": "hello", "version": protocol.wire.VERSION})
    with pytest.raises(protocol.wire.ProtocolError, match="restart the kernel"):
        protocol.kernel.check_hello({"kind": "hello", "version": protocol.wire.VERSION + 1})


def test_each_channel_takes_only_its_own_messages_whole() -> None:
    """A reader takes a frame through its channel's parser: a kind the channel does not carry,
    a field missing or of the wrong type is a ProtocolError, not a KeyError deep inside."""
    start = {"kind": "start", "attempt": 0, "rank": 1, "pid": 42}
    assert protocol.launcher.launcher_news(start) == start
    with pytest.raises(protocol.wire.ProtocolError, match="unexpected message kind 'start'"):
        protocol.kernel.kernel_request(start)
    with pytest.raises(protocol.wire.ProtocolError, match="start without pid"):
        protocol.launcher.launcher_news({"kind": "start", "attempt": 0, "rank": 1})
    with pytest.raises(protocol.wire.ProtocolError, match="rank is not a int"):
        protocol.launcher.launcher_news({**start, "rank": "1"})
    with pytest.raises(protocol.wire.ProtocolError, match="rank is not a int"):
        protocol.launcher.launcher_news({**start, "rank": True})  # JSON's true is no rank number
    # Optional fields may be absent, and a None where the type allows it.
    assert protocol.kernel.kernel_news({"kind": "update", "job": "cafe0001"})
    exit_ = {"kind": "exit", "attempt": 0, "rank": 0, "pid": 7, "code": None}
    assert protocol.launcher.launcher_news(exit_) == exit_
    hello = {"kind": "rank_hello", "rank": 0, "attempt": 0, "pid": 9}
    assert protocol.sessions.rank_news(hello) == hello
    with pytest.raises(protocol.wire.ProtocolError):
        protocol.sessions.rank_news(
            {"kind": "run", "cell": "x", "run_dir": "/"}
        )  # the supervisor's word
    assert protocol.sessions.session_order({"kind": "bye"}) == {"kind": "bye"}


def test_nested_records_are_checked_whole_and_the_field_named() -> None:
    """A record inside a message (a node's group in its beat, a chip in an update, a summary's
    memory peaks) is checked as deep as its type goes; the error names the first field that
    does not fit, by its path."""
    group = {
        "round": 0,
        "launcher": 42,
        "launcher_alive": True,
        "state": ["S", "sleeping"],
        "tick_age": 0.1,
        "running": True,
        "zombies": [[0, 1]],
        "oom_kills": None,
    }
    beat = {"kind": "beat", "t": 1.0, "groups": {"cafe0001": group}}
    assert protocol.agents.node_news(beat) == beat
    with pytest.raises(protocol.wire.ProtocolError, match=r"beat: groups\['g'\]\.round is missing"):
        protocol.agents.node_news({**beat, "groups": {"g": {"bogus": 1}}})
    with pytest.raises(
        protocol.wire.ProtocolError, match=r"beat: groups\['g'\]\.zombies\[0\]\[1\] "
    ):
        protocol.agents.node_news({**beat, "groups": {"g": {**group, "zombies": [[0, "1"]]}}})
    update = {"kind": "update", "job": "cafe0001", "ranks": {"0": {"state": "running"}}}
    assert protocol.kernel.kernel_news(update) == update
    with pytest.raises(
        protocol.wire.ProtocolError, match=r"update: ranks\['0'\]\.state is not a str"
    ):
        protocol.kernel.kernel_news({**update, "ranks": {"0": {"state": 5}}})
    with pytest.raises(protocol.wire.ProtocolError, match=r"update: logs\[0\] is not a record"):
        protocol.kernel.kernel_news({**update, "logs": ["a line"]})
    # Keys a record does not declare are a newer writer's: taken, not checked.
    assert protocol.kernel.kernel_news({**update, "ranks": {"0": {"state": "running", "new": 1}}})


def test_each_channel_is_its_modules_messages_each_kind_once() -> None:
    """A channel's module is the one place its messages are defined: every message TypedDict of
    a channel's module is in one of its directions, a kind names one message on a direction,
    and the listing `python -m elastic_nb.protocol` prints is made from them."""
    import io
    import typing
    from contextlib import redirect_stdout

    from elastic_nb.protocol import __main__ as listing

    carried: set[type] = set()
    for name, channel in protocol.CHANNELS.items():
        kinds = [typing.get_type_hints(m)["kind"] for m in typing.get_args(channel)]
        assert len(kinds) == len(set(kinds)), name
        carried.update(typing.get_args(channel))
    for module in (protocol.kernel, protocol.launcher, protocol.sessions, protocol.agents):
        messages = [
            v
            for v in vars(module).values()
            if isinstance(v, type) and v.__module__ == module.__name__ and v.__name__[0] != "_"
            and "kind" in getattr(v, "__annotations__", {})
            and typing.get_origin(typing.get_type_hints(v)["kind"]) is typing.Literal
        ]  # fmt: skip
        assert messages and set(messages) <= carried, module.__name__
    out = io.StringIO()
    with redirect_stdout(out):
        listing.main()
    text = out.getvalue()
    assert "  submit {req, job, spec, cell, env, session}" in text
    assert "  file {group, root, path, offset}" in text
    # each request with the type of its reply, the table its readers check replies against
    assert "  stop {req, job, reason}    elastic_nb.protocol.kernel.Stop\n    -> {stopping}" in text
    assert "    -> {survivors, signals}    elastic_nb.protocol.agents.Stopped" in text
    for name, replies in protocol.REPLIES.items():
        asked = {
            typing.get_args(typing.get_type_hints(m)["kind"])[0]
            for m in typing.get_args(protocol.CHANNELS[name])
        }
        assert set(replies) <= asked, name
    assert "  result {ok, error?, failures?}" in text


def test_every_request_has_its_handler() -> None:
    """The supervisor serves the kernel's channel through one table, a handler a kind: every
    request of the channel has one (the hello is the handshake's), and no handler serves a kind
    the channel does not carry."""
    import typing

    from elastic_nb.supervisor.service import _REQUESTS

    kinds = {
        typing.get_args(typing.get_type_hints(m)["kind"])[0]
        for m in typing.get_args(protocol.kernel.KernelRequest)
    }
    assert set(_REQUESTS) == kinds - {protocol.kernel.HELLO}


def test_every_order_to_a_join_agent_has_its_handler() -> None:
    """A join agent serves the supervisor's orders through one table: every order of the
    channel has its handler, but for the handshake's (welcome, refused) and the ones its reader
    takes in the order they came (bye, a stream's data and close)."""
    import typing

    from elastic_nb.join_agent.agent import _ORDERS

    a = protocol.agents
    kinds = {
        typing.get_args(typing.get_type_hints(m)["kind"])[0] for m in typing.get_args(a.NodeOrder)
    }
    taken_apart = {a.WELCOME, a.REFUSED, a.BYE, a.STREAM_DATA, a.STREAM_CLOSE}
    assert set(_ORDERS) == kinds - taken_apart


def test_every_piece_of_an_agents_news_has_its_handler() -> None:
    """The supervisor takes a joined agent's news through one table (JoinAgentLink's): every kind
    the agent sends has its handler, but its hello and bye (the cluster's)."""
    import typing

    from elastic_nb.supervisor.nodes.agent_link import _NEWS

    a = protocol.agents
    kinds = {
        typing.get_args(typing.get_type_hints(m)["kind"])[0] for m in typing.get_args(a.NodeNews)
    }
    assert set(_NEWS) == kinds - {a.NODE_HELLO, a.BYE}


def test_a_record_with_nothing_to_check_but_its_being_one() -> None:
    """A TypedDict whose fields are all optional and of any type still compiles: a dict fits,
    anything else does not."""

    class Loose(typing.TypedDict, total=False):
        anything: Any

    assert protocol.wire.check_record({"anything": [1]}, Loose, "loose") == {"anything": [1]}
    with pytest.raises(protocol.wire.ProtocolError, match="loose"):
        protocol.wire.check_record([], Loose, "loose")
