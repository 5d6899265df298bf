"""The join agent's process (`elastic-nb join HOST:PORT`), on another machine: its connection to
the notebook's supervisor and what it does there (agent.py), a group it serves, a LocalSite a
round (served_group.py), and its groups' connections to the notebook's machine, relayed
(relay.py). What it shares with the supervisor (the channel, the files, the launcher pool, the
local site) stays where the supervisor keeps it."""
