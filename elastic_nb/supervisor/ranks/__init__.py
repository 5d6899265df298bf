"""What the supervisor learns from ranks: their records (rank_state, rank_book), their logs
(log_tailer), their stacks and flight recorders asked on demand (evidence, probes), and a session's
connections to them (rank_links)."""
