"""The channel between a supervisor and its join agents: ZeroMQ over TCP with CURVE, mutually
authenticated and encrypted by libzmq (no cryptography of ours), one connection per agent.

* **Keys.** Each supervisor makes two CURVE key pairs when it first serves agents: its own (the
  server's) and the agents' (one for all of them). The join command's token carries the server's
  public key (the agent refuses any other server: CURVE's handshake fails) and the agents' secret
  key (the supervisor admits no other client key). `--new-token` makes a new agents' pair: the
  old token is refused from then on.
* **Admission.** libzmq asks a ZAP handler about every CURVE handshake; ours admits the agents'
  public key alone (compared in constant time) and logs every refusal with the peer's address.
  A handshake that fails before that (a wrong server key, replayed or forged bytes) is logged
  from the socket's monitor. Nothing reaches the supervisor's code from a peer that has not
  passed both.
* **Limits before anything else.** A peer is cut the moment it declares a frame larger than
  `MAX_FRAME` (2 MiB: the largest an agent sends is a file chunk of `files.CHUNK`, 1 MiB, and its
  header; an answer is kept under it by the agent), before its handshake as after: a stranger
  makes the supervisor hold at most that per connection, for at most `HANDSHAKE_S` (libzmq's
  default is 30 s; a CURVE handshake takes a few round trips). An agent's messages wait in a queue
  of `QUEUE` at most (then libzmq stops reading its connection: TCP holds the rest, nothing is
  dropped). Refusals are logged with the peer's address and port, at most `LOG_BURST` a minute
  for one address, then counted.
* **Frames.** A message is the protocol's JSON header, and its blob as a second ZeroMQ frame.
  The supervisor's socket monitor says when a connection drops, naming the peer's address and
  port (each agent tells its own in its hello): a killed agent is known the moment the kernel
  closes its connection; a silent one, by its missing heartbeats.

The token is never logged in full: logs name it by its fingerprint.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import hmac
import json
import logging
import os
import secrets
import socket
import time
from dataclasses import dataclass
from typing import Any

import anyio
import zmq
import zmq.asyncio
from zmq.utils import z85
from zmq.utils.monitor import parse_monitor_message

from elastic_nb import protocol

__all__ = ["MAX_FRAME", "Dialer", "FrameTooLarge", "Keys", "Listener", "TokenError"]

log = logging.getLogger(__name__)

_ZAP_ENDPOINT = "inproc://zeromq.zap.01"  # where libzmq asks (ZMQ RFC 27)
MAX_FRAME = 2 << 20  # bytes of one frame an agent sends (the supervisor cuts a larger one)
# What CURVE adds to a frame on the wire (a MESSAGE command: its name, nonce, flags and MAC: 33
# bytes), which is what libzmq's limit counts.
_CURVE_OVERHEAD = 64
HANDSHAKE_S = 5.0
QUEUE = 64  # an agent's messages the supervisor's socket holds before it stops reading them
LOG_BURST = 5  # refusals logged per address and minute; the rest are counted
_DOMAIN = b"elastic_nb"
_KEY_BYTES = 32


class TokenError(ValueError):
    """A join token that is not one (wrong length or characters)."""


@dataclass(frozen=True)
class Keys:
    """CURVE keys (Z85 text, as libzmq takes them). The supervisor holds all four; an agent
    holds what its token gives: the server's public key and the agents' key pair."""

    server_public: bytes
    client_public: bytes
    client_secret: bytes
    server_secret: bytes | None = None

    @classmethod
    def new(cls) -> Keys:
        while True:
            server_public, server_secret = zmq.curve_keypair()
            # The token's first character comes from the server's key: "-" (1 in 64) made the
            # join line `elastic-nb join HOST:PORT --token -...` an option to argparse, and the
            # join failed with "--token: expected one argument".
            if z85.decode(server_public)[0] >> 2 != 62:
                break
        client_public, client_secret = zmq.curve_keypair()
        return cls(server_public, client_public, client_secret, server_secret)

    def with_new_clients(self) -> Keys:
        """The same server, a new agents' key pair (`--new-token`)."""
        client_public, client_secret = zmq.curve_keypair()
        return Keys(self.server_public, client_public, client_secret, self.server_secret)

    def token(self) -> str:
        """What the join command carries: URL-safe base64, safe to paste into any shell."""
        raw = z85.decode(self.server_public) + z85.decode(self.client_secret)
        return base64.urlsafe_b64encode(raw).decode().rstrip("=")

    @classmethod
    def from_token(cls, token: str) -> Keys:
        try:
            raw = base64.urlsafe_b64decode(token.strip() + "=" * (-len(token.strip()) % 4))
        except ValueError as e:
            raise TokenError("the token is not one elastic_nb made (not base64)") from e
        if len(raw) != 2 * _KEY_BYTES:
            raise TokenError("the token is not one elastic_nb made (wrong length)")
        server_public = z85.encode(raw[:_KEY_BYTES])
        client_secret = z85.encode(raw[_KEY_BYTES:])
        return cls(server_public, zmq.curve_public(client_secret), client_secret)

    def fingerprint(self) -> str:
        """A name for the token in logs and listings, from which it cannot be found."""
        return hashlib.sha256(self.client_public).hexdigest()[:12]


