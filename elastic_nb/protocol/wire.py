"""The wire every channel of elastic_nb's processes shares: its framing and its checker.

A frame is one line of compact JSON (an object with a ``"kind"``), optionally followed by a raw
binary blob whose length the header gives as ``"blob"``: pushed objects travel that way, without
base64. A reader takes a frame only through its channel's parser (`check`, with the channel's
union of messages), which refuses a kind that channel does not carry and a message whose fields,
nested records included, are missing or of the wrong type.

Each message type compiles once into a function (generated Python source: one expression a
field) that says whether a frame fits it; the path of the first field that does not fit is found
only then, by `_misfit`, slowly (benchmarks/protocol_check.py measures both).
"""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Callable, Iterator, Mapping
from typing import Any, Literal, Union

__all__ = [
    "VERSION",
    "Frame",
    "FrameDecoder",
    "ProtocolError",
    "check",
    "check_record",
    "check_reply",
    "encode",
]

# Every channel's, said at each handshake (the kernel's hello, a join agent's): 2: log batches are
# records; 3: sessions; 4: typed messages, a reply's data; 5: memory samples; 6: nodes (join
# agents); 7: a module a channel, nested records checked, memory samples with their limit; 8:
# replies typed per request (a stop's answer from an agent: records, not pairs); 9: a rank's
# prompt and the notebook's input; 10: the ranks waiting for a paused one (a prompt's, a chip's);
# 11: a join agent's news of a group names its round; 12: a session rank's answer says how much
# it had written (its output reaches the notebook before its cell's end).
VERSION = 12

# A header line longer than this is a corrupt stream, not a message.
_MAX_HEADER = 16 * 1024 * 1024
_MAX_BLOB = 1 << 40
Frame = dict[str, Any]  # a decoded frame, before its channel's parser has checked it


class ProtocolError(RuntimeError):
    """The other side sent something that is not a frame of this protocol."""


def encode(msg: Mapping[str, Any], blob: bytes | None = None) -> bytes:
    """A message's frame: its header line, and its blob after it (a channel's TypedDict: mypy
    checks what each sender builds)."""
    header: dict[str, Any] = dict(msg)
    if blob is not None:
        header["blob"] = len(blob)
    line = json.dumps(header, separators=(",", ":"), default=str).encode() + b"\n"
    return line + blob if blob else line


