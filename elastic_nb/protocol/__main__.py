"""``python -m elastic_nb.protocol``: every channel's messages and their fields, from the
TypedDicts themselves (the one list there is)."""

from __future__ import annotations

import typing

from elastic_nb.protocol import CHANNELS


def main() -> None:
    for name, channel in CHANNELS.items():
        print(name)
        for message in typing.get_args(channel):
            hints = typing.get_type_hints(message)
            (kind,) = typing.get_args(hints.pop("kind"))
            required = message.__required_keys__
            fields = ", ".join(f if f in required else f"{f}?" for f in hints)
            print(f"  {kind} {{{fields}}}    {message.__module__}.{message.__name__}")
        print()


if __name__ == "__main__":
    main()
