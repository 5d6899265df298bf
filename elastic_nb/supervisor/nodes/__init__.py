"""Other machines, as the notebook's supervisor reaches them: the join agents' channel
(channel.py), the cluster of agents a supervisor serves (cluster.py), a join agent as seen from
here (agent_link.py), a group's site on another machine (remote_site.py), and the files between them
(files.py). The join agent itself runs elastic_nb.join_agent."""
