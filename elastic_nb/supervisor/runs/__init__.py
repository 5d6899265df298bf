"""Running ranks to an outcome: the rank group jobs and sessions share (rank_group), a one-off job's
state machine (job), what a diagnosis finds (diagnosis), what the kernel is told (reporter), the
summary that closes a run (summary)."""
