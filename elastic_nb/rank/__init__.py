"""What runs in every rank: the bootstrap of a one-off job's rank, a session's loop of cells, the
records a cell leaves (outcomes) and the flight recorder's answers (recorder). Imported before
torch: keep it light."""
