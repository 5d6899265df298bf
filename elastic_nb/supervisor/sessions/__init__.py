"""Persistent sessions (%elastic up): the session's ranks, restarts and cells (session), one cell on
its ranks (session_cell), the journal a restart replays (journal), and the cells the kernel follows
(followed)."""
