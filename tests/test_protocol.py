"""The frame codec, byte by byte."""

from __future__ import annotations

import pytest

from elastic_nb.common import protocol


def test_frames_with_and_without_blobs_survive_any_split() -> None:
    stream = (
        protocol.encode("a", x=1)
        + protocol.encode("b", b"\x00\n\xffblob\n", y="two")
        + protocol.encode("c", b"")
        + protocol.encode("d")
    )
    for cut in range(1, len(stream)):
        decoder = protocol.FrameDecoder()
        got = list(decoder.feed(stream[:cut])) + list(decoder.feed(stream[cut:]))
        assert got == [
            ({"kind": "a", "x": 1}, None),
            ({"kind": "b", "y": "two", "blob": 8}, b"\x00\n\xffblob\n"),
            ({"kind": "c", "blob": 0}, b""),
            ({"kind": "d"}, None),
        ]


def test_garbage_is_a_protocol_error() -> None:
    with pytest.raises(protocol.ProtocolError):
        list(protocol.FrameDecoder().feed(b"not json\n"))
    with pytest.raises(protocol.ProtocolError):
        list(protocol.FrameDecoder().feed(b'{"no": "kind"}\n'))
    for size in (b"-1", b'"8"', b"1.5", b"true"):
        with pytest.raises(protocol.ProtocolError, match="blob size"):
            list(protocol.FrameDecoder().feed(b'{"kind": "x", "blob": ' + size + b"}\nabc"))


def test_hello_checks_the_version() -> None:
    protocol.check_hello({"kind": "hello", "version": protocol.VERSION})
    with pytest.raises(protocol.ProtocolError, match="restart the kernel"):
        protocol.check_hello({"kind": "hello", "version": protocol.VERSION + 1})
