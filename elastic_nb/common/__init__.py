"""What every process of elastic_nb shares: the protocol between them, the job's spec, the run
directory's layout, process ownership (markers, pidfds), what travels pickled, the registry of
supervisors, the words of a summary, and keeping a job's sockets on loopback. Nothing here
imports torch, IPython or anyio at module level."""