def _encode(msg: protocol.Message, blob: bytes | None) -> list[bytes]:
    header = json.dumps(msg, separators=(",", ":"), default=str).encode()
    return [header] if blob is None else [header, blob]


def _decode(frames: list[bytes]) -> tuple[protocol.wire.Frame, bytes | None]:
    if not frames or len(frames) > 2:
        raise protocol.wire.ProtocolError(f"a message of {len(frames)} frames")
    try:
        header = json.loads(frames[0])
    except (ValueError, RecursionError) as e:  # RecursionError: nested beyond the parser
        raise protocol.wire.ProtocolError(f"not a frame: {frames[0][:80]!r}") from e
    if not isinstance(header, dict) or not isinstance(header.get("kind"), str):
        raise protocol.wire.ProtocolError(f"frame without a kind: {frames[0][:80]!r}")
    return header, frames[1] if len(frames) == 2 else None


def _tune(sock: zmq.Socket[Any]) -> None:
    sock.linger = 0
    # A ROUTER drops a message for a peer past its high-water mark without a word; file
    # chunks and pushed objects must never be dropped: no mark (the sender's memory bounds it).
    sock.sndhwm = 0
    sock.rcvhwm = 0


class FrameTooLarge(protocol.wire.ProtocolError):
    """A frame the supervisor would cut the connection for (`MAX_FRAME`)."""