class FrameDecoder:
    """Incremental decoder: feed bytes as they arrive, iterate complete (message, blob) pairs."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._pending: Frame | None = None  # header waiting for its blob

    def feed(self, data: bytes) -> Iterator[tuple[Frame, bytes | None]]:
        self._buf += data
        while True:
            if self._pending is not None:
                size = self._pending["blob"]
                if len(self._buf) < size:
                    return
                blob = bytes(self._buf[:size])
                del self._buf[:size]
                msg, self._pending = self._pending, None
                yield msg, blob
                continue
            nl = self._buf.find(b"\n")
            if nl < 0:
                if len(self._buf) > _MAX_HEADER:
                    raise ProtocolError("header line too long")
                return
            line = bytes(self._buf[:nl])
            del self._buf[: nl + 1]
            if not line.strip():
                continue
            try:
                msg = json.loads(line)
            except (ValueError, RecursionError) as e:  # RecursionError: nested too deep
                raise ProtocolError(f"not a frame: {line[:80]!r}") from e
            if not isinstance(msg, dict) or "kind" not in msg:
                raise ProtocolError(f"frame without a kind: {line[:80]!r}")
            if "blob" in msg:
                size = msg["blob"]
                if type(size) is not int or not 0 <= size <= _MAX_BLOB:
                    raise ProtocolError(f"bad blob size in {line[:80]!r}")
                self._pending = msg
                continue
            yield msg, None


_KINDS: dict[object, dict[str, tuple[type, Callable[[Any], bool]]]] = {}


def check(frame: Frame, channel: object) -> Frame:
    """The frame if it is one of the `channel`'s messages (a union of its TypedDicts, each with
    a literal `kind`) with every field it needs, of its type, nested records, lists and maps
    included; else ProtocolError naming the first field that does not fit."""
    kinds = _KINDS.get(channel)
    if kinds is None:
        kinds = _KINDS[channel] = {
            typing.get_args(typing.get_type_hints(t)["kind"])[0]: (t, _fits_of(t))
            for t in typing.get_args(channel)
        }
    kind = frame.get("kind")
    known = kinds.get(kind) if type(kind) is str else None
    if known is None:
        raise ProtocolError(f"unexpected message kind {kind!r} on this channel")
    if not known[1](frame):
        _refuse(frame, known[0], str(kind))
    return frame


def check_reply(replies: Mapping[str, type], kind: str, data: Frame) -> Frame:
    """A reply's data, checked against the type `replies` (a channel's table) names for a
    request of `kind`."""
    return check_record(data, replies[kind], f"the reply to {kind}")


def check_record(frame: Frame, cls: type, what: str) -> Frame:
    """The frame if it fits the TypedDict `cls` whole; else ProtocolError saying `what` misses
    which field, or which field does not fit."""
    if not _fits_of(cls)(frame):
        _refuse(frame, cls, what)
    return frame


def _refuse(frame: Frame, cls: type, what: str) -> typing.NoReturn:
    why = _misfit(frame, cls, "") or "does not fit its type"
    raise ProtocolError(f"{what} {why}" if why.startswith("without ") else f"{what}: {why}")


def _expr(hint: Any, v: str, depth: int, names: dict[str, Any]) -> str:
    """A Python expression, true when the value named `v` fits `hint`."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return "True"
    if hint is type(None):
        return f"{v} is None"
    if hint is float:
        return f"(type({v}) is float or type({v}) is int)"
    if hint in (str, int, bool):
        return f"type({v}) is {hint.__name__}"
    if origin is Literal:
        values = typing.get_args(hint)
        return f"{v} == {values[0]!r}" if len(values) == 1 else f"{v} in {values!r}"
    if origin in (Union, types.UnionType):
        return "(" + " or ".join(_expr(h, v, depth, names) for h in typing.get_args(hint)) + ")"
    if _is_record(hint):
        names[f"_fits_{hint.__name__}"] = _fits_of(hint)
        return f"_fits_{hint.__name__}({v})"
    x = f"_x{depth}"
    if origin is list or origin is tuple:
        item = _item(hint)
        each = _expr(item, x, depth + 1, names)
        every = "" if each == "True" else f" and all({each} for {x} in {v})"
        return f"(type({v}) is list{every})"
    if origin is dict or hint is dict:
        key, value = typing.get_args(hint) or (Any, Any)
        each = " and ".join(
            e
            for e in (_expr(key, f"_k{depth}", depth + 1, names), _expr(value, x, depth + 1, names))
            if e != "True"
        )
        every = f" and all({each} for _k{depth}, {x} in {v}.items())" if each else ""
        return f"(type({v}) is dict{every})"
    raise TypeError(f"the protocol's checker has no rule for {hint!r}")


def _statements(hint: Any, v: str, depth: int, names: dict[str, Any], indent: str) -> list[str]:
    """Statements that return False unless the value named `v` fits `hint`: a list's or a
    map's items in a loop of their own (a generator under all() for each container cost the
    job update, the busiest message, a third of its check: P17)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin in (Union, types.UnionType) and type(None) in args and len(args) == 2:
        (inner,) = [h for h in args if h is not type(None)]
        if typing.get_origin(inner) in (list, dict):
            return [
                f"{indent}if {v} is not None:",
                *_statements(inner, v, depth, names, indent + "    "),
            ]
    x = f"_x{depth}"
    if origin is list or origin is tuple:
        item = _item(hint)
        out = [f"{indent}if type({v}) is not list: return False"]
        if _expr(item, x, depth + 1, names) != "True":
            out.append(f"{indent}for {x} in {v}:")
            out += _statements(item, x, depth + 1, names, indent + "    ")
        return out
    if origin is dict or hint is dict:
        key, value = args or (Any, Any)
        out = [f"{indent}if type({v}) is not dict: return False"]
        k = f"_k{depth}"
        key_test = _expr(key, k, depth + 1, names)
        if key_test != "True" or _expr(value, x, depth + 1, names) != "True":
            out.append(f"{indent}for {k}, {x} in {v}.items():")
            if key_test != "True":
                out.append(f"{indent}    if not ({key_test}): return False")
            out += _statements(value, x, depth + 1, names, indent + "    ")
        return out
    test = _expr(hint, v, depth, names)
    return [] if test == "True" else [f"{indent}if not ({test}): return False"]


def _item(hint: Any) -> Any:
    """A list's item type; a homogeneous tuple's (`tuple[str, ...]`), which travels as a list."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) is tuple and (len(args) != 2 or args[1] is not Ellipsis):
        raise TypeError(f"the protocol's checker takes tuple[X, ...] only, not {hint!r}")
    return args[0] if args else Any


