"""Other machines: the join agents' channel (channel.py), the cluster of agents a supervisor
serves (cluster.py), a node on another machine (remote_node.py), the files between them
(files.py), and the join agent itself (join_agent.py: `elastic-nb join`)."""