class Listener:
    """The supervisor's side: one ROUTER socket that admits agents holding the token."""

    def __init__(self, keys: Keys, host: str, port: int) -> None:
        assert keys.server_secret is not None
        self.keys = keys
        self.refusals: list[str] = []  # what was refused, with the peer's address (newest last)
        self._ctx = zmq.asyncio.Context()
        self._zap = self._ctx.socket(zmq.REP)  # bound before any handshake can ask it
        self._zap.linger = 0
        self._zap.bind(_ZAP_ENDPOINT)
        self._sock = self._ctx.socket(zmq.ROUTER)
        _tune(self._sock)
        # Inbound, a full queue makes libzmq stop reading the connection (nothing is dropped).
        self._sock.rcvhwm = QUEUE
        self._sock.maxmsgsize = MAX_FRAME + _CURVE_OVERHEAD
        self._sock.handshake_ivl = int(HANDSHAKE_S * 1000)
        self._sock.curve_server = True
        self._sock.curve_secretkey = keys.server_secret
        self._sock.curve_publickey = keys.server_public
        self._sock.zap_domain = _DOMAIN
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a gone peer raises, never drops unsaid
        self._monitor = self._sock.get_monitor_socket(
            zmq.EVENT_ACCEPTED
            | zmq.EVENT_DISCONNECTED
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        )
        # Connections that dropped, by the peer's "ip:port" (the monitor names the connection
        # by its descriptor: its peer's address is read when it is accepted).
        self._dropped_out, self.dropped = anyio.create_memory_object_stream[str](1000)
        self._peers: dict[int, str] = {}  # descriptor -> the peer's "ip:port"
        # Descriptors of connections a message came from (so their handshake succeeded: libzmq
        # names the connection of a succeeded handshake by the listener's address alone).
        self._authenticated: set[int] = set()
        self._logged: dict[str, tuple[float, int, int]] = {}  # ip -> (since, logged, held back)
        try:
            if port:
                self._sock.bind(f"tcp://{host}:{port}")
                self.port = port
            else:
                self.port = self._sock.bind_to_random_port(f"tcp://{host}")
        except zmq.ZMQError as e:
            self.close()
            raise OSError(f"cannot listen for agents on {host}:{port or 'a free port'}: {e}") from e
        self.host = host
        self._send_lock = anyio.Lock()

    def rotate(self) -> Keys:
        """A new agents' key pair; the old token is refused from now on."""
        self.keys = self.keys.with_new_clients()
        return self.keys

    async def serve_admission(self) -> None:
        """The ZAP handler and the handshake monitor, until cancelled."""
        async with anyio.create_task_group() as tg:
            tg.start_soon(self._serve_zap)
            tg.start_soon(self._watch_handshakes)

    async def _serve_zap(self) -> None:
        while True:
            frames = await self._zap.recv_multipart()
            version, request_id, domain, address, _identity, mechanism, *creds = frames
            key = creds[0] if creds else b""
            admitted = (
                mechanism == b"CURVE"
                and domain == _DOMAIN
                and hmac.compare_digest(key, z85.decode(self.keys.client_public))
            )
            if not admitted:
                self._refused(
                    address.decode(errors="replace"), "not holding this supervisor's token"
                )
            status, text = (b"200", b"OK") if admitted else (b"400", b"unknown key")
            await self._zap.send_multipart([version, request_id, status, text, b"agent", b""])

    async def _watch_handshakes(self) -> None:
        # Why handshakes failed, oldest first, until their connections drop (None: the ZAP
        # handler has logged it). libzmq names such an event by the listener's address alone.
        failed: list[str | None] = []
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            fd = event["value"]
            if event["event"] == zmq.EVENT_ACCEPTED:
                self._peers[fd] = _peer_of(fd) or "an unknown address"
            elif event["event"] == zmq.EVENT_DISCONNECTED:
                who = self._peers.pop(fd, "an unknown address")
                if fd in self._authenticated:
                    self._authenticated.discard(fd)
                    with contextlib.suppress(anyio.WouldBlock):
                        self._dropped_out.send_nowait(who)
                elif failed:
                    # The connection whose handshake failed (its reason came first): named now
                    # that its address is known.
                    why = failed.pop(0)
                    if why is not None:
                        self._refused(who, f"its handshake failed ({why})")
                else:
                    self._refused(
                        who,
                        "cut before it said anything (a frame over "
                        f"{MAX_FRAME >> 20} MiB, a handshake over {HANDSHAKE_S:g} s, or it left)",
                    )
            elif event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                failed.append(None)
            else:
                failed.append(_handshake_error(fd))

    def _refused(self, peer: str, why: str) -> None:
        """Logged with the peer's "ip:port", at most LOG_BURST a minute for one ip: a stranger
        retrying in a loop fills neither the log nor `%elastic nodes`."""
        ip = peer.rsplit(":", 1)[0]
        now = time.monotonic()
        since, logged, held = self._logged.get(ip, (now, 0, 0))
        if now - since > 60:
            if held:
                self._note(f"refused {held} more connection(s) from {ip} in the last minute")
            since, logged, held = now, 0, 0
        if logged < LOG_BURST:
            self._note(f"refused a connection from {peer}: {why}")
            logged += 1
        else:
            held += 1
        self._logged[ip] = (since, logged, held)
        if len(self._logged) > 1000:  # many addresses: those quiet for a minute are forgotten
            self._logged = {k: v for k, v in self._logged.items() if now - v[0] <= 60}

    def _note(self, text: str) -> None:
        log.warning(text)
        self.refusals.append(text)
        del self.refusals[:-100]

    async def receive(self) -> tuple[bytes, protocol.wire.Frame, bytes | None, str]:
        """The next (peer, header, blob, peer's IP address). A frame that is no message raises
        ProtocolError."""
        msg = await self._sock.recv_multipart(copy=False)
        peer = msg[0].bytes
        address = ""
        with contextlib.suppress(zmq.ZMQError):
            address = str(msg[-1].get("Peer-Address"))
            self._authenticated.add(msg[-1].get(zmq.SRCFD))
        header, blob = _decode([f.bytes for f in msg[1:]])
        return peer, header, blob, address

    async def send(self, peer: bytes, msg: protocol.Message, blob: bytes | None = None) -> bool:
        """False if the peer is gone."""
        try:
            async with self._send_lock:
                await self._sock.send_multipart([peer, *_encode(msg, blob)], copy=blob is None)
            return True
        except zmq.ZMQError:
            return False

    def close(self) -> None:
        for s in (getattr(self, "_monitor", None), getattr(self, "_sock", None), self._zap):
            if s is not None:
                s.close(linger=0)
        self._ctx.term()


