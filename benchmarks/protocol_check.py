"""P17: the wire's parse and check, per message kind: a frame's header line read (`json.loads`)
and checked by its channel's parser, in microseconds a message (the best of 7 repeats of 20,000),
beside `json.loads` alone. No torchrun side: torch's elastic agent passes no messages of its own.
The target: a message's check within 3 µs, the job update's (the busiest) included.

    python benchmarks/protocol_check.py [--runs 7] [--number 20000]      (make bench runs it)
"""

from __future__ import annotations

import argparse
import json
import timeit
from collections.abc import Callable
from typing import Any

from elastic_nb import protocol

_CHIP = {"state": "running", "label": "running", "attempt": 0, "pid": 4242}
_BATCH = {
    "attempt": 0,
    "rank": 1,
    "stream": "out",
    "lines": ["step 12 loss 0.4182"] * 3,
    "skipped": 0,
    "progress": None,
}
_SAMPLE = {
    "attempt": 0,
    "rank": 1,
    "t": 1.7e9,
    "rss": 1 << 28,
    "cuda": None,
    "gpu": None,
    "limit": 1 << 34,
}
_GROUP = {
    "launcher": 4242, "launcher_alive": True, "state": ["S", "sleeping"], "tick_age": 0.1,
    "running": True, "zombies": [], "oom_kills": 0, "round": 0,
}  # fmt: skip
_DUMP = {"text": "Thread 0x7f (most recent call first):\n  File \"cell\", line 8 in <module>\n", "state": ["S", "sleeping"], "asked": True}  # fmt: skip


def _reply(
    parse: Callable[[Any], Any], replies: dict[str, type], kind: str
) -> Callable[[Any], Any]:
    """A reply's reader: its envelope by the channel's parser, its data by the request's type."""

    def read(frame: Any) -> Any:
        msg = parse(frame)
        protocol.wire.check_reply(replies, kind, msg["data"])
        return msg

    return read


# (channel's parser, a typical message of it): the messages that come most often on each
MESSAGES: list[tuple[str, Callable[[Any], Any], dict[str, Any]]] = [
    ("kernel: stop", protocol.kernel.kernel_request, {"kind": "stop", "req": 7, "job": "cafe0001", "reason": "user"}),
    ("kernel: update (2 chips, 2 log batches, 2 samples)", protocol.kernel.kernel_news, {
        "kind": "update", "job": "cafe0001", "ranks": {"0": _CHIP, "1": _CHIP},
        "logs": [_BATCH, {**_BATCH, "rank": 0}], "memory": [_SAMPLE, {**_SAMPLE, "rank": 0}],
    }),
    ("kernel: reply to stop (its data checked too)", _reply(protocol.kernel.kernel_news, protocol.kernel.REPLIES, "stop"), {"kind": "reply", "req": 7, "ok": True, "data": {"stopping": ["cafe0001"]}}),
    ("launcher: start", protocol.launcher.launcher_news, {"kind": "start", "attempt": 0, "rank": 1, "pid": 4242}),
    ("launcher: tick", protocol.launcher.launcher_news, {"kind": "tick", "t": 1.7e9}),
    ("session rank: ran", protocol.sessions.rank_news, {"kind": "ran", "cell": "cafe0002", "ok": True, "out": 812, "err": 0}),
    ("join agent: beat (1 group)", protocol.agents.node_news, {"kind": "beat", "t": 1.7e9, "groups": {"cafe0001": _GROUP}}),
    ("join agent: answer to stacks (2 ranks; data checked)", _reply(protocol.agents.node_news, protocol.agents.ANSWERS, "stacks"), {"kind": "answer", "req": 7, "ok": True, "data": {"dumps": {"0": _DUMP, "1": _DUMP}}}),
]  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=7, help="repeats; the best counts")
    parser.add_argument("--number", type=int, default=20_000, help="messages a repeat")
    args = parser.parse_args()
    print("| message | json.loads | parse + check | check alone |")
    print("| --- | --- | --- | --- |")
    worst = 0.0
    for name, parse, msg in MESSAGES:
        line = json.dumps(msg, separators=(",", ":")).encode()
        assert parse(json.loads(line)) == msg, name  # a message of its channel, whole
        loads = _per_message(lambda line=line: json.loads(line), args.runs, args.number)
        both = _per_message(
            lambda line=line, parse=parse: parse(json.loads(line)), args.runs, args.number
        )
        # The check alone on the parsed frame (the parsers do not change it): a difference of
        # the two figures above is the noise of two.
        alone = _per_message(lambda msg=msg, parse=parse: parse(msg), args.runs, args.number)
        worst = max(worst, alone)
        print(f"| {name} | {loads:.2f} µs | {both:.2f} µs | {alone:.2f} µs |")
    print(f"P17: the slowest check {worst:.2f} µs a message (target: within 3 µs)")


def _per_message(fn: Callable[[], Any], runs: int, number: int) -> float:
    return min(timeit.repeat(fn, number=number, repeat=runs)) / number * 1e6


if __name__ == "__main__":
    main()
