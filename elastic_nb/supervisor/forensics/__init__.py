"""Pure judgements on what the supervisor observed: which rank broke an attempt (verdict), where
every rank was (stacks), who fell out of step in the collectives (collectives, desync), and when
torchelastic's agent is stuck or the ranks silent (watchdogs). No I/O, no processes."""
