"""``python -m elastic_nb.protocol``: every channel's messages and their fields, and each
request's reply, from the TypedDicts themselves (the one list there is)."""

from __future__ import annotations

import typing

from elastic_nb.protocol import CHANNELS, REPLIES


def main() -> None:
    for name, channel in CHANNELS.items():
        print(name)
        replies = REPLIES.get(name, {})
        for message in typing.get_args(channel):
            hints = typing.get_type_hints(message)
            (kind,) = typing.get_args(hints.pop("kind"))
            print(f"  {kind} {_fields(message, hints)}    {_name(message)}")
            if kind in replies:
                reply = replies[kind]
                print(f"    -> {_fields(reply, typing.get_type_hints(reply))}    {_name(reply)}")
        print()


def _fields(record: type, hints: dict[str, object]) -> str:
    required: frozenset[str] = getattr(record, "__required_keys__", frozenset())
    return "{" + ", ".join(f if f in required else f"{f}?" for f in hints) + "}"


def _name(record: type) -> str:
    return f"{record.__module__}.{record.__name__}"


if __name__ == "__main__":
    main()
