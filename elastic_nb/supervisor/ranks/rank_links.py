"""A session's ranks on the line: each rank's connection to the session's Unix socket, who may
connect (a rank the agent started, by the pid the kernel reports for the peer), and whether every
rank of an attempt is connected and alive.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable

import anyio
from anyio.abc import ByteStream

from elastic_nb import protocol
from elastic_nb.common.rank_state import RankState
from elastic_nb.supervisor.processes.peers import peer_pid
from elastic_nb.supervisor.processes.site import Site
from elastic_nb.supervisor.ranks.rank_book import RankBook

__all__ = ["Link", "RankLinks"]

log = logging.getLogger(__name__)

HELLO_WAIT_S = 5.0  # a rank's hello may come before the agent's START event names its pid


RankConnection = protocol.connection.AsyncConnection[protocol.sessions.RankNews]


class Link:
    """One rank's connection."""

    def __init__(self, r: RankState, conn: RankConnection) -> None:
        self.r = r
        self._conn = conn

    async def send(self, msg: protocol.sessions.SessionOrder) -> None:
        await self._conn.send(msg)


class RankLinks:
    def __init__(
        self,
        session_id: str,
        book: RankBook,
        until: Callable[[Callable[[], bool], float], Awaitable[bool]],
        changed: Callable[[], None],
        ran: Callable[[Link, protocol.sessions.Ran], None],
    ) -> None:
        """`until`: the session's wait for a condition; `changed`: tell the session;
        `ran`: a rank's answer for a cell."""
        self._session, self._book = session_id, book
        self._until, self._changed, self._ran = until, changed, ran
        self._links: dict[tuple[int, int], Link] = {}

    def of(self, attempt: int) -> list[Link]:
        return [link for (a, _), link in sorted(self._links.items()) if a == attempt]

    def linked(self, r: RankState) -> bool:
        return (r.attempt, r.rank) in self._links

    def drop(self, r: RankState) -> None:
        self._links.pop((r.attempt, r.rank), None)

    def up(self, attempt: int, nproc: int) -> bool:
        """Every rank of the attempt is connected and alive."""
        links = self.of(attempt)
        # alive, even if its watcher has not run yet: a cell sent now would meet a dead rank
        return len(links) == nproc and all(self._book.site(link.r).alive(link.r) for link in links)

    async def serve(
        self, stream: ByteStream, peer: int | None = None, site: Site | None = None
    ) -> None:
        """One connection (the listener's handler, or a rank on another machine whose agent
        relays it, `peer` its pid as the agent saw it, `site` the group's there): a hello, then the
        rank's answers."""
        conn = RankConnection(stream, protocol.sessions.rank_news)
        link: Link | None = None
        try:
            async for msg, _ in conn:  # till the rank's end, or the session's (it closes them)
                if link is None:
                    if msg["kind"] != protocol.sessions.RANK_HELLO:
                        raise protocol.wire.ProtocolError(f"{msg['kind']!r} before rank_hello")
                    link = await self._hello(conn, msg, peer, site)
                    if link is None:
                        return
                elif msg["kind"] == protocol.sessions.RAN:
                    self._ran(link, msg)
        except protocol.wire.ProtocolError as e:
            log.warning("session %s: dropped a rank's connection: %s", self._session, e)
        finally:
            await conn.aclose()

    async def _hello(
        self,
        conn: RankConnection,
        msg: protocol.sessions.RankHello,
        peer: int | None,
        site: Site | None,
    ) -> Link | None:
        """A rank of ours, by its machine and its pid there (the kernel's word on the peer, not
        the message's; on another machine, its kernel's word as its agent heard it): a pid is
        a rank's only on the machine it runs on."""
        attempt, rank = msg["attempt"], msg["rank"]
        await self._until(lambda: self._book.get(attempt, rank) is not None, HELLO_WAIT_S)
        r = self._book.get(attempt, rank)
        if peer is None:
            peer = peer_pid(conn.stream.extra(anyio.abc.SocketAttribute.raw_socket, None))
        if r is None:
            why = "no such rank"
        elif r.died_at is not None:
            why = "that rank has ended"
        elif self._book.site(r).number != (site.number if site else 0):
            why = f"that rank runs on {self._book.site(r).label}"
        elif r.pid != peer:
            why = f"torchelastic started pid {r.pid} as that rank"
        else:
            why = None
        if r is None or why is not None:
            log.warning(
                "session %s: refused a connection from pid %s as rank %s of attempt %s: %s",
                self._session,
                peer,
                rank,
                attempt,
                why,
            )
            return None
        link = Link(r, conn)
        self._links[(attempt, rank)] = link
        self._changed()
        return link
