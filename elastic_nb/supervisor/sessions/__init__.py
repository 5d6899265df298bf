"""Persistent sessions (%elastic up): the session's ranks, restarts and cells (session), its states
and the moves between them (session_state), one cell on its ranks (session_cell), the journal a
restart replays (journal) and its replay (replay), the cells the kernel follows (followed), and
--hang-after while a cell runs (hang_watch)."""
