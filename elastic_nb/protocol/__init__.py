"""The protocol between elastic_nb's processes: one module a channel, each the one place its
messages are defined (a TypedDict each, its `kind` a literal unique on the channel), and what they
share.

* `kernel`: kernel (and the JupyterLab panel) <-> supervisor, over a Unix socket;
* `launcher`: launcher -> supervisor, over a pipe, and its assignment on its stdin;
* `sessions`: a session's ranks <-> supervisor, over a Unix socket per session;
* `agents`: a join agent (another machine's node) <-> supervisor, over ZeroMQ with CURVE;
* `rank_probes`: the supervisor's questions to a rank's probe thread, over a FIFO;
* `records`: the records inside messages (alerts, chips, log batches, summaries);
* `wire`: the framing every socket channel shares, and the checker every reader goes through;
* `connection`: the framed connection both ends of a socket channel use (requests matched to
  their replies).

``python -m elastic_nb.protocol`` lists every channel's messages with their fields.
"""

from __future__ import annotations

from elastic_nb.protocol import (
    agents,
    connection,
    kernel,
    launcher,
    rank_probes,
    records,
    sessions,
    wire,
)

__all__ = [
    "CHANNELS",
    "REPLIES",
    "Message",
    "agents",
    "connection",
    "kernel",
    "launcher",
    "rank_probes",
    "records",
    "sessions",
    "wire",
]

# Any message of any channel (what a framed connection sends).
Message = (
    kernel.KernelRequest
    | kernel.KernelNews
    | launcher.LauncherNews
    | sessions.RankNews
    | sessions.SessionOrder
    | agents.NodeNews
    | agents.NodeOrder
)

# Each direction of each channel: its name, and the union its reader checks frames against.
CHANNELS: dict[str, object] = {
    "kernel -> supervisor": kernel.KernelRequest,
    "supervisor -> kernel": kernel.KernelNews,
    "launcher -> supervisor": launcher.LauncherNews,
    "session rank -> supervisor": sessions.RankNews,
    "supervisor -> session rank": sessions.SessionOrder,
    "join agent -> supervisor": agents.NodeNews,
    "supervisor -> join agent": agents.NodeOrder,
}

# The directions whose messages ask for an answer: the type of each request's reply data.
REPLIES: dict[str, dict[str, type]] = {
    "kernel -> supervisor": kernel.REPLIES,
    "supervisor -> join agent": agents.ANSWERS,
}
