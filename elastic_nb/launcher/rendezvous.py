"""What the launcher changes in torch's dynamic rendezvous (elastic/rendezvous/
dynamic_rendezvous.py, torch 2.13): its state signed, and three of its costs removed.

**Signed state.** The c10d backend keeps the rendezvous state in a `TCPStore` (on this machine's
loopback: loopback.py) and every launcher reads it back with ``pickle.loads``. A TCPStore has no
authentication: any local user can connect to its port, and a pickle written there under the
state's key would run in the notebook user's launcher. So every state a launcher of the job writes
carries an HMAC-SHA256 under a key only the job's launchers hold (a single-node job's launcher
makes one; a multi-node group's comes from the supervisor in each round's plan, over the
launcher's pipe or a join agent's authenticated channel), bound to the state's store key; a state
that does not carry it is refused before anything unpickles it (RendezvousStateError: the round
fails, naming why). Nothing else torch's elastic agent reads from the store unpickles.

**Speed** (`quicken`):

- next_rendezvous() sleeps a random 0-0.3 s in round 0 "to skew the rendezvous attempts across
  the nodes": a single-node job has one node, and a multi-node round's nodes all start at the
  moment the supervisor says, their store on its machine;
- a node waiting for the others polls the store's state every second (the SYNC action's "delay
  by one second to avoid overloading the backend"), and reads it back from the store at most
  once a second (_BackendRendezvousStateHolder's cache_duration): a round's last node to arrive
  was seen about a second late by the others (1 s of every multi-node round, measured). The
  group's store serves a handful of nodes: a read every SYNC_POLL_S costs it nothing;
- every recorded event names its method with inspect.stack(), twice, which builds the source
  context of every frame (about 40 ms per launch); the frame's code has the name.

**A master port that stays free** (`reserve_master_port`). The node of group rank 0 picks the
port of rank 0's process-group store with ``get_free_port()``, which binds port 0 and closes the
socket: until rank 0 listens on it, any process of the machine may get the same port for a
connection or a server of its own (a full test run saw rank 0 fail with EADDRINUSE so). The
launcher holds the port bound (SO_REUSEADDR, never listening) until its next attempt picks
another: the kernel then hands it to no other socket, and rank 0's listener, SO_REUSEADDR as
torch's and loopback.py's are, binds it still.
"""

from __future__ import annotations

import hashlib
import hmac
import socket
import sys
from typing import Any

__all__ = ["SYNC_POLL_S", "SignedBackend", "quicken", "reserve_master_port", "sign"]

SYNC_POLL_S = 0.02  # how often a node waiting in the rendezvous reads its state (torch: 1 s)
_MAC = hashlib.sha256().digest_size


class SignedBackend:
    """A `RendezvousBackend` that signs what it writes and refuses what it did not sign."""

    def __init__(self, inner: Any, key: bytes) -> None:
        self._inner = inner
        # Bound to the store key the state lives under (a round's run id): a state signed for
        # one round is refused under another's.
        self._key = hmac.new(key, str(getattr(inner, "_key", "")).encode(), "sha256").digest()

    @property
    def name(self) -> str:
        return str(self._inner.name)

    def get_state(self) -> tuple[bytes, Any] | None:
        got = self._inner.get_state()
        return None if got is None else (self._open(got[0]), got[1])

    def set_state(self, state: bytes, token: Any = None) -> tuple[bytes, Any, bool] | None:
        got = self._inner.set_state(self._seal(state), token)
        return None if got is None else (self._open(got[0]), got[1], got[2])

    def _seal(self, state: bytes) -> bytes:
        return hmac.new(self._key, state, "sha256").digest() + state

    def _open(self, bits: bytes) -> bytes:
        mac, state = bits[:_MAC], bits[_MAC:]
        if len(bits) < _MAC or not hmac.compare_digest(
            mac, hmac.new(self._key, state, "sha256").digest()
        ):
            from torch.distributed.elastic.rendezvous import RendezvousStateError

            raise RendezvousStateError(
                "the rendezvous state in the store was not written by this job's launchers "
                "(another process reached the store on this machine's loopback): it was not read"
            )
        return state


def sign(key: bytes) -> None:
    """From now on, every rendezvous state of this process is signed with `key` (one job's)."""
    import torch.distributed.elastic.rendezvous.dynamic_rendezvous as dynamic

    holder = dynamic._BackendRendezvousStateHolder
    unsigned_init = holder.__init__

    def __init__(self: Any, backend: Any, settings: Any, cache_duration: int = 1) -> None:
        signed: Any = SignedBackend(backend, key)  # a RendezvousBackend by its methods
        unsigned_init(self, signed, settings, cache_duration)

    holder.__init__ = __init__  # type: ignore[method-assign]


def quicken() -> None:
    """The three costs above, removed (before any job: the zygote's launchers share it)."""
    import torch.distributed.elastic.rendezvous.dynamic_rendezvous as dynamic

    original_delay = dynamic._delay

    def _delay(seconds: Any) -> None:
        if not isinstance(seconds, tuple):  # the random skew (a range) is skipped
            original_delay(min(float(seconds), SYNC_POLL_S))

    def get_method_name(depth: int = 2) -> str:
        try:
            return sys._getframe(depth).f_code.co_name
        except ValueError:
            return "no_method_name"

    holder = dynamic._BackendRendezvousStateHolder
    original_init = holder.__init__

    def __init__(self: Any, backend: Any, settings: Any, cache_duration: int = 1) -> None:
        original_init(self, backend, settings, cache_duration=0)  # the SYNC poll bounds reads

    dynamic._delay = _delay
    dynamic.get_method_name = get_method_name
    holder.__init__ = __init__  # type: ignore[method-assign]


_held: list[socket.socket] = []  # the port reserved for the current attempt's rank 0


def reserve_master_port() -> None:
    """From now on, the master port torch's rendezvous picks stays reserved by this process."""
    import torch.distributed.elastic.rendezvous.api as api

    def get_free_port() -> int:
        for sock in _held:
            sock.close()  # the previous attempt's ranks are gone
        _held.clear()
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(("", 0))  # every address: whichever rank 0 serves on, it is ours
        _held.append(sock)
        return int(sock.getsockname()[1])

    api.get_free_port = get_free_port