class Dialer:
    """A join agent's side: one DEALER socket to the supervisor named in the token."""

    def __init__(self, keys: Keys, host: str, port: int) -> None:
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.DEALER)
        _tune(self._sock)
        self._sock.curve_serverkey = keys.server_public
        self._sock.curve_publickey = keys.client_public
        self._sock.curve_secretkey = keys.client_secret
        self._sock.routing_id = secrets.token_bytes(8)  # one per connection: a rejoin is new
        self._monitor = self._sock.get_monitor_socket(
            zmq.EVENT_HANDSHAKE_SUCCEEDED
            | zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
            | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
            | zmq.EVENT_HANDSHAKE_FAILED_AUTH
        )
        self._sock.connect(f"tcp://{host}:{port}")
        self.server = (host, port)
        self._send_lock = anyio.Lock()

    async def handshake(self) -> None:
        """Until CURVE's handshake succeeded; raises PermissionError with the reason if it
        failed (the supervisor refused the token, or is not the one the token names)."""
        while True:
            event = parse_monitor_message(await self._monitor.recv_multipart())
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                return
            if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_AUTH:
                raise PermissionError("the supervisor refused this token (a wrong or old one)")
            why = (
                os.strerror(event["value"])
                if event["event"] == zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
                else _handshake_error(event["value"])
            )
            raise PermissionError(
                "the handshake failed: the supervisor at that address is not the one this "
                f"token is for ({why})"
            )

    async def receive(self) -> tuple[protocol.wire.Frame, bytes | None]:
        frames = await self._sock.recv_multipart()
        return _decode(frames)

    async def send(self, msg: protocol.Message, blob: bytes | None = None) -> None:
        """Raises FrameTooLarge, sending nothing, where the supervisor would cut the
        connection for a frame of this message."""
        frames = _encode(msg, blob)
        if max(map(len, frames)) > MAX_FRAME:
            raise FrameTooLarge(
                f"a {msg['kind']} of {max(map(len, frames))} bytes (the channel takes "
                f"{MAX_FRAME} at most)"
            )
        async with self._send_lock:
            await self._sock.send_multipart(frames, copy=blob is None)

    def close(self) -> None:
        self._monitor.close(linger=0)
        self._sock.close(linger=0)
        self._ctx.term()


def _peer_of(fd: int) -> str | None:
    """The peer's "ip:port" of a connection libzmq holds (a duplicate descriptor, closed here)."""
    try:
        with socket.socket(fileno=os.dup(fd)) as s:
            host, port = s.getpeername()[:2]
            return f"{host}:{port}"
    except OSError:
        return None


def _handshake_error(code: int) -> str:
    """libzmq's protocol error, in words: 'zmtp cryptographic' (a key that does not match)."""
    for name in dir(zmq):
        if name.startswith("PROTOCOL_ERROR_") and getattr(zmq, name) == code:
            return name.removeprefix("PROTOCOL_ERROR_").lower().replace("_", " ")
    return f"error {code}"