def _is_record(hint: Any) -> bool:
    """A TypedDict, or a frozen dataclass whose fields travel as a JSON object (JobSpec)."""
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return True
    return isinstance(hint, type) and issubclass(hint, dict) and hasattr(hint, "__required_keys__")


def _required(cls: type) -> frozenset[str]:
    if dataclasses.is_dataclass(cls):
        return frozenset(
            f.name
            for f in dataclasses.fields(cls)
            if f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
        )
    return cls.__required_keys__  # type: ignore[attr-defined,no-any-return]


_FITS: dict[type, Callable[[Any], bool]] = {}


def _fits_of(cls: type) -> Callable[[Any], bool]:
    """`cls`'s compiled check (a TypedDict): whether a value is a dict with each of its required
    keys and every key it declares of its type (keys it does not declare are a newer writer's)."""
    known = _FITS.get(cls)
    if known is not None:
        return known
    names: dict[str, Any] = {}
    required = _required(cls)
    # A required key read by subscript, its absence the KeyError (free in 3.11 until raised); an
    # optional one looked for first: faster than a get() with a default for either.
    lines = [
        f"def _fits_{cls.__name__}(m):",
        "    if type(m) is not dict: return False",
        "    try:",
    ]
    for key, hint in typing.get_type_hints(cls).items():
        if _expr(hint, "v", 0, names) == "True":
            if key in required:
                lines.append(f"        m[{key!r}]")
            continue
        if key in required:
            lines.append(f"        v = m[{key!r}]")
            lines += _statements(hint, "v", 0, names, "        ")
        else:
            lines += [f"        if {key!r} in m:", f"            v = m[{key!r}]"]
            lines += _statements(hint, "v", 0, names, "            ")
    if lines[-1] == "    try:":
        lines.append("        pass")  # nothing to check but that it is a record
    lines += ["    except KeyError:", "        return False", "    return True"]
    exec("\n".join(lines), names)  # our own source, from our own type hints
    fits: Callable[[Any], bool] = names[f"_fits_{cls.__name__}"]
    _FITS[cls] = fits
    return fits


def _misfit(value: Any, hint: Any, path: str) -> str | None:
    """Where `value` does not fit `hint`: the path of the first field that does not, and why
    (None: it fits). Only called once the compiled check said no."""
    origin = typing.get_origin(hint)
    if origin in (Union, types.UnionType):
        args = typing.get_args(hint)
        if any(_misfit(value, h, path) is None for h in args):
            return None
        records = [h for h in args if _is_record(h)]
        if len(records) == 1 and isinstance(value, dict):
            return _misfit(value, records[0], path)
        return f"{path} is not a {_name(hint)}: {value!r:.80}"
    if _is_record(hint):
        if not isinstance(value, dict):
            return f"{path} is not a record: {value!r:.80}"
        for key, h in typing.get_type_hints(hint).items():
            if key not in value:
                if key in _required(hint):
                    return f"{path}.{key} is missing" if path else f"without {key}"
                continue
            found = _misfit(value[key], h, f"{path}.{key}" if path else key)
            if found:
                return found
        return None
    if (origin is list or origin is tuple) and isinstance(value, list):
        item = _item(hint)
        for i, x in enumerate(value):
            found = _misfit(x, item, f"{path}[{i}]")
            if found:
                return found
        return None
    if (origin is dict or hint is dict) and isinstance(value, dict):
        key_hint, value_hint = typing.get_args(hint) or (Any, Any)
        for k, x in value.items():
            found = _misfit(k, key_hint, f"{path} key") or _misfit(x, value_hint, f"{path}[{k!r}]")
            if found:
                return found
        return None
    names: dict[str, Any] = {}
    if eval(_expr(hint, "value", 0, names), names, {"value": value}):  # our own source, as above
        return None
    return f"{path} is not a {_name(hint)}: {value!r:.80}"


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or str(hint)
